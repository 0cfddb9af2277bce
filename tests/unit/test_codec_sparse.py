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
    with pytest.raises(InvalidArgument, match=r"--delta-density must be in \(0, 1\]"):
        LearnerConfig(delta_density=density)
    with pytest.raises(InvalidArgument, match=r"--reply-density must be in \(0, 1\]"):
        MergeConfig(reply_density=density)


def test_the_reply_codec_is_the_condensed_replies_a_chain_sends_its_int4_updates():
    """Sparse replies are the default; a chain downlink (shared int4 updates, which cannot
    carry what a learner's last reply left out) is still a valid choice beside it."""
    assert MergeConfig().reply_codec == "sparse" and MergeConfig(downlink="chain").reply_codec == "sparse"


@pytest.mark.parametrize("flags,message", [
    (["--delta-codec", "sparse", "--delta-density", "2"], "diloco: error: --delta-density must be in (0, 1]"),
    (["--delta-codec", "int2"], "argument --delta-codec: invalid choice: 'int2'"),
])
def test_diloco_local_refuses_a_bad_codec_setting_in_one_line_before_anything_starts(tmp_path, flags, message):
    import subprocess
    import sys

    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "diloco", "local", *flags, "--out", str(out)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[-1].count("error") == 1 and not out.exists(), proc.stderr


@pytest.mark.parametrize("size,block,kept,scale_dtype", [
    (1000, 128, 16, "float16"), (128 * 333 + 77, 128, 16, "float16"), (5000, 128, 128, "float16"),
    (4099, 256, 40, "float32"), (77, 2, 1, "float16"), (3, 128, 16, "float16"), (1 << 18, 128, 13, "float16"),
    (1 << 18, 128, 16, "float32"), (2 * 128 + 5, 128, 127, "float16")])
def test_the_c_kernel_writes_and_reads_the_bytes_the_numpy_reference_does(size, block, kept, scale_dtype):
    from diloco.codec.int4 import native

    assert native() is not None, "the C kernel is not built"
    rng = np.random.default_rng(size)
    x = (rng.standard_normal(size) * rng.uniform(1e-6, 3, size)).astype(np.float32)
    x[:50] = x[0]  # ties
    x[60:70] = 0
    x[200:300] = 1e-30  # subnormal scales
    c = sparse.quantize(x, block, kept, scale_dtype, "w")
    assert c == sparse.quantize_reference(x, block, kept, scale_dtype, "w")
    view = memoryview(c)
    positions, values = sparse.positions_values(view, size, block, kept, scale_dtype)
    want = np.zeros(size, np.float32)
    want[positions] = values
    got = sparse.decode_into(view, size, block, kept, scale_dtype, np.full(size, 7, np.float32))
    assert np.array_equal(got, want)
    base = rng.standard_normal(size).astype(np.float32)
    added = base.copy()
    sparse.axpy(view, 0.37, size, block, kept, scale_dtype, added)
    reference = base.copy()
    reference[positions] += np.float32(0.37) * values
    assert np.array_equal(added, reference)
    assert sparse.sumsq(view, size, block, kept, scale_dtype) == pytest.approx(
        float(np.dot(values.astype(np.float64), values.astype(np.float64))), rel=1e-12)


def test_the_c_kernel_refuses_what_the_reference_refuses():
    x = _values(1000)
    x[300] = np.inf
    with pytest.raises(CodecError, match="element 300 is inf"):
        encode("w", x, encoding="sparse", kept=16)
    with pytest.raises(CodecError, match="overflows float16"):
        sparse.quantize(np.full(256, 1e6, np.float32), 128, 16, "float16", "w")


@pytest.mark.parametrize("size,block,kept,scale_dtype", [
    (128 * 40, 128, 128, "float16"), (128 * 40 + 77, 128, 128, "float32"), (1000, 128, 16, "float16"),
    (128 * 3 + 50, 128, 64, "float16"), (4099, 256, 40, "float32"), (77, 2, 1, "float16"), (3, 128, 16, "float16")])
