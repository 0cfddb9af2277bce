"""Fuzzing what arrives over the wire, with a fixed example budget: the unframer, push
headers and payloads, vector clocks, model manifests and snapshot manifests. Whatever the
input, the code under test either accepts it or raises a ``DilocoError`` (which the RPC
layer maps to a specific status); it never raises anything else, and a refused push
changes no state."""

import json

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diloco.clock import VectorClock
from diloco.codec import Unframer, encode, frame
from diloco.convert import MAX_CLOCK_VALUE, clock_from_proto
from diloco.errors import DilocoError
from diloco.fragments import plan_fragments
from diloco.manifest import Manifest
from diloco.snapshots import files_of
from diloco.v1 import common_pb2
from diloco.syncer.config import RoundConfig, SyncerConfig
from diloco.convert import push_meta_from_proto, push_meta_to_proto
from diloco.wire import PushMeta
from diloco.syncer.core.shard import ShardCore, inspect_payload

BUDGET = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PARAMS = [("tok_embed.weight", (16, 8)), ("block.w", (24, 8)), ("norm.running_var", (24,))]


def shard() -> ShardCore:
    plan = plan_fragments(PARAMS, 1, is_buffer=lambda name: "running" in name)
    g = torch.Generator().manual_seed(0)
    core = ShardCore(SyncerConfig(rounds=RoundConfig(quorum=2)), plan,
                     {0: [torch.randn(s, generator=g) for _, s in PARAMS]})
    core.set_membership({"L0", "L1"}, set())
    return core


def valid_push(core: ShardCore) -> tuple[PushMeta, bytes]:
    pieces = core.plan.fragments[0].pieces
    encoded = [encode(p.name, torch.full(p.shape, 0.01), encoding="fp32" if p.buffer else "int4") for p in pieces]
    meta = PushMeta("L0", 0, 0, 64, 4, 0.1, VectorClock({"L0": 1}), tuple(e.spec for e in encoded))
    return meta, b"".join(e.payload for e in encoded)


def snapshot(core: ShardCore):
    state = core.fragments[0]
    return core.pushes_received, dict(core.clock.entries), sorted(state.open), [p.copy() for p in state.params]


def same(a, b) -> bool:
    return a[:3] == b[:3] and all(np.array_equal(x, y) for x, y in zip(a[3], b[3]))


# --- the unframer ---------------------------------------------------------------------


@BUDGET
@given(chunks=st.lists(st.binary(max_size=256), max_size=4), expected=st.integers(0, 4096))
def test_the_unframer_takes_any_bytes_without_surprise(chunks, expected):
    unframer = Unframer(expected)
    try:
        for chunk in chunks:
            unframer.add(chunk)
        result = unframer.result()
    except DilocoError:
        return
    assert len(result) == expected


@BUDGET
@given(data=st.binary(min_size=1, max_size=3000), cut=st.integers(0, 10_000), flip=st.integers(0, 10_000))
def test_a_damaged_framed_stream_is_refused_or_exact(data, cut, flip):
    chunks = [bytearray(c) for c in frame([data])]
    position = flip % sum(len(c) for c in chunks)
    for chunk in chunks:  # flip one bit somewhere
        if position < len(chunk):
            chunk[position] ^= 1 << (cut % 8)
            break
        position -= len(chunk)
    unframer = Unframer(len(data))
    try:
        for chunk in chunks[: 1 + cut % len(chunks)]:
            unframer.add(bytes(chunk))
        result = unframer.result()
    except DilocoError:
        return
    assert bytes(result) == data  # accepted only if the damage did not matter (e.g. in padding)


# --- push headers and payloads ---------------------------------------------------------

