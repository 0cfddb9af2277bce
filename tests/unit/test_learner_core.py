import math

import pytest
import torch

from diloco.errors import FailedPrecondition, InvalidArgument
from diloco.learner.config import LearnerConfig
from diloco.learner.core.schedule import fragments_due, inner_lr, send_offsets
from diloco.codec import decode
from diloco.fragments import Piece
from diloco.learner.core.sync import FragmentSync, Reply, SyncBook, delta, encode_push, merge_into, rebase_into
from diloco.learner.device import Device


def test_lr_warmup_then_cosine_to_floor():
    lrs = [inner_lr(s, 1.0, 10, 110, 0.1) for s in range(120)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[10] == pytest.approx(1.0)
    assert lrs[60] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lrs[110] == pytest.approx(0.1) and lrs[119] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))


def test_send_offsets_spread_evenly_and_each_fragment_once_per_cycle():
    assert send_offsets(4, 4) == [0, 1, 2, 3]
    assert send_offsets(4, 16) == [0, 4, 8, 12]
    assert send_offsets(8, 4) == [0, 0, 1, 1, 2, 2, 3, 3]
    offsets = send_offsets(3, 12)
    sent = [p for step in range(24) for p in fragments_due(step, offsets, 12)]
    assert sorted(sent) == [0, 0, 1, 1, 2, 2]
    assert fragments_due(4, offsets, 12) == [1] and fragments_due(16, offsets, 12) == [1]


def test_delta_is_anchor_minus_params():
    anchor, params = [torch.tensor([1.0, 2.0])], [torch.tensor([0.5, 2.5])]
    assert torch.equal(delta(anchor, params)[0], torch.tensor([0.5, -0.5]))


def test_alpha_merge():
    p = [torch.tensor([1.0, 1.0])]
    merge_into(p, [torch.tensor([3.0, 5.0])], 0.0)
    assert torch.equal(p[0], torch.tensor([3.0, 5.0]))
    merge_into(p, [torch.tensor([1.0, 1.0])], 0.5)
    assert torch.equal(p[0], torch.tensor([2.0, 3.0]))


def book():
    return SyncBook({0: FragmentSync([torch.zeros(2)], 3), 1: FragmentSync([torch.zeros(2)], 0)}, overlap_steps=2)


def reply(fragment, version, sent_step):
    return Reply(fragment, version, [torch.full((2,), float(version))], sent_step, 0)


def test_reply_waits_tau_steps_then_applies_and_resets_counters():
    b = book()
    b.count_step(100)
    b.count_step(100)
    b.receive(reply(0, 4, sent_step=5))
    assert b.due(6) == []  # arrived early: held until step 5 + tau
    (r,) = b.due(7)
    b.applied_reply(r)
    f = b.fragments[0]
    assert (f.base_version, f.tokens, f.steps) == (4, 0, 0)
    assert torch.equal(f.anchor[0], torch.full((2,), 4.0))
    assert b.fragments[1].tokens == 200 and b.late == 0


def test_late_replies_apply_on_arrival_and_are_counted():
    b = book()
    b.receive(reply(1, 1, sent_step=0))
    assert [r.version for r in b.due(9)] == [1]
    assert b.late == 1


def test_only_the_newest_reply_applies_and_stale_ones_are_dropped():
    b = book()
    b.receive(reply(0, 2, sent_step=0))  # older than base version 3
    b.receive(reply(1, 1, sent_step=0))
    b.receive(reply(1, 2, sent_step=1))
    due = b.due(10)
    assert [(r.fragment, r.version) for r in due] == [(1, 2)]
    assert b.stale_dropped == 2


def test_resync_applies_immediately_whatever_its_version():
    b = book()
    b.receive(reply(0, 9, sent_step=8))  # an answer from before the shard restarted
    b.receive(reply(0, 0, sent_step=-1))  # the restarted shard's state, version 0
    assert [(r.fragment, r.version) for r in b.due(0)] == [(0, 0)]
    assert b.due(20) == [] and b.stale_dropped == 1


def test_one_push_in_flight_per_fragment_until_replied_or_failed():
    b = book()
    assert b.sending(0, 4, None)
    assert not b.sending(0, 8, None) and b.deferred == 1  # still waiting: the next send carries both
    assert b.sending(1, 5, None)  # other fragments are independent
    b.receive(Reply(0, -1, [], 4, 0, failed=True))  # dropped or failed: may send again
    assert b.sending(0, 12, None)
    b.receive(reply(0, 2, sent_step=12))  # stale (base is 3): dropped, and the fragment is free
    assert b.due(20) == [] and b.sending(0, 16, None)
    b.receive(reply(0, 4, sent_step=16))
    (r,) = b.due(18)
    b.applied_reply(r)
    assert b.fragments[0].sent is None and b.sending(0, 20, None)