def test_a_condensed_update_in_one_pass_is_the_reference_bit_for_bit(size, block, kept, scale_dtype):
    """``sparse.condense`` (the shard's reply: encode goal - anchor, advance the anchor by
    what it decodes to, measure what it left out) in the C kernel and in numpy: the same
    payload, the same advanced anchor, bit for bit, and the left-out norm to rounding; and
    both are the payload ``quantize`` writes for goal - anchor, decoded as a learner adds it."""
    rng = np.random.default_rng(size + kept)
    goal = (rng.standard_normal(size) * rng.uniform(1e-4, 2, size)).astype(np.float32)
    anchor = goal - (rng.standard_normal(size) * 1e-2).astype(np.float32)
    anchor[:block] = goal[:block]  # a block with nothing to send: a zero scale
    anchor[block + 5: block + 9] = goal[block + 5: block + 9] - np.float32(1e-3)  # ties
    c_anchor, ref_anchor = anchor.copy(), anchor.copy()
    c_payload, c_left = sparse.condense(goal, c_anchor, block, kept, scale_dtype, "w")
    ref_payload, ref_left = sparse.condense_reference(goal, ref_anchor, block, kept, scale_dtype, "w")
    update = goal - anchor
    assert c_payload == ref_payload == sparse.quantize_reference(update, block, kept, scale_dtype, "w")
    assert np.array_equal(c_anchor.view(np.uint32), ref_anchor.view(np.uint32))
    sent = sparse.decode_into(memoryview(c_payload), size, block, kept, scale_dtype, np.empty(size, np.float32))
    assert np.array_equal(c_anchor, anchor + sent)
    left = update.astype(np.float64) - sent
    assert c_left == pytest.approx(float(np.dot(left, left)), rel=1e-12) and ref_left == pytest.approx(c_left, rel=1e-12)
    assert c_left > 0 or size <= block  # a single block, equal to the goal: nothing to send


def test_a_condensed_update_refuses_what_encoding_refuses():
    goal = _values(1000)
    anchor = goal.copy()
    anchor[300] = np.inf
    for condense in (sparse.condense, sparse.condense_reference):
        with pytest.raises(CodecError, match="block 2 of the update holds a non-finite value"):
            condense(goal, anchor.copy(), 128, 16, "float16", "w")
        with pytest.raises(CodecError, match="overflows float16"):
            condense(np.full(256, 1e6, np.float32), np.zeros(256, np.float32), 128, 16, "float16", "w")


@pytest.mark.parametrize("kept", [16, 128])
def test_a_pushs_agreement_read_from_its_bytes_is_its_decoded_dot_product(kept):
    """``dot_and_sumsq`` (the shard's gate: a push against the fragment's reference
    direction) from the sparse bytes in the C kernel equals the dot product and squared norm
    of the decoded push, and the path that decodes first (every other encoding) agrees."""
    from diloco.codec import dot_and_sumsq
    from diloco.codec.tensor import sumsq_f32

    x, y = _values(128 * 50 + 9, seed=1), _values(128 * 50 + 9, seed=2)
    e = encode("w", x, encoding="sparse", kept=kept)
    decoded = decode(e.spec, e.payload).double().numpy()
    dot, norm_sq = dot_and_sumsq(e, y, np.empty(x.size, np.float32))
    assert dot == pytest.approx(float(np.dot(decoded, y.astype(np.float64))), rel=1e-12)
    assert norm_sq == pytest.approx(float(np.dot(decoded, decoded)), rel=1e-12)
    int4 = encode("w", x, encoding="int4")
    decoded4 = decode(int4.spec, int4.payload).double().numpy()
    dot4, norm4 = dot_and_sumsq(int4, y, np.empty(x.size, np.float32))
    assert dot4 == pytest.approx(float(np.dot(decoded4, y.astype(np.float64))), rel=1e-12)
    assert norm4 == pytest.approx(float(np.dot(decoded4, decoded4)), rel=1e-12)
    assert sumsq_f32(y) == sumsq_f32(y.copy()) == pytest.approx(float(np.dot(y.astype(np.float64), y)), rel=1e-12)


