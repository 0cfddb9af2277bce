"""A short soak: `diloco local --chaos` with every fault kind (network faults on emulated
sites, kills, a shard restart) in one seeded schedule, real processes, real namespaces;
the run's own checker passes, and the same checker fails on the run's history once a
violation is put in."""

import json
import shutil
import subprocess
import sys

import pytest

from tests.cluster.test_local import TINY
from tests.netsites import bridges, namespaces, require_sites
from diloco.cli.chaos import FAULT_KINDS

pytestmark = pytest.mark.cluster

EVERY_KIND = "cut:6,cut-shard:6,cut-coordinator:6,isolate-coordinator:6,flap:6,starve:6,kill,restart-shard"


@pytest.mark.timeout(300)
def test_a_short_soak_with_every_fault_kind_keeps_every_invariant(tmp_path):
    require_sites()
    before = namespaces(), bridges()
    out = tmp_path / "run"
    proc = subprocess.run(
        # A fault every 2 s on average, each kind once per 8: every kind within about 30 s;
        # the learners' 3000 steps take more than 60 s here (1500 took 46 s once numpy no
        # longer spun a BLAS thread in every process, and the run ended before the eighth
        # kind; a run that ends by itself: a time limit stops learners that a fault just
        # kept from their drain).
        [sys.executable, "-m", "diloco", "local", "--learners", "3", "--shards", "2", "--steps", "3000",
         "--batch-size", "8", "--link-mbit", "50", "--chaos", EVERY_KIND, "--chaos-every", "2",
         "--chaos-seed", "5", "--out", str(out), *TINY], capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "check.json").read_text())
    assert report["ok"] and report["violation"] is None, report
    assert [i["name"] for i in report["invariants"] if i["ok"]] == [
        "replay", "versions", "merged_once", "no_merge_after_failure", "progress", "learners", "eval"]
    # Every kind happened (a shard restart is recorded as restart_shard).
    assert {k.replace("restart-shard", "restart_shard") for k in FAULT_KINDS} <= set(report["faults"]), report["faults"]
    chaos = [json.loads(line) for line in (out / "chaos.jsonl").read_text().splitlines()]
    faults = [c for c in chaos if c["kind"] == "fault"]
    assert len([c for c in chaos if c["kind"] == "heal"]) == len(faults)  # every network fault was healed
    # Cut off for longer than a lease, a learner is failed and replaced after the heal.
    assert any(c["kind"] == "replace" and c["cause"] == "partition" for c in chaos)
    assert "check: all 7 invariants hold after" in proc.stderr  # the console is stderr
    assert (namespaces(), bridges()) == before  # every site, veth and the hub are gone

    # The same history, broken: a round merged twice, then a final model that differs.
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    tape = broken / "shard0" / "tape-S0.jsonl"
    lines = tape.read_text().splitlines(keepends=True)
    first_round = next(i for i, line in enumerate(lines) if json.loads(line)["kind"] == "round")
    tape.write_text("".join(lines[:first_round + 1] + [lines[first_round]] + lines[first_round + 1:]))
    result = subprocess.run([sys.executable, "-m", "diloco", "check", str(broken), "--json"],
                            capture_output=True, text=True, timeout=120)
    verdict = {i["name"]: i["ok"] for i in json.loads(result.stdout)["invariants"]}
    assert result.returncode == 1 and not verdict["merged_once"] and not verdict["versions"], result.stdout
    tape.write_text("".join(lines))
    model = broken / "model.safetensors"
    from safetensors.torch import load_file, save_file

    state = load_file(str(model))
    name = sorted(state)[0]
    state[name] = state[name] + 1e-3
    save_file(state, str(model))
    result = subprocess.run([sys.executable, "-m", "diloco", "check", str(broken)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 1 and result.stdout.startswith("check: VIOLATION replay: shard"), result.stdout