def test_rebase_keeps_the_progress_made_since_the_push():
    b = book()
    params = [torch.tensor([0.0, 0.0])]
    for _ in range(3):
        b.count_step(10)
        params[0] -= 1.0
    assert b.sending(0, 3, [params[0].clone()])  # pushed at -3: the delta covers 3 steps
    for _ in range(2):
        b.count_step(10)
        params[0] -= 1.0  # 2 more steps before the reply: now at -5
    b.receive(Reply(0, 4, [torch.tensor([10.0, 20.0])], 3, 0))
    (r,) = b.due(5)
    sent = b.rebase_from(r)
    rebase_into(params, r.values, sent)
    b.applied_reply(r, rebased=True)
    assert torch.equal(params[0], torch.tensor([8.0, 18.0]))  # global + the 2 newer steps
    f = b.fragments[0]
    assert (f.base_version, f.tokens, f.steps) == (4, 20, 2)  # those 2 steps are still to send
    assert torch.equal(delta(f.anchor, params)[0], torch.tensor([2.0, 2.0]))
    # A re-sync replaces the fragment: nothing to rebase.
    assert b.rebase_from(Reply(0, 0, [torch.zeros(2)], -1, 0)) is None


@pytest.mark.parametrize(
    "kwargs", [dict(device="tpu"), dict(steps=0), dict(eval_every_steps=0), dict(lr=0), dict(delta_codec="int2")]
)
def test_bad_config(kwargs):
    with pytest.raises(InvalidArgument):
        LearnerConfig(**kwargs)


def test_unavailable_devices_give_clear_errors():
    if not torch.cuda.is_available():
        with pytest.raises(FailedPrecondition, match="no CUDA device"):
            Device("cuda")
    try:
        import torch_xla  # noqa: F401
    except ImportError:
        with pytest.raises(FailedPrecondition, match="torch_xla is not installed"):
            Device("xla")
    assert Device("cpu").torch.type == "cpu"


def test_sync_book_counts_every_event_it_counts():
    b = book()
    assert b.sending(0, 0, None)
    assert not b.sending(0, 2, None) and not b.sending(0, 4, None)
    assert b.deferred == 2
    # Fragment 1 first in arrival order: the answer still comes sorted by fragment.
    b.receive(reply(1, 1, sent_step=0))
    b.receive(reply(0, 5, sent_step=0))
    due = b.due(9)  # both late: sent at 0, due at 2
    assert [(r.fragment, r.version) for r in due] == [(0, 5), (1, 1)] and b.late == 2 and b.stale_dropped == 0
    for r in due:
        b.applied_reply(r)
    assert b.applied == 2


def test_stale_replies_are_each_counted_and_equal_versions_keep_the_first():
    b = book()  # fragment 0 holds version 3
    b.receive(reply(0, 3, sent_step=0))  # the version it already holds: stale
    b.receive(reply(0, 2, sent_step=0))  # older: stale
    b.receive(reply(1, 2, sent_step=0))
    b.receive(reply(1, 1, sent_step=1))  # older than the one already chosen: stale
    b.receive(Reply(1, 2, [torch.zeros(2)], 2, 0))  # the same version again: the first stays
    due = b.due(10)
    assert [(r.fragment, r.version, r.sent_step) for r in due] == [(1, 2, 0)]
    assert b.stale_dropped == 4


def test_due_looks_at_every_waiting_reply():
    b = book()
    b.receive(reply(1, 0, sent_step=-1))  # a re-sync of fragment 1 first in line
    b.receive(reply(1, 7, sent_step=3))  # superseded by that re-sync
    b.receive(reply(0, 4, sent_step=9))  # not due before step 11: kept
    b.receive(reply(0, 2, sent_step=0))  # stale against fragment 0's version 3
    b.receive(reply(0, 5, sent_step=1))  # due
    assert [(r.fragment, r.version) for r in b.due(10)] == [(0, 5), (1, 0)]
    assert b.stale_dropped == 2
    assert [(r.fragment, r.version) for r in b.due(11)] == [(0, 4)]  # the kept one was not lost


def test_a_late_failure_for_an_older_push_does_not_free_the_fragment():
    b = book()
    assert b.sending(0, 0, None)
    b.receive(Reply(0, -1, [], 0, 0, failed=True))  # the push at step 0 failed
    assert b.sending(0, 8, None)
    b.receive(Reply(0, -1, [], 0, 0, failed=True))  # the same failure, reported again
    assert b.fragments[0].sent.step == 8 and not b.sending(0, 12, None)


