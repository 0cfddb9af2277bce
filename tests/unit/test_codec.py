"""The wire codec: int4 error bounds, the C kernel bit for bit against the torch reference,
every validation failure named, and zstd framing limits."""

import contextlib
import dataclasses
import logging
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diloco.codec import (
    TensorSpec,
    checksum,
    chunk_payload_bytes,
    decode,
    dequantize_int4,
    dequantize_int4_reference,
    encode,
    encode_quantized,
    expected_byte_length,
    frame,
    quantize_int4,
    quantize_int4_reference,
    Unframer,
    unframe,
)
from diloco.codec import int4
from diloco.config import BLOCK_SIZE
from diloco.errors import CodecError

HAVE_KERNEL = int4._kernel is not None
needs_kernel = pytest.mark.skipif(not HAVE_KERNEL, reason="diloco.codec._int4 is not built")
PATHS = [pytest.param("c", marks=needs_kernel), "torch"]
SCALE_DTYPES = ["float16", "float32"]
SCALE_BITS = {"float16": torch.int16, "float32": torch.int32}
fast = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@contextlib.contextmanager
def kernel_path(path):
    """Run the body on the C kernel or on the torch reference (the fallback)."""
    if path == "c":
        assert int4._kernel is not None
        yield
        return
    saved = int4._kernel
    int4._kernel = None
    try:
        yield
    finally:
        int4._kernel = saved


def sample(n, seed=0, scale=1.0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale


def steps(scales, numel, block_size):
    """The quantization step (the scale) of every element."""
    return scales.float().repeat_interleave(block_size)[:numel]


def same_bits(a, b):
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


sizes = st.integers(0, 700)
block_sizes = st.sampled_from([1, 2, 3, 16, 17, 32, 64, 100, 128])
seeds = st.integers(0, 2**31 - 1)
exponents = st.integers(-30, 12)
finite32 = st.floats(allow_nan=False, allow_infinity=False, width=32)


# ---------------------------------------------------------------------------------------
# Error bounds


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
@fast
@given(n=sizes, block_size=block_sizes, seed=seeds, exponent=exponents)
def test_round_trip_error_is_at_most_half_a_step(path, scale_dtype, n, block_size, seed, exponent):
    x = sample(n, seed, 2.0**exponent)
    with kernel_path(path):
        packed, scales = quantize_int4(x, block_size, scale_dtype)
        y = dequantize_int4(packed, scales, n, block_size)
    # Half a step, plus the rounding of x / scale and of q * scale (a few ulp of the step).
    assert bool(((y - x).abs() <= steps(scales, n, block_size) * (0.5 + 1e-6) + 1e-44).all())


@pytest.mark.parametrize("path", PATHS)
@fast
@given(values=st.lists(finite32, max_size=200), block_size=block_sizes)
def test_error_bound_holds_for_any_finite_float32(path, values, block_size):
    # float32 scales: no overflow anywhere in the float32 range, subnormals included.
    x = torch.tensor(values, dtype=torch.float32)
    with kernel_path(path):
        packed, scales = quantize_int4(x, block_size, "float32")
        y = dequantize_int4(packed, scales, x.numel(), block_size)
    assert bool(torch.isfinite(scales).all()) and bool((scales >= 0).all())
    err = (y.double() - x.double()).abs()
    assert bool((err <= steps(scales, x.numel(), block_size).double() * (0.5 + 1e-6) + 1e-44).all())


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
def test_all_zero_and_representable_constant_blocks_are_exact(path, scale_dtype):
    # A constant c is exact when c / 7 is a value of the scale dtype (then q = +-7).
    constants = [0.0, 7.0, -7.0, 21.0, -0.4375, 7 * 2.0**-10, -7 * 1024.0]
    x = torch.tensor([c for c in constants for _ in range(64)], dtype=torch.float32)
    with kernel_path(path):
        packed, scales = quantize_int4(x, 64, scale_dtype)
        y = dequantize_int4(packed, scales, x.numel(), 64)
        assert torch.equal(y, x)
        assert scales[0] == 0 and torch.equal(packed[:32], torch.zeros(32, dtype=torch.uint8))
        assert torch.equal(decode(*_spec_payload(encode("z", torch.zeros(3, 5), scale_dtype=scale_dtype))),
                           torch.zeros(3, 5))


def _spec_payload(encoded):
    return encoded.spec, encoded.payload


@pytest.mark.parametrize("path", PATHS)
def test_rounds_half_to_even_like_torch_round(path):
    # absmax 7 gives scale 1 exactly, so x / scale = x.
    x = torch.tensor([7.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.4999998])
    with kernel_path(path):
        packed, scales = quantize_int4(x, 8, "float16")
        y = dequantize_int4(packed, scales, 8, 8)
    assert float(scales[0]) == 1.0
    assert y.tolist() == [7.0, 0.0, 2.0, 2.0, -0.0, -2.0, -2.0, 3.0]


@pytest.mark.parametrize("path", PATHS)
def test_stochastic_rounding_is_unbiased(path):
    """Hoeffding: each error lies in an interval one step long, so the mean of M
    independent errors deviates from its expectation by more than
    step * sqrt(ln(2 / delta) / (2 M)) with probability below delta (= 1e-9 here)."""
    n, draws = 256, 300
    # Every x / scale sits 0.3 above an integer (absmax 7, scale 1): round-to-nearest is
    # biased by -0.3 everywhere, so the test would catch rounding that is not stochastic.
    x = (torch.arange(n) % 13 - 6).float() + 0.3
    x[::64] = 7.0
    generator = torch.Generator().manual_seed(1234)
    total = torch.zeros(n, dtype=torch.float64)
    with kernel_path(path):
        for _ in range(draws):
            packed, scales = quantize_int4(x, 64, "float16", generator)
            total += dequantize_int4(packed, scales, n, 64).double() - x.double()
    assert bool((scales == 1.0).all())
    mean_error = total / draws
    delta = 1e-9
    per_element = math.sqrt(math.log(2 * n / delta) / (2 * draws))  # union bound over n
    overall = math.sqrt(math.log(2 / delta) / (2 * draws * n))
    assert float(mean_error.abs().max()) < per_element
    assert abs(float(mean_error.mean())) < overall
    with kernel_path(path):
        packed, scales = quantize_int4(x, 64, "float16")
    nearest_bias = float((dequantize_int4(packed, scales, n, 64) - x).mean())
    assert abs(nearest_bias) > 10 * overall  # the test has teeth


@needs_kernel
@pytest.mark.parametrize("block_size", [3, 64])
def test_stochastic_rounding_stays_within_seven(block_size):
    # x / scale = 7 plus u = 1 - 2^-24 rounds to 8.0f: without the clamp, q = 8 wraps to -8.
    x = torch.tensor([7.0, -7.0, 3.0] * 64)
    u = torch.full_like(x, 1 - 2.0**-24)
    packed, scales = quantize_int4_reference(x, block_size, "float16", u)
    # (-7 + u and 3 + u round up to -6 and 4: floor sees the float sum, a 2^-24 effect.)
    assert dequantize_int4_reference(packed, scales, x.numel(), block_size)[::3].tolist() == [7.0] * 64
    payload = bytearray(int4.int4_nbytes(x.numel(), block_size, "float16"))
    view = memoryview(payload)
    status, _, _ = int4._kernel.quantize(
        x.numpy(), x.numel(), block_size, 2, u.numpy(), 1, view[: packed.numel()], view[packed.numel() :]
    )
    assert status == 0 and bytes(payload[: packed.numel()]) == packed.numpy().tobytes()


@pytest.mark.parametrize("path", PATHS)
def test_stochastic_rounding_is_reproducible_from_the_seed(path):
    x = sample(1000, 3)
    with kernel_path(path):
        a = quantize_int4(x, 64, "float16", torch.Generator().manual_seed(7))
        b = quantize_int4(x, 64, "float16", torch.Generator().manual_seed(7))
        c = quantize_int4(x, 64, "float16", torch.Generator().manual_seed(8))
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])


