"""The validator's judgement: a push counts by its agreement with an outer gradient the
validator trained itself (``diloco.validator``)."""

import dataclasses
import math

import pytest
import torch

from diloco.clients.syncer import DecodedSample
from diloco.errors import FailedPrecondition, InvalidArgument
from diloco.task import TaskError
from diloco.validator.config import ValidatorConfig
from diloco.validator.core import cosine, trust
from diloco.validator.runner import Validator
from tests.seeded import gpt_run

RUN = gpt_run(width=16, depth=1, heads=2, context=16, fragments=2)


def test_trust_is_nothing_against_or_across_the_direction_and_whole_along_it():
    assert trust(-0.5, 0.05) == 0.0 and trust(0.0, 0.05) == 0.0
    assert trust(0.025, 0.05) == pytest.approx(0.5)
    assert trust(0.05, 0.05) == 1.0 and trust(0.9, 0.05) == 1.0
    assert trust(None, 0.05) == 1.0  # a zero push: nothing to judge, it moves nothing
    assert cosine(0.0, 0.0, 4.0) is None and cosine(2.0, 4.0, 1.0) == pytest.approx(1.0)
    assert cosine(math.nan, 1.0, 1.0) == -1.0  # a push that makes no number counts nothing


def test_the_validators_settings_are_checked():
    for bad in ({"interval_s": 0}, {"steps": 0}, {"agreement": 0}, {"agreement": 1.5}, {"interval_s": math.inf}):
        with pytest.raises(InvalidArgument):
            ValidatorConfig(shards=("127.0.0.1:1",), **bad)
    with pytest.raises(FailedPrecondition, match="needs the run's shards"):
        Validator(RUN, ValidatorConfig(), "s" * 64)


def test_an_honest_push_counts_and_a_negated_or_random_one_does_not():
    validator = Validator(RUN, ValidatorConfig(shards=("127.0.0.1:1",), steps=4), "s" * 64)
    torch.manual_seed(0)
    validator.global_values = {f.id: [v.detach().clone().reshape(-1) for v in validator._views(f.id)]
                               for f in validator.plan.fragments}
    validator.train()
    # An honest learner's outer gradient: its own few steps from the same values, on other batches.
    honest = Validator(dataclasses.replace(RUN, seed=5), ValidatorConfig(shards=("127.0.0.1:1",), steps=4), "s" * 64)
    honest.global_values = validator.global_values
    honest.train()
    g = torch.Generator().manual_seed(1)
    for fragment in validator.plan.fragments:
        d = [v.reshape(p.shape) for v, p in zip(honest.direction[fragment.id], fragment.pieces)]

        def judged(tensors):
            return validator.judge(DecodedSample("L1", fragment.id, 1, 0, 0, tensors))

        assert judged(d).score > 0.3 and judged(d).trust == 1.0
        assert judged([-2.9 * t for t in d]).trust == 0.0
        assert abs(judged([torch.randn(t.shape, generator=g) for t in d]).score) < 0.05
        assert judged([torch.zeros_like(t) for t in d]).score is None


def test_a_task_whose_batches_end_stops_the_validator_with_one_line():
    validator = Validator(RUN, ValidatorConfig(shards=("127.0.0.1:1",), steps=4), "s" * 64)
    validator.batches = iter([next(iter(validator.task.batches))] * 2)
    validator.global_values = {f.id: [v.detach().clone().reshape(-1) for v in validator._views(f.id)]
                               for f in validator.plan.fragments}
    with pytest.raises(TaskError, match="its batches ended after 2 steps"):
        validator.train()


def test_when_its_own_steps_diverge_the_validator_judges_no_one():
    validator = Validator(RUN, ValidatorConfig(shards=("127.0.0.1:1",), steps=2), "s" * 64)
    validator.global_values = {f.id: [torch.full_like(v.reshape(-1), math.nan) for v in validator._views(f.id)]
                               for f in validator.plan.fragments}
    validator.train()
    assert validator.direction == {}  # one_pass scores only fragments with a direction


class _Shard:
    """A shard as the validator's pass sees it: its values, then the pushes it kept."""

    @dataclasses.dataclass
    class _Values:
        fragment: int
        values: list

        def apply_to(self, held):
            return [v.clone() for v in self.values]

    def __init__(self, values, samples):
        self.values, self.kept, self.scores = values, samples, []

    async def bootstrap(self):
        return [self._Values(f, v) for f, v in self.values.items()]

    async def samples(self):
        return self.kept

    async def score(self, scores):
        self.scores.append(list(scores))
        return len(scores)


def test_a_push_is_judged_against_the_direction_from_values_read_before_it_arrived():
    import asyncio

    cfg = ValidatorConfig(shards=("127.0.0.1:1",), steps=4)
    validator = Validator(RUN, cfg, "s" * 64)
    start = {f.id: [v.detach().clone().reshape(-1) for v in validator._views(f.id)] for f in validator.plan.fragments}
    shard = _Shard(start, [])
    assert asyncio.run(validator.one_pass([shard])) == [[]] and shard.scores == []  # its first pass: a direction
    # A push arrives and is merged; the next pass reads values that hold it, then the push.
    g = torch.Generator().manual_seed(3)
    push = [torch.randn(v.shape, generator=g) for v in start[0]]
    sample = DecodedSample("L1", 0, 7, 0, 1, [t.reshape(p.shape) for t, p in zip(push, validator.plan.fragments[0].pieces)])
    shard.values = {f: [v - t for v, t in zip(vs, push)] if f == 0 else vs for f, vs in start.items()}
    shard.kept = [sample]
    (judged,), = asyncio.run(validator.one_pass([shard]))
    # The same validator's direction from the values before the push, and from after it.
    before = Validator(RUN, cfg, "s" * 64)
    before.global_values = start
    before.train()
    assert judged == before.judge(sample) and shard.scores == [[("L1", 0, 7, judged.score, judged.trust)]]
    before.global_values = shard.values
    before.train()
    assert before.judge(sample).score != judged.score
    # Read again, it is not judged again.
    assert asyncio.run(validator.one_pass([shard])) == [[]] and len(shard.scores) == 1
