"""Test helpers: a run's task model, manifest and plan, and a shard core holding the model's
initial values, as if the run's first learner had given them (shards never build models)."""

from __future__ import annotations

import torch

from diloco.config import RunConfig
from diloco.fragments import FragmentPlan
from diloco.manifest import Manifest, manifest_of, synced_tensors
from diloco.task import TaskContext, build_task


def gpt_run(width: int = 16, depth: int = 1, heads: int = 2, context: int = 16, **run) -> RunConfig:
    options = {"width": str(width), "depth": str(depth), "heads": str(heads), "context": str(context)}
    return RunConfig(task_options={**options, **run.pop("task_options", {})}, **run)


def task_model(run: RunConfig, learner_index: int = 0) -> torch.nn.Module:
    ctx = TaskContext(learner_index, 1, run.seed, torch.device("cpu"), dict(run.task_options))
    return build_task(run.task, ctx).model


def model_plan(run: RunConfig) -> tuple[Manifest, FragmentPlan, dict[str, torch.Tensor]]:
    """The run's model manifest, fragment plan and initial synced tensors (by name)."""
    model = task_model(run)
    manifest = manifest_of(model)
    return manifest, manifest.plan(run.fragments), {k: v.detach().clone() for k, v in synced_tensors(model, manifest).items()}


def seeded_core(run: RunConfig, cfg):
    from diloco.syncer.core.shard import ShardCore

    manifest, plan, state = model_plan(run)
    initial = {f.id: plan.gather(f.id, state) for f in plan.owned_by(cfg.shard_id, cfg.num_shards)}
    return ShardCore(cfg, plan, initial, manifest.to_json())