def test_rebase_applies_to_a_push_sent_at_step_zero_and_not_without_a_push():
    b = book()
    assert b.rebase_from(reply(0, 4, sent_step=0)) is None  # nothing was sent
    kept = [torch.ones(2)]
    assert b.sending(0, 0, kept)
    assert b.rebase_from(reply(0, 4, sent_step=0)) is kept


def test_a_reply_applied_without_rebase_discards_the_counts_since_the_push():
    b = book()
    b.count_step(10)
    assert b.sending(0, 1, [torch.zeros(2)])
    b.count_step(10)
    b.receive(reply(0, 4, sent_step=1))
    (r,) = b.due(3)
    b.applied_reply(r)  # the mix rule overwrote the progress since the push
    assert (b.fragments[0].tokens, b.fragments[0].steps) == (0, 0)


def test_a_resync_drops_every_answer_it_supersedes_and_counts_each():
    b = book()
    b.receive(reply(1, 0, sent_step=-1))
    b.receive(reply(1, 7, sent_step=3))
    b.receive(reply(1, 8, sent_step=5))
    assert [(r.fragment, r.version) for r in b.due(10)] == [(1, 0)] and b.stale_dropped == 2


def test_lr_schedule_of_a_single_decay_step():
    # total - warmup = 1: the one step after warmup is the end of the cosine.
    assert inner_lr(0, 1.0, 0, 1, 0.1) == pytest.approx(1.0)
    assert inner_lr(1, 1.0, 0, 1, 0.1) == pytest.approx(0.1)


def test_a_write_rebases_onto_what_was_sent_or_mixes_with_alpha():
    """What a slice follower repeats (diloco.learner.core.sync.Write): with ``sent`` the global
    fragment plus the progress since the push; without, the mix with weight alpha."""
    from diloco.learner.core.sync import Write, write_into

    params = [torch.tensor([1.0, 2.0]), torch.tensor([[3.0]])]
    values = [torch.tensor([10.0, 20.0]), torch.tensor([[30.0]])]
    sent = [torch.tensor([0.5, 1.0]), torch.tensor([[3.0]])]
    rebased = [p.clone() for p in params]
    write_into(rebased, Write(0, values, sent=sent, alpha=0.9))  # alpha is the mix's, not the rebase's
    assert [r.tolist() for r in rebased] == [[10.5, 21.0], [[30.0]]]
    mixed = [p.clone() for p in params]
    write_into(mixed, Write(1, values, alpha=0.25))
    assert [m.tolist() for m in mixed] == [[7.75, 15.5], [[23.25]]]  # 0.25 params + 0.75 global
    overwritten = [p.clone() for p in params]
    write_into(overwritten, Write(1, values))
    assert [o.tolist() for o in overwritten] == [[10.0, 20.0], [[30.0]]]


def _pushes(feedback, deltas, block_size=64):
    """Push fragment 0 (one 2 x 64 parameter) once per entry of ``deltas``, each reply
    taken by the shard; return the sum of what the shard decoded and the book."""
    piece = Piece("w", 0, 2, (2, 64), embedding=False, tensor_rows=2)
    b = SyncBook({0: FragmentSync([torch.zeros(2, 64)], 0)}, overlap_steps=0)
    received = torch.zeros(2, 64)
    for step, d in enumerate(deltas):
        assert b.sending(0, step, None)
        f = b.fragments[0]
        (tensor,), left_out = encode_push([piece], [f.anchor[0] - d], f.anchor, f.residual, "int4", block_size, feedback)
        if feedback:
            b.quantized(0, left_out)
        received += decode(tensor.spec, tensor.payload)
        b.receive(Reply(0, step + 1, [f.anchor[0]], step, 0))
        (r,) = b.due(step)
        b.applied_reply(r)
    return received, b


def test_error_feedback_delivers_every_part_of_the_deltas_within_one_residual():
    # Each block holds one large value and small ones that int4 rounds to zero at its
    # scale (max / 7): without error feedback they never reach the shard.
    d = torch.full((2, 64), 0.02)
    d[:, 0] = 1.0
    deltas = [d.clone() for _ in range(20)]
    total = 20 * d
    with_feedback, b = _pushes(True, deltas)
    without, _ = _pushes(False, deltas)
    residual = b.fragments[0].residual[0]
    assert torch.allclose(with_feedback + residual, total, atol=1e-5)
    scale = 1.0 / 7
    assert residual.abs().max() <= scale / 2 + 1e-6  # never more than half a quantization step
    assert (total - without).abs().max() == pytest.approx(0.4, abs=1e-5)  # 20 x 0.02, all lost
    assert (total - with_feedback).abs().max() <= scale / 2 + 1e-5


