"""The sparse 2-bit codec (``diloco.codec.sparse``): which values a block keeps, what they
decode to, its byte count, replay bit for bit, error feedback on a learner's pushes and on
a shard's condensed replies, and payloads or settings it refuses."""

import dataclasses

import numpy as np
import pytest
import torch

from diloco.codec import accumulate, check_payload, checksum, decode, encode, norm_of
from diloco.codec import sparse
from diloco.config import BLOCK_SIZE
from diloco.errors import CodecError, InvalidArgument
from diloco.fragments import Piece
from diloco.learner.config import LearnerConfig
from diloco.learner.core.sync import encode_push
from diloco.syncer.config import MergeConfig
from tests.unit.test_mirrors import close_condensed, sq
from tests.unit.test_syncer_shard import Learner, make_shard


def _values(size, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(size) * rng.uniform(1e-3, 3, size)).astype(np.float32)


@pytest.mark.parametrize("size,block,kept", [(1000, 128, 16), (128, 128, 1), (300, 128, 128), (5, 128, 16),
                                             (4 * 256 + 3, 256, 40), (77, 2, 1)])
def test_each_block_keeps_its_largest_values_signed_at_two_bits(size, block, kept):
    x = _values(size)
    x[:min(size, block) // 2] = x[0]  # ties: the lower index wins
    e = encode("w", x, encoding="sparse", block_size=block, kept=kept)
    assert e.spec.kept == kept and e.spec.byte_length == len(e.payload) == sparse.nbytes(size, block, kept, "float16")
    d = decode(e.spec, e.payload).numpy()
    for start in range(0, size, block):
        chunk, got = x[start:start + block], d[start:start + block]
        k = min(kept, chunk.size)
        want = np.sort(np.argsort(-np.abs(chunk), kind="stable")[:k])
        assert np.array_equal(np.flatnonzero(got), want[np.abs(chunk[want]) > 0])
        # The scale: the smallest float16 with 1.5 scales >= the block's largest kept value.
        scale = np.float32(np.abs(got).max() / 1.5) if got.any() else 0.0
        kept_x, kept_d = chunk[want], got[want]
        assert np.all(np.abs(kept_x) <= 1.5 * scale * (1 + 1e-6))
        assert set(np.round(np.abs(kept_d[kept_d != 0]) / scale, 5)) <= {0.5, 1.5}
        assert np.all(np.sign(kept_d[kept_d != 0]) == np.sign(kept_x[kept_d != 0]))
        assert np.all(np.abs(kept_d - kept_x) <= 0.5 * scale * (1 + 1e-6) + 1e-30)  # the nearest level


def test_a_block_of_128_keeping_16_costs_22_bytes_a_third_of_int4():
    x = _values(128 * 1000)
    e = encode("w", x, encoding="sparse", kept=16)
    assert len(e.payload) == 22 * 1000 == 1000 * (16 + 16 // 4 + 2)  # indices, codes, a float16 scale
    assert len(encode("w", x, encoding="int4").payload) == 66 * 1000
    dense = encode("w", x, encoding="sparse", kept=128)  # every value kept: no indices, 2 bits each
    assert len(dense.payload) == 34 * 1000 and np.count_nonzero(decode(dense.spec, dense.payload).numpy()) == x.size
    assert sparse.kept_for(0.125, BLOCK_SIZE) == 16 and sparse.kept_for(1e-9, 128) == 1 and sparse.kept_for(1, 128) == 128


def test_encoding_replays_bit_for_bit_and_every_decode_path_agrees():
    x = _values(10 * 128 + 50, seed=3)
    a, b = encode("w", x, encoding="sparse", kept=16), encode("w", torch.from_numpy(x.copy()), encoding="sparse", kept=16)
    assert a == b
    d = decode(a.spec, a.payload)
    into = torch.empty(x.size)
    decode(a.spec, a.payload, out=into)
    assert torch.equal(d, into)
    out = np.zeros(x.size, np.float32)
    sumsq = accumulate([(a, 1.0)], out, overwrite=True)
    assert np.array_equal(out, d.numpy())
    assert sumsq == pytest.approx(float(np.dot(d.double().numpy(), d.double().numpy())), rel=1e-12)
    assert norm_of(a.spec, a.payload) == pytest.approx(float(torch.linalg.vector_norm(d.double())), rel=1e-12)
    two = np.ones(x.size, np.float32)
    accumulate([(a, 0.25), (a, 0.5)], two)
    assert np.allclose(two, 1 + 0.75 * d.numpy(), rtol=0, atol=1e-6)


def test_error_feedback_sends_everything_a_sparse_push_drops_later():
    """Pushes of one parameter's deltas with the learner's residual: the decoded pushes sum
    to the deltas' sum less the last residual, and that residual stays bounded (what a
    push drops is sent once it has grown into a block's largest values)."""
    piece = Piece(tensor="w", row_start=0, row_stop=64, shape=(64, 32), embedding=False, tensor_rows=64)
    g = torch.Generator().manual_seed(0)
    anchor, residual = [torch.zeros(64, 32)], None
    sent, moved, residual_norms = torch.zeros(64, 32, dtype=torch.float64), torch.zeros(64, 32, dtype=torch.float64), []
    for _ in range(200):
        params = [anchor[0] - 0.01 * torch.randn(64, 32, generator=g)]
        moved += (anchor[0] - params[0]).double()
        encoded, residual = encode_push([piece], params, anchor, residual, "sparse", 128, True, kept=16)
        sent += decode(encoded[0].spec, encoded[0].payload).double()
        residual_norms.append(float(torch.linalg.vector_norm(residual[0])))
    assert torch.allclose(sent + residual[0].double(), moved, atol=1e-4)
    # The residual stops growing: a fixed point, far below the deltas' own sum.
    assert max(residual_norms[-50:]) < 1.3 * max(residual_norms[50:100]) < 0.5 * float(torch.linalg.vector_norm(moved))


def test_sparse_condensed_replies_carry_what_the_last_one_left_out():
    """Three learners take turns and apply sparse replies as a learner does: the shard's
    mirror follows each learner's real anchor (up to its int8 drift), and a learner is off
    the global values by exactly what its last reply left out (``rounding_sq``), which stays
    bounded over 90 rounds (error feedback through the mirror)."""
    shard, initial = make_shard(num_fragments=1, chain=2, reply_codec="sparse", reply_density=0.125)
    learners = [Learner(f"L{i}", shard, initial, seed=i) for i in range(3)]
    state = shard.fragments[0]
    for learner in learners:
        shard.mirror(0, learner.name, shard.full(0))
    offs = []
    for rnd in range(90):
        learner = learners[rnd % 3]
        learner.push(0, now=rnd, scale=0.02)
        close_condensed(shard, 0, now=rnd + 0.5)
        update = shard.update_for(0, learner.version[0], learner.name)
        learner.apply(update)
        if update.segments[0].kind != "delta":
            continue
        assert {t.spec.encoding for t in update.segments[0].tensors} <= {"sparse", "fp32"}
        mirror = state.mirrors[learner.name]
        gap = sq(a.numpy().reshape(-1) - b for a, b in zip(learner.anchor[0], mirror.believed()))
        off = sq(a.numpy() - p for a, p in zip(learner.anchor[0], state.params))
        assert gap <= 4 * mirror.drift_sq + 1e-12
        assert off == pytest.approx(mirror.rounding_sq, rel=0.05, abs=1e-9)
        offs.append(off)
    assert len(offs) > 60 and max(offs[-30:]) < 2 * max(offs[10:40])


def _spec_with(e, payload):
    return dataclasses.replace(e.spec, checksum=checksum(payload), byte_length=len(payload))


@pytest.mark.parametrize("damage,match", [("outside", "stay below 128"), ("repeat", "ascend strictly"),
                                          ("descend", "ascend strictly"), ("last block", "stay below 40")])
def test_indices_outside_their_block_or_repeated_are_refused(damage, match):
    e = encode("w", _values(2 * 128 + 40), encoding="sparse", kept=16)
    payload = bytearray(e.payload)
    if damage == "outside":
        payload[15] = 200
    elif damage == "repeat":
        payload[16 + 3] = payload[16 + 2]
    elif damage == "descend":
        payload[0], payload[1] = payload[1], payload[0]
    else:
        payload[32 + 15] = 45
    with pytest.raises(CodecError, match=match):
        check_payload(_spec_with(e, bytes(payload)), bytes(payload))


def test_specs_a_sparse_payload_cannot_have_are_refused():
    e = encode("w", _values(300), encoding="sparse", kept=16)
    with pytest.raises(CodecError, match="kept per block must be in"):
        check_payload(dataclasses.replace(e.spec, kept=129), e.payload)
    with pytest.raises(CodecError, match="needs"):
        check_payload(dataclasses.replace(e.spec, kept=15), e.payload)
    with pytest.raises(CodecError, match="only sparse payloads keep"):
        int4 = encode("w", _values(300), encoding="int4")
        check_payload(dataclasses.replace(int4.spec, kept=16), int4.payload)
    with pytest.raises(CodecError, match="block size must be an integer in"):
        encode("w", _values(300), encoding="sparse", block_size=512, kept=16)
    with pytest.raises(CodecError, match="element 3 is nan"):
        x = _values(300)
        x[3] = np.nan
        encode("w", x, encoding="sparse", kept=16)


@pytest.mark.parametrize("density", [0, -0.5, 1.5, float("nan")])
def test_a_density_outside_0_1_is_refused_by_learners_and_shards(density):
    with pytest.raises(InvalidArgument, match=r"delta density must be in \(0, 1\]"):
        LearnerConfig(delta_density=density)
    with pytest.raises(InvalidArgument, match=r"reply density must be in \(0, 1\]"):
        MergeConfig(reply_density=density)


def test_sparse_replies_need_the_condensed_downlink():
    with pytest.raises(InvalidArgument, match="needs the condensed downlink"):
        MergeConfig(reply_codec="sparse", downlink="chain")