# ---------------------------------------------------------------------------------------
# The C kernel is the reference, bit for bit


@needs_kernel
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
@pytest.mark.parametrize("stochastic", [False, True])
@settings(max_examples=60, deadline=None)
@given(n=sizes, block_size=block_sizes, seed=seeds, exponent=exponents)
def test_kernel_is_bit_identical_to_reference(scale_dtype, stochastic, n, block_size, seed, exponent):
    x = sample(n, seed, 2.0**exponent)
    if n:
        x[seed % n] = x[seed % n] * 3  # an outlier somewhere
    generator = torch.Generator().manual_seed(seed) if stochastic else None
    uniforms = torch.rand(n, generator=torch.Generator().manual_seed(seed)) if stochastic else None
    _assert_kernel_matches_reference(x, block_size, scale_dtype, generator, uniforms)


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(values=st.lists(finite32, max_size=64), block_size=st.sampled_from([1, 2, 5, 16, 64]))
def test_kernel_matches_reference_on_any_float32(values, block_size):
    # block size 1 makes every value its own absmax: scales across the whole float range,
    # subnormals, powers of two and the float16 edges.
    x = torch.tensor(values, dtype=torch.float32)
    _assert_kernel_matches_reference(x, block_size, "float32", None, None)
    if bool((x.abs() <= 65504 * 7).all()):
        _assert_kernel_matches_reference(x, block_size, "float16", None, None)


@needs_kernel
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
def test_kernel_matches_reference_on_scale_edges(scale_dtype):
    half_edges = [2.0**-24, 2.0**-14, 6.1e-5, 65504.0, 65472.0, 65504 * 7, 0.14285714, 1e-30, 1.4e-45]
    values = []
    for v in half_edges:
        for f in (1.0, 7.0, 1 / 7, 1 + 2**-12, 1 - 2**-12):
            values += [v * f, -v * f]
    x = torch.tensor(values, dtype=torch.float32)
    x = x[x.abs() <= (65504 * 7 if scale_dtype == "float16" else math.inf)]
    for block_size in (1, 2, 3):
        _assert_kernel_matches_reference(x, block_size, scale_dtype, None, None)


def _assert_kernel_matches_reference(x, block_size, scale_dtype, generator, uniforms):
    n = x.numel()
    packed, scales = quantize_int4(x, block_size, scale_dtype, generator)
    ref_packed, ref_scales = quantize_int4_reference(x, block_size, scale_dtype, uniforms)
    assert torch.equal(packed, ref_packed)
    assert torch.equal(scales.view(SCALE_BITS[scale_dtype]), ref_scales.view(SCALE_BITS[scale_dtype]))
    assert same_bits(dequantize_int4(packed, scales, n, block_size),
                     dequantize_int4_reference(packed, scales, n, block_size))
    with kernel_path("torch"):
        assert same_bits(dequantize_int4(packed, scales, n, block_size),
                         dequantize_int4_reference(packed, scales, n, block_size))


@needs_kernel
@pytest.mark.parametrize("block_size", [3, 64])
def test_results_do_not_depend_on_thread_count(block_size, monkeypatch):
    # Large enough to be split (2^18 elements per thread); an odd block size makes the
    # ranges start on even elements only by construction.
    x = sample(3 * (1 << 18) + 11, 5)
    results = []
    for threads in (1, 3, 8):
        monkeypatch.setattr(int4, "math_threads", lambda t=threads: t)
        packed, scales = quantize_int4(x, block_size, "float16", torch.Generator().manual_seed(1))
        results.append((packed, scales.view(torch.int16), dequantize_int4(packed, scales, x.numel(), block_size)))
    for packed, scales, values in results[1:]:
        assert torch.equal(packed, results[0][0]) and torch.equal(scales, results[0][1])
        assert same_bits(values, results[0][2])
    uniforms = torch.rand(x.numel(), generator=torch.Generator().manual_seed(1))
    ref_packed, _ = quantize_int4_reference(x, block_size, "float16", uniforms)
    assert torch.equal(results[0][0], ref_packed)