def test_a_failed_push_keeps_the_residual_a_taken_one_replaces_it_and_a_resync_clears_it():
    piece = Piece("w", 0, 1, (1, 64), embedding=False, tensor_rows=1)
    b = SyncBook({0: FragmentSync([torch.zeros(1, 64)], 0)}, overlap_steps=0)
    d = torch.full((1, 64), 0.02)
    d[0, 0] = 1.0

    def push(step):
        assert b.sending(0, step, None)
        f = b.fragments[0]
        _, left_out = encode_push([piece], [f.anchor[0] - d], f.anchor, f.residual, "int4", 64, True)
        b.quantized(0, left_out)
        return left_out

    first = push(0)
    b.receive(Reply(0, 1, [torch.zeros(1, 64)], 0, 0))
    b.applied_reply(b.due(0)[0])
    assert torch.equal(b.fragments[0].residual[0], first[0])
    push(1)
    b.receive(Reply(0, -1, [], 1, 0, failed=True))  # the shard never took it
    assert torch.equal(b.fragments[0].residual[0], first[0])
    b.receive(Reply(0, 5, [torch.zeros(1, 64)], -1, 0))  # a restarted shard's state
    b.applied_reply(b.due(1)[0])
    assert b.fragments[0].residual is None


def test_a_buffer_travels_as_its_value_in_fp32_with_no_residual():
    piece = Piece("running_mean", 0, 4, (4,), embedding=False, tensor_rows=4, buffer=True)
    value = torch.tensor([1.0, 2.0, 3.0, 4.0])
    (tensor,), (left_out,) = encode_push([piece], [value], [torch.zeros(4)], None, "int4", 64, True)
    assert tensor.spec.encoding == "fp32" and torch.equal(decode(tensor.spec, tensor.payload), value)
    assert not left_out.any()


@pytest.mark.parametrize("codec", ["int4", "fp32"])
def test_a_push_carries_every_piece_by_name_in_the_codec_and_block_size_asked(codec):
    # A buffer first: the pieces after it are encoded too.
    pieces = [Piece("running_mean", 0, 4, (4,), embedding=False, tensor_rows=4, buffer=True),
              Piece("w", 0, 2, (2, 64), embedding=False, tensor_rows=2), Piece("b", 0, 1, (1, 64), embedding=False, tensor_rows=1)]
    params = [torch.ones(4), torch.randn(2, 64), torch.randn(1, 64)]
    encoded, left_out = encode_push(pieces, params, [torch.zeros_like(p) for p in params], None, codec, 64, False)
    assert left_out is None  # without error feedback there is nothing to keep
    assert [t.spec.name for t in encoded] == [p.name for p in pieces]
    assert [t.spec.encoding for t in encoded] == ["fp32", codec, codec]
    assert [t.spec.block_size for t in encoded[1:]] == [64 if codec == "int4" else 0] * 2
    anchor = [torch.zeros_like(p) for p in params]
    expected = [params[0], *delta(anchor[1:], params[1:])]  # a buffer's value, a parameter's delta
    for tensor, value in zip(encoded, expected):
        assert torch.allclose(decode(tensor.spec, tensor.payload).view_as(value), value, atol=0.3)


def test_quantized_without_a_push_being_sent_is_a_programming_error():
    b = SyncBook({0: FragmentSync([torch.zeros(1, 64)], 0)}, overlap_steps=0)
    with pytest.raises(AssertionError, match=r"^quantized\(\) follows a sending\(\) that returned True$"):
        b.quantized(0, [torch.zeros(1, 64)])


def test_a_drain_after_tokens_waits_for_the_count_and_a_later_directive_moves_it():
    """The budget's allotment: the learner leaves at the step that reaches it; a directive
    with another count (the budget moved what others over- or undershot onto it) moves it;
    a count already passed leaves now."""
    import threading
    from types import SimpleNamespace

    from diloco.learner.api import Learner

    me = SimpleNamespace(summary=SimpleNamespace(tokens=1000), _drain_at=None, stop=threading.Event(),
                         learner_id="L0", stop_reason="")
    Learner._drain(me, "drained at 5,000 tokens", 5000)
    Learner._drain(me, "drained at 4,000 tokens", 4000)
    assert me._drain_at == (4000, "drained at 4,000 tokens") and not me.stop.is_set()
    Learner._drain(me, "drained at 9,000 tokens", 9000)
    assert me._drain_at == (9000, "drained at 9,000 tokens") and not me.stop.is_set()
    me.summary.tokens = 9100
    Learner._drain(me, "drained at 3,000 tokens", 3000)
    assert me.stop.is_set() and me.stop_reason == "drained at 3,000 tokens"
