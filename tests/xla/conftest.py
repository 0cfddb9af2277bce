"""The XLA learner's tests: they run in the XLA venv (``pip install -c constraints-xla.txt
-e ".[xla,dev]"``) with ``python -m pytest -m xla``, on PJRT's CPU client with 4 devices,
so the SPMD code path a TPU host takes (a mesh over every chip) runs on any machine. The
main venv deselects them (``-m "not xla"`` in pyproject's addopts): its torch is not the
one torch-xla pins."""

import os

import pytest

# Before torch_xla is imported anywhere in this process (and for the processes tests start).
os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "4")
DEVICES = int(os.environ["CPU_NUM_DEVICES"])


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook turns the group into the node id
def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/xla/" in item.nodeid:
            item.add_marker(pytest.mark.xla)
            # One worker runs them in order: each compiles XLA graphs on every core.
            item.add_marker(pytest.mark.xdist_group("xla"))
