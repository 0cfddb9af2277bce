"""The one skip-or-fail of the tests that need the machine's tools (tests/required.py):
a skip naming the fix, a failure under the variable CI sets."""

import sys

import pytest

from tests.required import TOOLS, require_binary


def test_a_missing_binary_skips_with_the_fix_or_fails_where_it_is_required(monkeypatch):
    monkeypatch.delenv(TOOLS, raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"no-such-tool is not installed \(as root: apt-get install -y x\)"):
        require_binary("no-such-tool", "apt-get install -y x")
    monkeypatch.setenv(TOOLS, "1")
    with pytest.raises(pytest.fail.Exception, match="DILOCO_REQUIRE_TOOLS=1 but no-such-tool is not installed"):
        require_binary("no-such-tool", "apt-get install -y x")
    assert require_binary(sys.executable, "never needed") == sys.executable
