"""diloco replay's inputs: a restored shard's snapshot is verified with the run's secret, never an empty key."""

import json

import pytest
import torch
from safetensors.torch import save_file

from diloco.config import RunConfig
from diloco.errors import NotFound
from diloco.command import main
from diloco.cli.replay import replay


def finished_run(tmp_path, restored: bool):
    """A finished run's files as far as replay reads them before replaying any round."""
    run_dir = tmp_path / "run"
    (run_dir / "shard0").mkdir(parents=True)
    (run_dir / "run.json").write_text(RunConfig().to_json())
    (run_dir / "summary.json").write_text(json.dumps({"final_versions": {"0": 1}}))
    save_file({"w": torch.zeros(1)}, str(run_dir / "model.safetensors"))
    records = [{"kind": "start", "t": 0.0, "config": {}}]
    if restored:
        records.append({"kind": "restore", "t": 1.0, "snapshot": 3})
    (run_dir / "shard0" / "tape-S0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


@pytest.mark.parametrize("secret", [None, "", "\n"])
def test_a_restored_shard_is_not_replayed_without_the_runs_secret(tmp_path, capsys, secret):
    run_dir = finished_run(tmp_path, restored=True)
    if secret is not None:
        (run_dir / "secret").write_text(secret)
    assert main(["replay", str(run_dir)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("diloco: error: ") and "secret is missing or empty: shard0 restored from a snapshot" in line


def test_a_run_whose_shards_never_restored_needs_no_secret(tmp_path):
    run_dir = finished_run(tmp_path, restored=False)
    with pytest.raises(NotFound, match="no push log"):  # past the secret, at the next input
        replay(run_dir)