# ---------------------------------------------------------------------------------------
# Encode / decode and every validation failure


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (7,), (3, 5), (2, 3, 65), (129,)])
def test_encode_decode_round_trip_odd_lengths_and_partial_blocks(path, shape):
    x = sample(math.prod(shape), 11).reshape(shape)
    with kernel_path(path):
        encoded = encode("w", x, block_size=64)
        y = decode(encoded.spec, encoded.payload)
        packed, scales = quantize_int4_reference(x, 64, "float16")
    spec = encoded.spec
    assert (spec.name, spec.shape, spec.dtype, spec.encoding) == ("w", shape, "float32", "int4")
    assert spec.byte_length == len(encoded.payload) == (x.numel() + 1) // 2 + 2 * -(-x.numel() // 64)
    assert spec.checksum == checksum(encoded.payload)
    assert y.shape == shape and same_bits(y.reshape(-1), dequantize_int4_reference(packed, scales, x.numel(), 64))
    if x.numel() % 2:
        assert encoded.payload[x.numel() // 2] >> 4 == 0  # the unused high nibble


def test_payload_layout_is_nibbles_then_little_endian_scales():
    x = torch.tensor([7.0, -1.0, 2.0])  # scale 1: q = 7, -1, 2
    encoded = encode("w", x, block_size=4, scale_dtype="float16")
    assert encoded.payload == bytes([0x07 | 0xF0, 0x02]) + np.float16(1.0).astype("<f2").tobytes()


@pytest.mark.parametrize("path", PATHS)
def test_fp32_encoding_round_trip_is_exact(path):
    x = torch.tensor([[0.0, -0.0, 1e-45, -3.4e38], [1.0 / 3, 65505.0, -1e-40, 2.0**-149]])
    with kernel_path(path):
        encoded = encode("w", x, encoding="fp32")
        y = decode(encoded.spec, encoded.payload)
    assert (encoded.spec.block_size, encoded.spec.scale_dtype) == (0, "")
    assert encoded.payload == x.numpy().astype("<f4").tobytes()
    assert same_bits(y, x)


def test_encode_accepts_other_float_dtypes_and_rejects_integers():
    x = sample(100, 2).to(torch.bfloat16)
    assert same_bits(decode(*_spec_payload(encode("w", x, encoding="fp32"))), x.float())
    with pytest.raises(CodecError, match="'ids'.*floating point"):
        encode("ids", torch.arange(4))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("encoding", ["int4", "fp32"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("position", [0, 63, 64, 130, 200])
def test_nan_and_inf_are_rejected_naming_tensor_and_element(path, encoding, bad, position):
    x = sample(201, 4)
    x[position] = bad
    with kernel_path(path), pytest.raises(CodecError, match=rf"tensor 'w\.b': element {position} is {bad}"):
        encode("w.b", x, encoding=encoding)


@pytest.mark.parametrize("path", PATHS)
def test_nan_is_found_whatever_the_block_size(path):
    for block_size in (1, 3, 16, 17, 64, 100):
        for position in (0, 15, 16, 47, 48, 99):
            x = sample(100, position)
            x[position] = math.nan
            with kernel_path(path), pytest.raises(CodecError, match=f"element {position} is nan"):
                quantize_int4(x, block_size, "float32", name="w")


@pytest.mark.parametrize("path", PATHS)
def test_float16_scale_overflow_suggests_float32(path):
    x = sample(128, 1)
    x[70] = 1e6
    with kernel_path(path), pytest.raises(CodecError, match=r"tensor 'w': block 1 .*float16.*scale_dtype='float32'"):
        encode("w", x, block_size=64)
    with kernel_path(path):
        y = decode(*_spec_payload(encode("w", x, scale_dtype="float32")))
    assert abs(float(y[70]) - 1e6) <= 1e6 / 14


@pytest.fixture(scope="module")
def encoded():
    return encode("layer.w", sample(300, 9).reshape(10, 30), block_size=64)


def _with_checksum(spec, payload):
    return dataclasses.replace(spec, checksum=checksum(payload))


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_any_single_corrupted_byte_is_detected(encoded, data):
    position = data.draw(st.integers(0, encoded.spec.byte_length - 1))
    flip = data.draw(st.integers(1, 255))
    corrupted = bytearray(encoded.payload)
    corrupted[position] ^= flip
    with pytest.raises(CodecError, match=r"tensor 'layer.w': checksum mismatch \(expected 0x[0-9a-f]{8}, got 0x"):
        decode(encoded.spec, bytes(corrupted))


@pytest.mark.parametrize("payload_change", [lambda p: p[:-1], lambda p: p + b"\0", lambda p: b""])
def test_truncated_or_extended_payload(encoded, payload_change):
    payload = payload_change(encoded.payload)
    with pytest.raises(CodecError, match=rf"'layer.w': payload is {len(payload)} bytes, expected 160"):
        decode(encoded.spec, payload)


def test_shape_that_does_not_match_the_byte_length(encoded):
    spec = dataclasses.replace(encoded.spec, shape=(10, 31))
    with pytest.raises(CodecError, match=r"shape \(10, 31\) .* needs 165 payload bytes, but byte_length says 160"):
        decode(spec, encoded.payload)
    for shape in [(10, -30), (10.0, 30), [10, 30]]:
        with pytest.raises(CodecError, match="shape"):
            decode(dataclasses.replace(encoded.spec, shape=shape), encoded.payload)


def test_wrong_block_size(encoded):
    spec = dataclasses.replace(encoded.spec, block_size=32)
    message = r"block size 32, float16 scales\) needs 170 payload bytes, but byte_length says 160"
    with pytest.raises(CodecError, match=message):
        decode(spec, encoded.payload)
    for bad in (0, -64, 64.0, True):
        with pytest.raises(CodecError, match="block size must be a positive integer"):
            decode(dataclasses.replace(encoded.spec, block_size=bad), encoded.payload)
    with pytest.raises(CodecError, match="block size 64 does not match the configured 128"):
        decode(encoded.spec, encoded.payload, block_size=128)


def test_wrong_scale_dtype_dtype_or_encoding(encoded):
    cases = [
        (dict(scale_dtype="bfloat16"), "scale dtype must be one of"),
        (dict(scale_dtype="float32"), "float32 scales\\) needs 170 payload bytes"),
        (dict(dtype="float64"), "dtype 'float64' is not supported"),
        (dict(encoding="int8"), "unknown encoding 'int8'"),
        (dict(encoding="fp32"), "fp32 payloads have no blocks or scales"),
    ]
    for change, message in cases:
        with pytest.raises(CodecError, match=message):
            decode(dataclasses.replace(encoded.spec, **change), encoded.payload)
    with pytest.raises(CodecError, match="scale dtype 'float16' does not match the configured 'float32'"):
        decode(encoded.spec, encoded.payload, scale_dtype="float32")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
@pytest.mark.parametrize("bad_scale", [math.nan, math.inf, -math.inf, -1.0])
def test_non_finite_or_negative_scale_with_a_valid_checksum(path, scale_dtype, bad_scale):
    encoded = encode("w", sample(200, 1), block_size=64, scale_dtype=scale_dtype)
    width = 2 if scale_dtype == "float16" else 4
    payload = bytearray(encoded.payload)
    offset = 100 + 2 * width  # third block's scale
    payload[offset : offset + width] = np.array([bad_scale], dtype=f"<f{width}").tobytes()
    spec = _with_checksum(encoded.spec, payload)
    out = torch.full((200,), 5.0)
    with kernel_path(path), pytest.raises(CodecError, match=rf"tensor 'w': scale of block 2 is {bad_scale}"):
        decode(spec, bytes(payload), out=out)
    assert bool((out == 5.0).all())  # nothing written before the checks passed


def test_negative_zero_scale_is_accepted():
    encoded = encode("w", torch.zeros(64))
    payload = bytearray(encoded.payload)
    payload[32:34] = b"\x00\x80"
    assert torch.equal(decode(_with_checksum(encoded.spec, payload), bytes(payload)), torch.zeros(64))


@pytest.mark.parametrize("path", PATHS)
def test_decode_into_out_and_from_a_memoryview_slice(path):
    x = sample(1000, 8).reshape(10, 100)
    with kernel_path(path):
        # Doubling x doubles every float16 scale exactly and keeps every q.
        a, b = encode("a", x), encode("b", x * 2)
        stream = memoryview(a.payload + b.payload)
        out = torch.empty(1000)
        y = decode(b.spec, stream[a.spec.byte_length :], out=out)
        assert y.data_ptr() == out.data_ptr()
        assert same_bits(decode(a.spec, stream[: a.spec.byte_length]) * 2, y)


def test_encode_quantized_sends_exactly_what_was_applied():
    x = sample(333, 6).reshape(3, 111)
    packed, scales = quantize_int4(x.reshape(-1), 64, "float16", torch.Generator().manual_seed(3))
    applied = dequantize_int4(packed, scales, x.numel(), 64).reshape(x.shape)
    encoded = encode_quantized("u", (3, 111), packed, scales, 64, "float16")
    assert encoded.spec.byte_length == expected_byte_length((3, 111), "int4", 64, "float16")
    assert same_bits(decode(encoded.spec, encoded.payload), applied)
    with pytest.raises(CodecError, match="scales are float16, not float32"):
        encode_quantized("u", (3, 111), packed, scales, 64, "float32")
    with pytest.raises(CodecError, match="do not match shape"):
        encode_quantized("u", (3, 112), packed, scales, 64)


def test_fallback_warns_once(caplog):
    int4._warn_fallback.cache_clear()
    with kernel_path("torch"), caplog.at_level(logging.WARNING, logger="diloco.codec.int4"):
        quantize_int4(torch.ones(4))
        quantize_int4(torch.ones(4))
    assert len([r for r in caplog.records if "falls back to torch" in r.getMessage()]) == 1


# ---------------------------------------------------------------------------------------
# zstd framing


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 30_000), max_size=6),
    max_chunk_bytes=st.integers(4096, 20_000),
    compressible=st.booleans(),
    seed=seeds,
)
def test_frame_unframe_round_trip_within_chunk_limits(sizes, max_chunk_bytes, compressible, seed):
    rng = np.random.default_rng(seed)
    make = (lambda k: bytes(k)) if compressible else (lambda k: rng.bytes(k))
    payloads = [make(k) for k in sizes]
    chunks = list(frame(payloads, max_chunk_bytes=max_chunk_bytes, threads=2))
    data = b"".join(payloads)
    assert len(chunks) == -(-len(data) // chunk_payload_bytes(max_chunk_bytes))
    for chunk in chunks:
        assert len(chunk) <= max_chunk_bytes
        assert 0 < zstandard.frame_content_size(chunk) <= max_chunk_bytes
    assert unframe(chunks, len(data), max_chunk_bytes=max_chunk_bytes) == data


def test_default_chunks_hold_at_most_one_mib_even_for_random_data():
    payload = np.random.default_rng(0).bytes(3 << 20)
    chunks = list(frame([payload, memoryview(payload)[:5]]))
    assert max(map(len, chunks)) <= 1 << 20
    assert all(zstandard.frame_content_size(c) <= 1 << 20 for c in chunks)
    assert unframe(chunks, len(payload) + 5) == payload + payload[:5]


@pytest.fixture(scope="module")
def framed():
    payload = encode("w", sample(40_000, 2)).payload
    return payload, list(frame([payload], max_chunk_bytes=8192))


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_a_corrupted_chunk_raises_and_never_returns_wrong_bytes(framed, data):
    payload, chunks = framed
    index = data.draw(st.integers(0, len(chunks) - 1))
    position = data.draw(st.integers(0, len(chunks[index]) - 1))
    flip = data.draw(st.integers(1, 255))
    corrupted = bytearray(chunks[index])
    corrupted[position] ^= flip
    broken = chunks[:index] + [bytes(corrupted)] + chunks[index + 1 :]
    try:
        result = unframe(broken, len(payload), max_chunk_bytes=8192)
    except CodecError as exc:
        assert f"chunk {index}" in str(exc) or "stream" in str(exc)
    else:  # e.g. a window-size byte: harmless, and the data must then be intact
        assert result == payload


def test_unframer_takes_one_chunk_at_a_time_and_refuses_a_short_stream(framed):
    payload, chunks = framed
    unframer = Unframer(len(payload), max_chunk_bytes=8192)
    for i, chunk in enumerate(chunks):
        unframer.add(chunk)
        assert unframer.received == sum(zstandard.frame_content_size(c) for c in chunks[: i + 1])
        if i < len(chunks) - 1:
            with pytest.raises(CodecError, match=f"stream ended after {unframer.received} of"):
                unframer.result()
    assert unframer.result() == payload
    # A bad chunk leaves what was received so far as it was, and still no result.
    partial = Unframer(len(payload), max_chunk_bytes=8192)
    partial.add(chunks[0])
    with pytest.raises(CodecError, match="chunk 1: not a zstd frame"):
        partial.add(b"garbage")
    assert partial.received == zstandard.frame_content_size(chunks[0])
    with pytest.raises(CodecError, match="expected byte length must be >= 0"):
        Unframer(-1)


def test_unframer_touches_no_memory_before_chunks_arrive(framed):
    """A header may announce up to the push limit; the receiver must not commit that much
    memory before the bytes come (an authenticated but broken client could otherwise
    make a shard allocate 512 MiB per stream it opens)."""

    def resident() -> int:
        status = Path("/proc/self/status").read_text()
        return int(status.split("VmRSS:")[1].split()[0]) * 1024

    before = resident()
    unframer = Unframer(512 << 20)
    assert resident() - before < 16 << 20
    payload, chunks = framed
    small = Unframer(len(payload), max_chunk_bytes=8192)
    for chunk in chunks:
        small.add(chunk)
    assert small.result() == payload
    del unframer


def test_unframe_rejects_missing_extra_and_foreign_chunks(framed):
    payload, chunks = framed
    received = len(payload) - zstandard.frame_content_size(chunks[-1])
    with pytest.raises(CodecError, match=f"stream ended after {received} of the expected {len(payload)} bytes"):
        unframe(chunks[:-1], len(payload), max_chunk_bytes=8192)
    with pytest.raises(CodecError, match=f"chunk {len(chunks)}: stream carries more than the expected"):
        unframe(chunks + chunks[:1], len(payload), max_chunk_bytes=8192)
    with pytest.raises(CodecError, match="chunk 0: not a zstd frame"):
        unframe([b"definitely not zstd"], 10)
    with pytest.raises(CodecError, match="chunk 0: .* exceeds the chunk limit 4096"):
        unframe(chunks, len(payload), max_chunk_bytes=4096)
    no_size = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    chunk = no_size.compress(b"abc") + no_size.flush()
    with pytest.raises(CodecError, match="does not declare its content size"):
        unframe([chunk], 3)
    with pytest.raises(CodecError, match="is empty"):
        unframe([zstandard.ZstdCompressor().compress(b"")], 0)
    assert unframe([], 0) == b"" and list(frame([b"", b""])) == []


def test_chunk_limit_must_leave_room():
    with pytest.raises(ValueError, match="at least 4096"):
        list(frame([b"x"], max_chunk_bytes=100))
    assert (1 << 20) - chunk_payload_bytes(1 << 20) < 8192


def test_spec_is_plain_data():
    spec = TensorSpec("w", (2,), "float32", "int4", 64, "float16", 3, 0)
    assert spec.numel == 2 and hash(spec) == hash(dataclasses.replace(spec))


# --- the merge's fused paths: norm and accumulate straight from the encoded bytes ---------


@pytest.mark.parametrize("encoding", ["int4", "fp32"])
@pytest.mark.parametrize("numel", [1, 63, 64, 1000, 4097])
def test_norm_and_accumulate_match_decode(encoding, numel):
    from diloco.codec import accumulate, check_payload, norm_of

    g = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=g) * 0.05
    e = encode("x", x, encoding=encoding)
    check_payload(e.spec, e.payload)
    decoded = decode(e.spec, e.payload).view(-1)
    assert norm_of(e.spec, e.payload) == pytest.approx(float(decoded.double().norm()), rel=1e-12)
    y = torch.randn(numel, generator=g) * 0.05
    f = encode("y", y, encoding="int4")
    out = torch.randn(numel, generator=g)
    expected = out + 0.3 * decoded - 0.7 * decode(f.spec, f.payload).view(-1)
    sumsq = accumulate([(e, 0.3), (f, -0.7)], out)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    assert sumsq == pytest.approx(float(out.double().square().sum()), rel=1e-9)
    fresh = torch.full((numel,), float("nan"))
    accumulate([(e, 0.3)], fresh, overwrite=True)
    torch.testing.assert_close(fresh, 0.3 * decoded, rtol=0, atol=1e-6)


