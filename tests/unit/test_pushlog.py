"""The push log round-trips every push (header and int4 payload) and survives a torn tail."""

import pytest

from diloco.errors import InvalidArgument, NotFound
from diloco.syncer.pushlog import PushLogWriter, read_push_log
from tests.unit.test_syncer_shard import Learner, make_shard
from tests.unit.test_syncer_snapshot import push


def test_round_trip_and_torn_tail(tmp_path):
    shard, initial = make_shard(quorum=2)
    l0, l1 = (Learner(f"L{i}", shard, initial, seed=i) for i in range(2))
    pushes = [push(l0, 0, now=1.0), push(l1, 1, now=1.1), push(l0, 1, now=1.2, epoch=3)]
    log = PushLogWriter(tmp_path / "pushes-S0.log")
    for i, (meta, payload, _) in enumerate(pushes):
        log.append(meta, payload, 1000 + i)
    log.close()
    with pytest.raises(InvalidArgument, match="closed"):
        log.append(pushes[0][0], pushes[0][1], 1)
    back = list(read_push_log(tmp_path / "pushes-S0.log"))
    assert [(m, w) for m, _, w in back] == [(m, 1000 + i) for i, (m, _, _) in enumerate(pushes)]
    for (_, payload, _), (_, again, _) in zip(pushes, back):
        assert [bytes(t.payload) for t in again.tensors] == [bytes(t.payload) for t in payload.tensors]
        assert again.norms == payload.norms
    # A crash mid-write leaves a torn last record: the reader keeps everything before it.
    data = (tmp_path / "pushes-S0.log").read_bytes()
    (tmp_path / "torn.log").write_bytes(data[:-7])
    assert len(list(read_push_log(tmp_path / "torn.log"))) == 2


def test_corruption_and_absence_are_clear_errors(tmp_path):
    with pytest.raises(NotFound, match="no push log"):
        list(read_push_log(tmp_path / "missing.log"))
    (tmp_path / "bad.log").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00notjs")
    with pytest.raises(InvalidArgument, match="corrupt header"):
        list(read_push_log(tmp_path / "bad.log"))
