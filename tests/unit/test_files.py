"""diloco.files: the one way a file is written whole."""

import json
import stat

import pytest

from diloco.files import atomic_write, atomic_write_json, private_dir, replacing
from diloco.tape import TapeWriter
from diloco.syncer.pushlog import PushLogWriter


def test_a_file_is_the_new_one_with_its_mode_and_no_temporary_left(tmp_path):
    path = tmp_path / "sub" / "tls.key"
    atomic_write(path, b"old", mode=0o600)
    atomic_write(path, "new", mode=0o600)
    assert path.read_bytes() == b"new" and stat.S_IMODE(path.stat().st_mode) == 0o600
    atomic_write_json(tmp_path / "a.json", {"b": 1, "a": [2]})
    assert json.loads((tmp_path / "a.json").read_text()) == {"a": [2], "b": 1}
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o600  # a run's state is its owner's alone
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a.json", "sub", "tls.key"]


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "model.safetensors"
    atomic_write(path, b"old")
    with pytest.raises(RuntimeError, match="disk full"):
        with replacing(path) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("disk full")
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]


def mode(path):
    return stat.S_IMODE(path.stat().st_mode)


def test_the_writers_of_a_runs_state_make_it_owner_only(tmp_path):
    # Snapshot files and initial values go through atomic_write, tapes and push logs are
    # appended: none may be readable by the group or others, nor their new directories.
    atomic_write(tmp_path / "initial-F0.npz", b"values")
    with replacing(tmp_path / "model.safetensors") as tmp:
        tmp.write_bytes(b"model")
    tape = TapeWriter(tmp_path / "shard0" / "tape-S0.jsonl")
    tape.append("start", 0.0)
    tape.close()
    push_log = PushLogWriter(tmp_path / "shard1" / "pushes-S1.log")
    push_log.close()
    assert mode(tmp_path / "shard0") == mode(tmp_path / "shard1") == 0o700
    for name in ("initial-F0.npz", "model.safetensors", "shard0/tape-S0.jsonl", "shard1/pushes-S1.log"):
        assert mode(tmp_path / name) == 0o600, name


def test_a_private_directory_leaves_an_existing_one_as_the_user_made_it(tmp_path):
    (tmp_path / "mine").mkdir(mode=0o750)
    assert private_dir(tmp_path / "mine") == tmp_path / "mine" and mode(tmp_path / "mine") == 0o750
    assert mode(private_dir(tmp_path / "a" / "b")) == 0o700