def test_check_payload_runs_decodes_checks():
    from diloco.codec import check_payload

    e = encode("w", torch.randn(100))
    bad = bytearray(e.payload)
    bad[3] ^= 1
    with pytest.raises(CodecError, match="checksum"):
        check_payload(e.spec, bytes(bad))
    with pytest.raises(CodecError, match="bytes, expected"):
        check_payload(e.spec, e.payload[:-1])


# --- messages, fallbacks and edges pinned one by one ---------------------------------------


def _message(call, *args, **kwargs):
    with pytest.raises(CodecError) as caught:
        call(*args, **kwargs)
    return str(caught.value)


def test_kernel_names_the_implementation_that_runs(caplog):
    assert int4.kernel() == ("c" if HAVE_KERNEL else "torch")
    with kernel_path("torch"):
        assert int4.kernel() == "torch"
    if HAVE_KERNEL:
        # With the extension loaded, nothing falls back (and nothing warns that it does).
        int4._warn_fallback.cache_clear()
        with caplog.at_level(logging.WARNING, logger="diloco.codec.int4"):
            quantize_int4(torch.ones(4))
            encode("w", torch.ones(4))
        assert not [r for r in caplog.records if "falls back" in r.getMessage()]


@pytest.mark.parametrize("path", PATHS)
def test_quantize_defaults_are_the_runs_block_size_with_float16_scales(path):
    x = sample(2 * BLOCK_SIZE + 2, 1)
    with kernel_path(path):
        packed, scales = quantize_int4(x)
    ref_packed, ref_scales = quantize_int4_reference(x)
    for s in (scales, ref_scales):
        assert s.dtype == torch.float16 and s.numel() == 3
    assert torch.equal(packed, ref_packed) and torch.equal(scales, ref_scales)
    assert torch.equal(ref_scales, quantize_int4_reference(x, BLOCK_SIZE, "float16")[1])
    assert encode("w", x).spec.block_size == BLOCK_SIZE


