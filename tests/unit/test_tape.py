import json

import pytest

from diloco.command import main
from diloco.errors import InvalidArgument, NotFound
from diloco.tape import TapeWriter, read_tape


def test_round_trip_and_batched_fsync(tmp_path):
    path = tmp_path / "tape.jsonl"
    tape = TapeWriter(path, fsync_every=2)
    tape.append("push", 1.0, learner="L0", fragment=3)
    tape.append("round", 2.0, fragment=3, version=1, participants=["L0"])
    tape.append("push", 3.0, learner="L1", fragment=3)  # pending until close
    tape.close()
    records = list(read_tape(path))
    assert [r["kind"] for r in records] == ["push", "round", "push"]
    assert records[1]["participants"] == ["L0"]


def test_torn_last_line_is_skipped_but_corruption_elsewhere_raises(tmp_path):
    path = tmp_path / "tape.jsonl"
    path.write_text('{"kind":"start","t":1}\n{"kind":"push","t":2,"lea')
    assert [r["kind"] for r in read_tape(path)] == ["start"]
    path.write_text('{"kind":"start","t":1}\nnot json\n{"kind":"stop","t":3}\n')
    with pytest.raises(InvalidArgument, match="line 2"):
        list(read_tape(path))
    path.write_text('{"t":1}\n')
    with pytest.raises(InvalidArgument, match="lacks"):
        list(read_tape(path))
    with pytest.raises(NotFound):
        list(read_tape(tmp_path / "missing.jsonl"))


def test_tape_show_cli(tmp_path, capsys):
    path = tmp_path / "tape.jsonl"
    tape = TapeWriter(path)
    tape.append("push", 1.0, learner="L0", fragment=0, base_version=0, tokens=64, steps=4, bytes=10, outcome="accepted")
    tape.append("round", 1.5, fragment=0, version=1, participants=["L0"], reason="all 1 live learners pushed", merge_s=0.001)
    tape.close()
    assert main(["tape", "show", str(path), "--kind", "round", "--json"]) == 0
    rounds = json.loads(capsys.readouterr().out)
    assert [r["version"] for r in rounds] == [1]
    assert main(["tape", "show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "push" in out and "round" in out and "1.0 ms" in out
    assert main(["tape", "show", str(tmp_path / "nope.jsonl")]) == 2
    assert "no tape at" in capsys.readouterr().err