u64 = st.integers(0, 2**64 - 1)
header_fields = st.fixed_dictionaries({}, optional={
    "learner_id": st.sampled_from(["", "L0", "L1", "L9", "join", "S0", "C", "L0\x00"]),
    "fragment": st.integers(0, 2**32 - 1),
    "base_version": u64,
    "tokens": u64,
    "inner_steps": u64,
    "step_time_s": st.floats(allow_nan=True, allow_infinity=True),
    "snapshot_epoch": u64,
})
tensor_fields = st.fixed_dictionaries({}, optional={
    "name": st.sampled_from(["tok_embed.weight", "block.w", "norm.running_var", "x", ""]),
    "shape": st.lists(st.integers(-3, 2**40), max_size=4),
    "dtype": st.sampled_from(["float32", "float16", "int8", ""]),
    "encoding": st.integers(0, 3),
    "block_size": st.integers(0, 2**32 - 1),
    "scale_dtype": st.sampled_from(["float16", "float32", "bfloat16", ""]),
    "byte_length": u64,
    "checksum": st.integers(0, 2**32 - 1),
})


@BUDGET
@given(fields=header_fields, tensors=st.lists(tensor_fields, max_size=4), keep=st.booleans(),
       clock=st.dictionaries(st.text(max_size=6), u64, max_size=4), payload=st.binary(max_size=512))
def test_a_crafted_push_is_refused_with_a_status_and_changes_nothing(fields, tensors, keep, clock, payload):
    core = shard()
    meta, good = valid_push(core)
    header = push_meta_to_proto(meta)
    for key, value in fields.items():
        setattr(header, key, value)
    if not keep:
        del header.tensors[:]
        for t in tensors:
            header.tensors.add(**t)
    header.clock.CopyFrom(common_pb2.VectorClock(entries=clock or {"L0": 1}))
    before = snapshot(core)
    try:
        crafted = push_meta_from_proto(header)
        core.check_header(crafted)
        core.accept(crafted, inspect_payload(crafted.specs, good if keep and not payload else payload), 1, 0.0)
    except DilocoError:
        assert same(before, snapshot(core))


# --- vector clocks ---------------------------------------------------------------------


@BUDGET
@given(entries=st.dictionaries(st.text(max_size=12), u64, max_size=8))
def test_a_clock_from_the_wire_is_bounded_or_refused(entries):
    try:
        clock = clock_from_proto(common_pb2.VectorClock(entries=entries))
    except DilocoError:
        return
    merged = VectorClock({"S0": 3}).receive("S0", clock)  # what a shard does with it
    assert all(v < MAX_CLOCK_VALUE + 1 for v in merged.entries.values())


# --- model and snapshot manifests --------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
entry = st.fixed_dictionaries({
    "name": st.sampled_from(["a", "b.weight", "", "x" * 600, "a\nb"]) | st.text(max_size=8),
    "shape": st.lists(st.integers(-2, 2**41), max_size=10) | json_values,
    "dtype": st.sampled_from(["float32", "bfloat16", "int64", "bool", "complex64", "x"]),
    "kind": st.sampled_from(["parameter", "buffer", "weights"]),
}, optional={"value": json_values})


@BUDGET
@given(raw=st.one_of(json_values, st.fixed_dictionaries({"entries": st.lists(entry, max_size=5)},
                                                           optional={"aliases": json_values})),
       fragments=st.integers(1, 8))
def test_a_model_manifest_from_the_wire_parses_or_is_refused(raw, fragments):
    try:
        manifest = Manifest.from_json(json.dumps(raw))
        manifest.plan(fragments)
    except DilocoError:
        pass


@BUDGET
@given(files=st.lists(st.fixed_dictionaries({
    "participant": st.sampled_from(["S0", "L0"]),
    "path": st.sampled_from(["S0-state.npz", "../S0-state.npz", "/etc/passwd", "a/../../b", ".", ""]) | st.text(max_size=12),
    "size_bytes": st.integers(0, 10),
    "sha256": st.text(max_size=64),
}), max_size=4))
def test_a_snapshot_manifest_never_leads_outside_its_directory(tmp_path_factory, files):
    root = tmp_path_factory.mktemp("snap") / "000001"
    root.mkdir()
    (root.parent / "S0-state.npz").write_bytes(b"")
    try:
        found = files_of(root / "manifest.json", {"snapshot_id": 1, "files": files}, "S0")
    except DilocoError:
        return
    assert all((root / name).resolve().parent == root.resolve() for name in found)