@pytest.mark.parametrize("path", PATHS)
def test_errors_name_the_tensor_or_say_tensor_when_unnamed(path):
    x = torch.tensor([1.0, math.nan, 2.0])
    with kernel_path(path):
        assert _message(quantize_int4, x) == "tensor: element 1 is nan; only finite values can be encoded"
        assert _message(quantize_int4, x, name="w") == "tensor 'w': element 1 is nan; only finite values can be encoded"
        assert _message(quantize_int4, torch.arange(4), name="ids") == (
            "tensor 'ids': expected a floating point tensor, got torch.int64")
        assert _message(quantize_int4, torch.ones(4), 0, name="w") == (
            "tensor 'w': block size must be a positive integer, got 0")
        assert _message(quantize_int4, torch.ones(4), 64, "bf16", name="w") == (
            "tensor 'w': scale dtype must be one of ['float16', 'float32'], got 'bf16'")
        assert _message(encode, "w", torch.ones(4), block_size=0) == (
            "tensor 'w': block size must be a positive integer, got 0")
        assert _message(encode, "ids", np.arange(4)) == "tensor 'ids': expected a floating point array, got int64"
        assert _message(encode, "w", torch.ones(4), encoding="int8") == (
            "tensor 'w': unknown encoding 'int8'; expected one of ('int4', 'sparse', 'fp32')")
    assert _message(quantize_int4_reference, torch.arange(4), name="ids") == (
        "tensor 'ids': expected a floating point tensor, got torch.int64")
    assert _message(quantize_int4_reference, torch.ones(4), 0, name="w") == (
        "tensor 'w': block size must be a positive integer, got 0")
    assert _message(quantize_int4_reference, torch.ones(4), -1) == "tensor: block size must be a positive integer, got -1"


