"""The model manifest: what a run syncs of a real model (tied weights once, float buffers
tagged, integer buffers kept per learner, bf16 recorded), its plan, and hostile JSON."""

import json

import pytest
import torch
from torch import nn

from diloco.errors import InvalidArgument
from diloco.manifest import Manifest, manifest_of, synced_tensors


class Tied(nn.Module):
    def __init__(self, width=8, dtype=torch.float32):
        super().__init__()
        self.embed = nn.Embedding(32, width, dtype=dtype)
        self.norm = nn.BatchNorm1d(width, dtype=dtype)
        self.head = nn.Linear(width, 32, bias=False, dtype=dtype)
        self.head.weight = self.embed.weight
        self.register_buffer("mask", torch.ones(5000, dtype=torch.bool))  # large, non-float: not synced nor carried


def test_tied_weights_are_synced_once_and_recorded_as_aliases():
    model = Tied()
    manifest = manifest_of(model)
    names = [e.name for e in manifest.entries]
    assert "head.weight" not in names and manifest.aliases == (("head.weight", "embed.weight"),)
    tensors = synced_tensors(model, manifest)
    assert tensors["embed.weight"].data_ptr() == model.head.weight.data_ptr()  # the model's own storage
    plan = manifest.plan(2)
    assert sum(p.tensor == "embed.weight" for f in plan.fragments for p in f.pieces) >= 1
    assert not any(p.tensor == "head.weight" for f in plan.fragments for p in f.pieces)


def test_float_buffers_are_synced_as_buffers_and_integer_ones_stay_local():
    manifest = manifest_of(Tied())
    by_name = {e.name: e for e in manifest.entries}
    assert by_name["norm.running_mean"].kind == "buffer" and by_name["norm.running_mean"].synced
    tracked = by_name["norm.num_batches_tracked"]
    assert not tracked.synced and tracked.dtype == "int64" and tracked.value == (0,)
    assert not by_name["mask"].synced and by_name["mask"].value is None  # too large to carry
    pieces = {p.tensor: p for f in manifest.plan(3).fragments for p in f.pieces}
    assert pieces["norm.running_var"].buffer and not pieces["norm.weight"].buffer
    assert "norm.num_batches_tracked" not in pieces and "mask" not in pieces


def test_bf16_parameters_are_recorded_in_their_dtype():
    manifest = manifest_of(Tied(dtype=torch.bfloat16))
    assert {e.dtype for e in manifest.synced} == {"bfloat16"}
    assert manifest.first_difference(manifest_of(Tied())) == (
        "parameter 'embed.weight': [32, 8] bfloat16 here, [32, 8] float32 in the run"
    )


def test_json_round_trip_and_first_difference():
    manifest = manifest_of(Tied())
    again = Manifest.from_json(manifest.to_json())
    assert again == manifest and again.plan(2).plan_hash == manifest.plan(2).plan_hash
    assert manifest.first_difference(again) is None
    wider = manifest_of(Tied(width=16))
    assert manifest.first_difference(wider) == "parameter 'embed.weight': [32, 8] here, [32, 16] in the run".replace(
        "] here", "] float32 here").replace("] in", "] float32 in")
    untied = Tied()
    untied.head.weight = nn.Parameter(torch.zeros(32, 8))
    assert "not in the run" in manifest_of(untied).first_difference(manifest)


@pytest.mark.parametrize("text", [
    "[]",
    "not json",
    '{"entries": "x"}',
    '{"entries": [{"name": "a", "shape": [2], "dtype": "float32"}]}',
    '{"entries": [{"name": "a", "shape": [-1], "dtype": "float32", "kind": "parameter"}]}',
    '{"entries": [{"name": "a", "shape": [1,1,1,1,1,1,1,1,1], "dtype": "float32", "kind": "parameter"}]}',
    '{"entries": [{"name": "a", "shape": [1099511627777], "dtype": "float32", "kind": "parameter"}]}',
    '{"entries": [{"name": "a", "shape": [2], "dtype": "complex64", "kind": "parameter"}]}',
    '{"entries": [{"name": "a", "shape": [2], "dtype": "float32", "kind": "weights"}]}',
    '{"entries": [{"name": "", "shape": [2], "dtype": "float32", "kind": "parameter"}]}',
    '{"entries": [{"name": "a", "shape": [2], "dtype": "float32", "kind": "parameter"},'
    ' {"name": "a", "shape": [2], "dtype": "float32", "kind": "parameter"}]}',
    '{"entries": [{"name": "a", "shape": [2], "dtype": "int64", "kind": "buffer"}]}',
    '{"entries": [{"name": "a", "shape": [2], "dtype": "float32", "kind": "parameter"}], "aliases": [["b", "zz"]]}',
    '{"entries": [{"name": "a", "shape": [2], "dtype": "float32", "kind": "parameter"},'
    ' {"name": "n", "shape": [2], "dtype": "int64", "kind": "buffer", "value": [1]}]}',
    '{"entries": [{"name": "a", "shape": [2], "dtype": "float32", "kind": "parameter"},'
    ' {"name": "n", "shape": [1], "dtype": "int64", "kind": "buffer", "value": ["x"]}]}',
])
def test_hostile_manifests_are_refused_with_invalid_argument(text):
    with pytest.raises(InvalidArgument):
        Manifest.from_json(text)


def test_oversized_manifest_is_refused_before_parsing():
    entry = {"name": "a" * 500, "shape": [1], "dtype": "float32", "kind": "parameter"}
    with pytest.raises(InvalidArgument, match="exceeds"):
        Manifest.from_json(json.dumps({"entries": [entry] * 40000}))


def test_tensors_without_readable_memory_are_told_apart_by_identity():
    """On XLA (and the meta device) a tensor exposes no data pointer: ties are found by
    object identity, and distinct tensors are never taken for one."""
    with torch.device("meta"):
        model = Tied()
    manifest = manifest_of(model)
    assert manifest.aliases == (("head.weight", "embed.weight"),)
    assert {e.name for e in manifest.synced} == {"embed.weight", "norm.weight", "norm.bias", "norm.running_mean", "norm.running_var"}


def test_a_view_sharing_storage_is_an_alias():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.ones(4))
            self.register_buffer("b", self.a.data)  # the same memory under another key

    assert manifest_of(Shared()).aliases == (("b", "a"),)
