"""diloco.files: the one way a file is written whole."""

import json
import stat

import pytest

from diloco.files import atomic_write, atomic_write_json, replacing


def test_a_file_is_the_new_one_with_its_mode_and_no_temporary_left(tmp_path):
    path = tmp_path / "sub" / "tls.key"
    atomic_write(path, b"old", mode=0o600)
    atomic_write(path, "new", mode=0o600)
    assert path.read_bytes() == b"new" and stat.S_IMODE(path.stat().st_mode) == 0o600
    atomic_write_json(tmp_path / "a.json", {"b": 1, "a": [2]})
    assert json.loads((tmp_path / "a.json").read_text()) == {"a": [2], "b": 1}
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o644
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a.json", "sub", "tls.key"]


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "model.safetensors"
    atomic_write(path, b"old")
    with pytest.raises(RuntimeError, match="disk full"):
        with replacing(path) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("disk full")
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]