@pytest.mark.parametrize("path", PATHS)
def test_float16_overflow_message_names_the_first_bad_block_and_its_values(path):
    # Block 2 overflows too, with larger values: the message is about block 1 alone.
    x = torch.zeros(192)
    x[70], x[130] = -1e6, 2e6
    message = ("tensor 'w': block 1 has |x| up to 1e+06, so its scale 142857 overflows float16 (max 65504); "
               "use scale_dtype='float32'")
    with kernel_path(path):
        assert _message(quantize_int4, x, 64, "float16", name="w") == message
        assert _message(encode, "w", x, block_size=64) == message


@pytest.mark.parametrize("path", PATHS)
def test_dequantize_int4_checks_its_buffers_and_out(path):
    x = sample(100, 2)
    packed, scales = quantize_int4(x, 64, "float16")
    with kernel_path(path):
        expected = dequantize_int4(packed, scales, 100, 64)
        assert _message(dequantize_int4, packed.to(torch.int16), scales, 100, 64) == (
            "packed nibbles must be 50 uint8 values for 100 elements, got 50 torch.int16")
        assert _message(dequantize_int4, packed[:-1], scales, 100, 64) == (
            "packed nibbles must be 50 uint8 values for 100 elements, got 49 torch.uint8")
        assert _message(dequantize_int4, packed, scales[:1], 100, 64) == (
            "need 2 scales for 100 elements in blocks of 64, got 1")
        assert _message(dequantize_int4, packed, scales.double(), 100, 64) == (
            "scales must be float16 or float32, got torch.float64")
        for out in (torch.zeros(100, dtype=torch.float64), torch.zeros(101), torch.zeros(200)[::2]):
            assert _message(dequantize_int4, packed, scales, 100, 64, out=out) == (
                "out must be a contiguous float32 CPU tensor of 100 elements")
            assert not bool(out.any())
        out = torch.empty(10, 10)
        y = dequantize_int4(packed, scales, 100, 64, out=out)
    assert y.data_ptr() == out.data_ptr() and same_bits(y, expected) and same_bits(out.view(-1), expected)


@pytest.mark.parametrize("encoding", ["int4", "fp32"])
def test_decode_refuses_an_unsuitable_out_naming_the_tensor(encoding):
    e = encode("w", sample(6, 3).reshape(2, 3), encoding=encoding)
    for out in (torch.zeros(6, dtype=torch.float64), torch.zeros(7), torch.zeros(12)[::2]):
        assert _message(decode, e.spec, e.payload, out=out) == (
            "tensor 'w': out must be a contiguous float32 CPU tensor of 6 elements")
        assert not bool(out.any())


def test_fp32_decode_writes_into_out():
    x = sample(6, 4).reshape(2, 3)
    e = encode("w", x, encoding="fp32")
    out = torch.zeros(6)
    y = decode(e.spec, e.payload, out=out)
    assert y.shape == (2, 3) and y.data_ptr() == out.data_ptr()
    assert same_bits(out, x.reshape(-1))


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_fp32_payload_with_a_non_finite_value_and_a_valid_checksum(bad):
    e = encode("w", torch.arange(5.0), encoding="fp32")
    payload = bytearray(e.payload)
    payload[12:16] = np.array([bad], dtype="<f4").tobytes()
    spec = _with_checksum(e.spec, payload)
    assert _message(decode, spec, bytes(payload)) == f"tensor 'w': element 3 is {bad}; expected finite values"


@pytest.mark.parametrize("scale_dtype, bits, accepted", [
    ("float16", 0x7C01, False),  # NaN with only the lowest mantissa bit set
    ("float16", 0x8001, False),  # the smallest negative subnormal
    ("float16", 0x8000, True),   # -0.0
    ("float16", 0x7BFF, True),   # 65504
    ("float32", 0x7F800001, False),
    ("float32", 0x80000001, False),
    ("float32", 0x80000000, True),
])
def test_scale_bit_patterns_at_the_edges(scale_dtype, bits, accepted):
    e = encode("w", torch.zeros(64), scale_dtype=scale_dtype)
    width = 2 if scale_dtype == "float16" else 4
    payload = bytearray(e.payload)
    payload[32:] = np.array([bits], dtype=f"<u{width}").tobytes()
    spec = _with_checksum(e.spec, payload)
    if accepted:
        assert torch.equal(decode(spec, bytes(payload)), torch.zeros(64))
        return
    value = float(np.array([bits], dtype=f"<u{width}").view(f"<f{width}")[0])
    assert _message(decode, spec, bytes(payload)) == (
        f"tensor 'w': scale of block 0 is {value}; scales must be finite and non-negative")


