"""What a test needs from the machine beyond the Python environment (root for emulated
sites, a Debian package's binary): without it the test skips with the reason and the fix,
except where the variable that stands for it is 1 (``.ci/run`` sets them), where it fails
instead: no silent loss of coverage.

``DILOCO_REQUIRE_SITES=1``: root, network namespaces and tc (``tests/netsites.py``).
``DILOCO_REQUIRE_TOOLS=1``: every binary a test asks for with ``require_binary`` (``.ci/run``
installs them as root: ``apt-get install -y chromium prometheus``)."""

import os
import shutil

import pytest

SITES = "DILOCO_REQUIRE_SITES"
TOOLS = "DILOCO_REQUIRE_TOOLS"


def skip_or_fail(reason: str, variable: str) -> None:
    """Skip with ``reason``, or fail with it where ``variable`` is 1."""
    if os.environ.get(variable) == "1":
        pytest.fail(f"{variable}=1 but {reason}")
    pytest.skip(reason)


def require_binary(name: str, install: str) -> str:
    """The path of the program ``name``; missing, skip (or fail under
    ``DILOCO_REQUIRE_TOOLS=1``) with ``install``, the command that provides it, e.g.
    ``require_binary("chromium", "apt-get install -y chromium")``."""
    path = shutil.which(name)
    if path is None:
        skip_or_fail(f"{name} is not installed (as root: {install})", TOOLS)
    return path
