"""Every test here starts real processes: one pytest-xdist worker runs them all, one
after another (``--dist loadgroup``), while the other runs the in-process tests. Two
clusters at once on a 2-core machine would make their timings, not the code, decide."""

import pytest


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook turns the group into the node id
def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/cluster/" in item.nodeid:
            item.add_marker(pytest.mark.cluster)
            item.add_marker(pytest.mark.xdist_group("cluster"))