def test_spec_errors_name_the_tensor(encoded):
    spec = encoded.spec
    assert _message(decode, dataclasses.replace(spec, dtype="float64"), encoded.payload) == (
        "tensor 'layer.w': dtype 'float64' is not supported; expected 'float32'")
    assert _message(decode, dataclasses.replace(spec, block_size=0), encoded.payload) == (
        "tensor 'layer.w': block size must be a positive integer, got 0")
    assert _message(decode, dataclasses.replace(spec, encoding="fp32", scale_dtype=""), encoded.payload) == (
        "tensor 'layer.w': fp32 payloads have no blocks or scales, got block size 64 and scale dtype ''")
    fp32 = encode("v", torch.ones(4), encoding="fp32")
    assert _message(decode, dataclasses.replace(fp32.spec, shape=(5,)), fp32.payload) == (
        "tensor 'v': shape (5,) (fp32) needs 20 payload bytes, but byte_length says 16")


@pytest.mark.parametrize("path", PATHS)
def test_encode_with_a_generator_rounds_stochastically_from_its_stream(path):
    x = sample(300, 5)
    with kernel_path(path):
        e = encode("w", x, block_size=64, generator=torch.Generator().manual_seed(5))
        packed, scales = quantize_int4(x, 64, "float16", torch.Generator().manual_seed(5))
        nearest = encode("w", x, block_size=64)
    assert e.payload == packed.numpy().tobytes() + scales.numpy().astype("<f2").tobytes()
    assert e.payload != nearest.payload


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("encoding", ["int4", "fp32"])
def test_encode_takes_numpy_arrays_of_any_float_dtype_and_shape(path, encoding):
    x = sample(15, 6).reshape(3, 5)
    with kernel_path(path):
        expected = encode("w", x, encoding=encoding, block_size=4)
        for array in (x.numpy(), x.double().numpy(), np.asfortranarray(x.numpy())):
            e = encode("w", array, encoding=encoding, block_size=4)
            assert e.spec == expected.spec and e.payload == expected.payload


@pytest.mark.parametrize("path", PATHS)
def test_norm_and_accumulate_on_either_path(path):
    from diloco.codec import accumulate, norm_of

    g = torch.Generator().manual_seed(8)
    a, b = (encode(n, torch.randn(100, generator=g), block_size=64) for n in "ab")
    da, db = (decode(t.spec, t.payload).double() for t in (a, b))
    start = torch.randn(100, generator=g)
    with kernel_path(path):
        assert norm_of(a.spec, a.payload) == pytest.approx(float(da.norm()), rel=1e-12)
        empty = encode("e", torch.zeros(0))
        assert norm_of(empty.spec, empty.payload) == 0.0
        out = start.clone()
        sumsq = accumulate([(a, 0.5), (b, -2.0)], out)
        expected = start.double() + 0.5 * da - 2.0 * db
        torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5)
        assert sumsq == pytest.approx(float(out.double().square().sum()), rel=1e-12)
        fresh = torch.full((100,), math.nan)
        sumsq = accumulate([(a, 0.5), (b, -2.0)], fresh, overwrite=True)
        torch.testing.assert_close(fresh.double(), 0.5 * da - 2.0 * db, rtol=0, atol=1e-5)
        assert sumsq == pytest.approx(float(fresh.double().square().sum()), rel=1e-12)
        # The low-level merge adds unless told to overwrite.
        view = memoryview(a.payload)
        ones = np.ones(100, dtype=np.float32)
        int4.axpy_many_int4([(view[:50], view[50:])], [3.0], 100, 64, "float16", ones)
        torch.testing.assert_close(torch.from_numpy(ones).double(), 1 + 3 * da, rtol=0, atol=1e-5)


def test_accumulate_mixes_encodings_and_block_sizes():
    from diloco.codec import accumulate

    g = torch.Generator().manual_seed(9)
    x = torch.randn(6, generator=g)
    f = encode("f", x, encoding="fp32")
    q64 = encode("q64", x * 2)
    q4 = encode("q4", x * 3, block_size=4, scale_dtype="float32")
    d64, d4 = (decode(t.spec, t.payload) for t in (q64, q4))
    # fp32 and int4 together, overwriting: nothing of the old out survives.
    out = np.full((2, 3), 7.0, dtype=np.float32)
    sumsq = accumulate([(f, 0.5), (q64, 1.0), (q4, -1.0)], out, overwrite=True)
    expected = (0.5 * x + d64 - d4).reshape(2, 3)
    torch.testing.assert_close(torch.from_numpy(out), expected, rtol=0, atol=1e-6)
    assert sumsq == pytest.approx(float((torch.from_numpy(out).double() ** 2).sum()), rel=1e-9)
    # Two int4 groups add up; no overwrite keeps the old out.
    out = torch.ones(6)
    accumulate([(q64, 1.0), (q4, 1.0)], out)
    torch.testing.assert_close(out, 1 + d64 + d4, rtol=0, atol=1e-6)
    # fp32 alone still reports the squared norm.
    out = torch.ones(6)
    assert accumulate([(f, 2.0)], out) == pytest.approx(float(((1 + 2 * x).double() ** 2).sum()), rel=1e-6)
    # Nothing to add, overwriting: out is zero.
    out = torch.ones(6)
    assert accumulate([], out, overwrite=True) == 0.0 and not bool(out.any())
    for bad in (np.zeros(6, dtype=np.float64), np.zeros(12, dtype=np.float32)[::2]):
        assert _message(accumulate, [(f, 1.0)], bad) == (
            "tensor 'accumulator': out must be a contiguous float32 CPU tensor of 6 elements")
    assert _message(accumulate, [(encode("y", torch.ones(5)), 1.0)], torch.zeros(6)) == (
        "tensor 'y': 5 elements, expected 6")


def test_encode_quantized_checks_its_arrays_and_names_the_tensor():
    x = sample(333, 6)
    packed, scales = quantize_int4(x, 64, "float16")
    expected = encode_quantized("u", (3, 111), packed, scales, 64)
    assert expected.spec.name == "u" and expected.spec.shape == (3, 111)
    e = encode_quantized("u", (3, 111), packed.numpy(), scales.numpy(), 64, "float16")
    assert e.spec == expected.spec and e.payload == expected.payload
    assert _message(encode_quantized, "u", (3, 111), packed, scales.numpy().astype(">f2"), 64) == (
        "scales must be float16 or float32, got >f2")
    e = encode_quantized("u", (3, 111), packed, scales.clone().requires_grad_(), 64)
    assert e.payload == expected.payload
    assert _message(encode_quantized, "u", (3, 111), packed, scales, 32) == (
        "tensor 'u': 6 scales do not match shape (3, 111)")
    assert _message(encode_quantized, "u", (3, 111), packed, scales, 0) == (
        "tensor 'u': block size must be a positive integer, got 0")


