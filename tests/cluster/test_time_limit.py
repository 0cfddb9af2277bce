"""`--time-limit-s`: a run stops at its limit, trained or not, says so, reports the tokens
it reached, and leaves nothing behind (the bandwidth sweep's cells that would take too
long end this way)."""

import json
import subprocess
import sys

import pytest

from tests.cluster.test_local import TINY
from tests.netsites import bridges, namespaces, require_sites

pytestmark = pytest.mark.cluster


@pytest.mark.timeout(300)
def test_dp_on_a_scarce_link_stops_at_its_time_limit_with_the_tokens_it_reached(tmp_path):
    require_sites()
    before = namespaces(), bridges()
    out = tmp_path / "dp"
    proc = subprocess.run(
        [sys.executable, "-m", "diloco", "baseline", "dp", "--workers", "2", "--steps", "5000", "--batch-size", "8",
         "--link-mbit", "1", "--time-limit-s", "20", "--out", str(out), "--json", *TINY],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["time_limited"] is True and summary["eval_loss_final"] is None and summary["curve"] == []
    assert 0 < summary["tokens"] < 2 * 5000 * 8 * 32 and 20 <= summary["wall_s"] < 60
    assert [s["mbit"] for s in summary["links"]["sites"]] == [1, 1]
    # Every step moved the whole gradient through both links: the kernel saw it.
    assert all(s["up"] > 0 and s["down"] > 0 for s in summary["links"]["sites"])
    assert not (out / "model.pt").exists()
    assert (namespaces(), bridges()) == before


@pytest.mark.timeout(300)
def test_local_stops_its_learners_at_the_time_limit_and_still_exports_the_model(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "diloco", "--insecure", "local", "--learners", "2", "--steps", "100000",
         "--batch-size", "8", "--time-limit-s", "12", "--out", str(out), "--json", *TINY],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["time_limited"] is True and not summary["interrupted"]
    assert 0 < summary["tokens"] < 2 * 100000 * 8 * 32
    assert summary["eval_loss_final"] < summary["eval_loss_start"]  # the model as far as it got
    assert "time limit of 12 s reached at" in proc.stderr
    assert all(l["state"] == "left" for l in summary["learners"])  # drained, not killed