def test_the_sparse_kernels_write_the_same_bits_with_and_without_their_avx2_clones(tmp_path):
    """The per-block sparse and mirror loops are compiled twice on x86-64 (AVX2, chosen at
    load time, and the baseline): built here with the clones off, the baseline writes the
    bytes and values the installed module does."""
    import importlib.machinery
    import importlib.util
    import shutil
    import subprocess
    import sysconfig
    from pathlib import Path

    from diloco.codec.int4 import native

    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None or native() is None:
        pytest.fail("this test needs a C compiler and the built kernel (both are what builds the package)")
    source = Path(sparse.__file__).with_name("_int4.c")
    built = tmp_path / "_int4.so"
    subprocess.run([compiler, "-O3", "-ffp-contract=off", "-DDILOCO_NO_CLONES", "-shared", "-fPIC",
                    f"-I{sysconfig.get_paths()['include']}", str(source), "-o", str(built)], check=True)
    loader = importlib.machinery.ExtensionFileLoader("_int4", str(built))
    baseline = importlib.util.module_from_spec(importlib.util.spec_from_loader("_int4", loader))
    loader.exec_module(baseline)
    installed = native()
    rng = np.random.default_rng(7)
    size = 128 * 500 + 33
    goal = (rng.standard_normal(size) * rng.uniform(1e-4, 2, size)).astype(np.float32)
    anchor = goal - (rng.standard_normal(size) * 1e-2).astype(np.float32)
    for kept in (16, 128):
        assert installed.sparse_quantize(goal, size, 128, kept, 2, 2) == baseline.sparse_quantize(goal, size, 128, kept, 2, 2)
        a, b = anchor.copy(), anchor.copy()
        assert installed.sparse_condense(goal, a, size, 128, kept, 2) == baseline.sparse_condense(goal, b, size, 128, kept, 2)
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    codes = [np.zeros(size, np.int8) for _ in range(2)]
    scales = [np.zeros(-(-size // 512), np.float32) for _ in range(2)]
    lost = [m.mirror_store(anchor, goal, c, s, size, 512) for m, c, s in zip((installed, baseline), codes, scales)]
    assert lost[0] == lost[1] and np.array_equal(codes[0], codes[1]) and np.array_equal(scales[0], scales[1])
    for kept in (16, 128):
        mirrors = [(codes[0].copy(), scales[0].copy()) for _ in range(2)]
        fused = [m.mirror_condense(c, s, anchor, goal, goal - 1e-3, size, 512, 128, kept, 2)
                 for m, (c, s) in zip((installed, baseline), mirrors)]
        assert fused[0] == fused[1] and np.array_equal(mirrors[0][0], mirrors[1][0])
        assert np.array_equal(mirrors[0][1], mirrors[1][1])
    loaded = [np.empty(size, np.float32) for _ in range(2)]
    for m, out in zip((installed, baseline), loaded):
        m.mirror_load(codes[0], scales[0], goal, out, size, 512)
    assert np.array_equal(loaded[0].view(np.uint32), loaded[1].view(np.uint32))


@pytest.mark.parametrize("block,kept", [(128, 16), (128, 1), (128, 127), (100, 13), (256, 40), (8, 3)])
def test_the_c_kernels_selection_is_the_references_on_blocks_made_to_defeat_its_guess(block, kept):
    """The kernel looks for each block's threshold among the values at or above a guess
    taken from the block before; these blocks make the guess wrong in every direction
    (scales jumping by up to 1e9 from one block to the next, most values tied at the threshold, fewer nonzero
    values than are kept, a few distinct magnitudes, heavy tails), and the bytes must still
    be the numpy reference's."""
    rng = np.random.default_rng(block * 1000 + kept)
    blocks = []
    for b in range(240):
        kind = b % 8
        if kind == 0:
            v = rng.standard_normal(block) * 10.0 ** rng.choice([-6, 0, 3])
        elif kind == 1:
            v = np.full(block, 0.5)
            v[rng.choice(block, kept // 2, replace=False)] = 2.0  # the threshold is shared by most of the block
        elif kind == 2:
            v = np.zeros(block)
            v[rng.choice(block, max(kept // 2, 1) - 1, replace=False)] = rng.standard_normal(max(kept // 2, 1) - 1)
        elif kind == 3:
            v = rng.choice([-2.0, -1.0, 0.0, 1.0, 2.0], block)
        elif kind == 4:
            v = np.clip(rng.standard_t(1.5, block), -1e4, 1e4)
        elif kind == 5:
            v = np.zeros(block)
        elif kind == 6:
            v = rng.standard_normal(block) * 1e-3
            v[rng.integers(block)] = 1e3  # one outlier: a mean far above the rest
        else:
            v = rng.uniform(-1, 1, block) * np.linspace(1e-4, 1, block)
        blocks.append(rng.permutation(v) if kind != 1 else v)
    x = np.concatenate(blocks).astype(np.float32)
    for scale_dtype in ("float16", "float32"):
        reference = sparse.quantize_reference(x, block, kept, scale_dtype, "w")
        assert sparse.quantize(x, block, kept, scale_dtype, "w") == reference
        anchor = np.zeros_like(x)
        assert sparse.condense(x, anchor, block, kept, scale_dtype, "w")[0] == reference