@pytest.mark.parametrize("path", PATHS)
def test_payloads_may_be_any_contiguous_buffer(path):
    x = sample(200, 7)
    e = encode("w", x)
    assert len(e.payload) % 2 == 0
    with kernel_path(path):
        expected = decode(e.spec, e.payload)
        for view in (memoryview(e.payload).cast("H"), memoryview(e.payload).cast("B", shape=[2, len(e.payload) // 2])):
            assert same_bits(decode(e.spec, view), expected)


def test_math_threads_follows_torch_or_the_cpu_affinity(monkeypatch):
    from diloco.codec.threads import math_threads

    saved = torch.get_num_threads()
    try:
        for n in (1, len(os.sched_getaffinity(0)) + 1):
            torch.set_num_threads(n)
            assert math_threads() == n
    finally:
        torch.set_num_threads(saved)
    monkeypatch.delitem(sys.modules, "torch")
    for cpus in ({0}, {0, 1, 2}):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, cpus=cpus: cpus)
        assert math_threads() == len(cpus)


# --- framing edges -------------------------------------------------------------------------


def test_frame_takes_any_contiguous_buffer():
    data = np.random.default_rng(1).bytes(10_000)
    views = [memoryview(data).cast("H"), memoryview(data).cast("B", shape=[100, 100]), np.frombuffer(data, "<u4")]
    chunks = list(frame(views, max_chunk_bytes=4096, threads=1))
    assert unframe(chunks, 3 * len(data), max_chunk_bytes=4096) == data * 3


def test_chunk_payload_is_the_largest_whose_worst_case_frame_fits():
    def zstd_compress_bound(size):  # ZSTD_COMPRESSBOUND from zstd.h
        return size + (size >> 8) + (((128 << 10) - size) >> 11 if size < (128 << 10) else 0)

    expected = {4096: 3955, 4238: 4097, 131648: 131072}
    for max_chunk_bytes, size in expected.items():
        assert chunk_payload_bytes(max_chunk_bytes) == size
        assert zstd_compress_bound(size) + 64 <= max_chunk_bytes < zstd_compress_bound(size + 1) + 64


def test_frame_compresses_at_the_given_level():
    words = np.random.default_rng(2).choice([b"alpha", b"beta", b"gamma", b"delta", b"eps"], 3000)
    data = b" ".join(words)
    for level, chunks in ((1, list(frame([data], threads=1))), (19, list(frame([data], level=19, threads=1)))):
        cctx = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
        assert chunks == [cctx.compress(data)]


def test_frame_is_lazy_by_batches_of_twice_the_threads(monkeypatch):
    from diloco.codec import framing

    size = chunk_payload_bytes(4096)
    monkeypatch.setattr(framing, "math_threads", lambda: 3)
    for threads, batch in ((1, 2), (2, 4), (None, 6)):
        consumed = []

        def payloads():
            for i in range(20):
                consumed.append(i)
                yield bytes([i]) * size

        chunks = frame(payloads(), max_chunk_bytes=4096, threads=threads)
        first = next(chunks)
        assert len(consumed) == batch
        assert unframe([first, *chunks], 20 * size, max_chunk_bytes=4096) == b"".join(bytes([i]) * size for i in range(20))


def test_frame_compresses_a_batch_on_several_threads_in_one_call(monkeypatch):
    from diloco.codec import framing

    calls = []
    real = zstandard.ZstdCompressor

    class Spy:
        def __init__(self, **kwargs):
            self._cctx = real(**kwargs)

        def compress(self, data):
            calls.append(("compress", 1, None))
            return self._cctx.compress(data)

        def multi_compress_to_buffer(self, data, threads=0):
            calls.append(("multi", len(data), threads))
            return self._cctx.multi_compress_to_buffer(data, threads=threads)

    monkeypatch.setattr(framing.zstandard, "ZstdCompressor", Spy)
    data = np.random.default_rng(3).bytes(5 * chunk_payload_bytes(4096))
    assert unframe(frame([data], max_chunk_bytes=4096, threads=2), len(data), max_chunk_bytes=4096) == data
    assert calls == [("multi", 4, 2), ("compress", 1, None)]
    calls.clear()
    assert unframe(frame([data], max_chunk_bytes=4096, threads=1), len(data), max_chunk_bytes=4096) == data
    assert calls == [("compress", 1, None)] * 5


def test_unframer_limits_are_inclusive_and_messages_exact():
    small = zstandard.ZstdCompressor().compress(b"abc")
    assert unframe([small], 3, max_chunk_bytes=len(small)) == b"abc"  # a chunk of exactly the limit
    full = zstandard.ZstdCompressor().compress(bytes(4096))
    assert unframe([full], 4096, max_chunk_bytes=4096) == bytes(4096)  # content of exactly the limit
    over = zstandard.ZstdCompressor().compress(bytes(5000))
    assert _message(unframe, [over], 5000, max_chunk_bytes=4096) == (
        "chunk 0: declares 5000 payload bytes, over the chunk limit 4096")
    assert _message(unframe, [small + b"junk"], 3).startswith("chunk 0: corrupt zstd frame (")
    no_size = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    assert _message(unframe, [no_size.compress(b"abc") + no_size.flush()], 3) == (
        "chunk 0: zstd frame does not declare its content size")
    assert _message(unframe, [zstandard.ZstdCompressor().compress(b"")], 0) == "chunk 0: zstd frame is empty"


def test_a_one_byte_payload_frames_and_unframes():
    """The smallest payload there is (one byte, e.g. a one-element int4 tensor's packed
    nibble): its chunk declares 1 byte, which is not "empty"."""
    chunks = list(frame([b"\x07"]))
    assert len(chunks) == 1
    assert bytes(unframe(chunks, 1)) == b"\x07"
