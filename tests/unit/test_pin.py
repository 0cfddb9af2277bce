"""The operator's pin of the run's model (diloco.coordinator.pin) and the maximum model size: pure
checks, no sockets."""

import pytest

from diloco.coordinator.config import CoordinatorConfig
from diloco.coordinator.runtime import RunInfo
from diloco.codec import encode, values_digest
from diloco.config import RunConfig
from diloco.errors import InvalidArgument, ResourceExhausted
from diloco.manifest import Manifest
from diloco.coordinator.pin import PIN_FILE, ModelPin, build_pin, manifest_sha256, pin_of
from tests.seeded import gpt_run, model_plan, task_model

RUN = gpt_run(width=16, depth=1, heads=2, context=16, fragments=3)


def test_the_pin_is_what_an_honest_learner_registers_and_offers():
    """The coordinator's digests must be exactly a learner's Initialize values: its
    fragments' pieces as fp32 host tensors, encoded raw (diloco.learner.api._bootstrap)."""
    pin = build_pin(RUN)
    manifest, plan, state = model_plan(RUN)
    assert pin.manifest_json == manifest.to_json()
    assert pin.initial_values == tuple(
        values_digest([encode(p.name, t, encoding="fp32") for p, t in zip(f.pieces, plan.gather(f.id, state))])
        for f in plan.fragments)
    assert pin_of(task_model(RUN, learner_index=5), RUN.fragments) == pin  # every learner builds the seed model alike
    assert build_pin(RUN.__class__(**{**RUN.__dict__, "seed": 1})).initial_values != pin.initial_values


def test_a_kept_pin_is_reused_only_for_its_own_run_config(tmp_path):
    pin = build_pin(RUN)
    (tmp_path / PIN_FILE).write_text(pin.to_json(RUN))
    assert ModelPin.read(tmp_path / PIN_FILE, RUN) == pin
    assert ModelPin.read(tmp_path / PIN_FILE, gpt_run(width=16, depth=1, heads=2, context=16, fragments=2)) is None
    assert ModelPin.read(tmp_path / "absent.json", RUN) is None


def test_the_maximum_model_size_counts_elements_times_bytes():
    manifest = model_plan(RUN)[0]
    total = sum(e.numel * 4 for e in manifest.entries if e.dtype == "float32") + sum(
        e.numel * 8 for e in manifest.entries if e.dtype == "int64")
    assert manifest.total_bytes == total
    assert manifest.check_size(total) is manifest
    with pytest.raises(ResourceExhausted, match="maximum model size"):
        manifest.check_size(total - 1)
    with pytest.raises(InvalidArgument, match="max model bytes"):
        RunConfig(max_model_bytes=0)


def test_a_pinned_run_examines_manifests_against_the_pin():
    pin = build_pin(RUN)
    info = RunInfo(RUN, pin=pin)
    assert info.manifest_json == pin.manifest_json and info.initial_values == pin.initial_values
    _, plan, difference = info.examine(pin.manifest_json)
    assert difference is None and plan is None  # the run has its plan already
    wider = model_plan(gpt_run(width=24, depth=1, heads=2, context=16, fragments=3))[0]
    assert "tok_embed.weight" in info.examine(wider.to_json())[2]


def test_a_manifest_digest_pins_the_manifest_alone():
    manifest = model_plan(RUN)[0]
    info = RunInfo(RUN, manifest_sha256=manifest_sha256(manifest.to_json()))
    assert info.manifest_json == "" and info.initial_values == ()
    _, plan, difference = info.examine(manifest.to_json())
    assert difference is None and plan is not None
    wider = model_plan(gpt_run(width=24, depth=1, heads=2, context=16, fragments=3))[0]
    assert "SHA-256" in info.examine(wider.to_json())[2]


def test_the_coordinator_takes_one_pin_and_a_well_formed_digest(tmp_path):
    digest = "ab" * 32
    assert CoordinatorConfig(tmp_path, model_sha256=digest).model_sha256 == digest
    with pytest.raises(InvalidArgument, match="64 hex digits"):
        CoordinatorConfig(tmp_path, model_sha256="abc")
    with pytest.raises(InvalidArgument, match="not both"):
        CoordinatorConfig(tmp_path, model_sha256=digest, pin_model=True)
    assert Manifest.from_json(build_pin(RUN).manifest_json)
