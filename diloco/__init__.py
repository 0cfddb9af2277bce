"""Decoupled DiLoCo over gRPC.

The public API (docs/api.md): ``diloco.Task`` and ``diloco.TaskContext`` (what a
``--task`` function takes and returns) and ``diloco.Learner`` (Decoupled DiLoCo around
your own training loop: ``Learner.join(model, coordinator=..., join_token=...,
tls_dir=...)``, then ``learner.step(tokens)`` after each optimizer step), with its
``diloco.LearnerConfig``.

The package is one house (docs/ARCHITECTURE.md, "The house"): the kernel every process
shares (``codec``, ``clients``, ``tasks``, the fragment plan, clocks, manifest, wire
types), the services (``diloco.learner``, ``diloco.syncer``, ``diloco.coordinator``), the
product's command line (``diloco.cli``: ``diloco local`` and the commands that run a
cluster) and the lab (``diloco.lab``: compare, baselines, benchmarks, simulation).
"""

from diloco.task import Task, TaskContext

__version__ = "0.1.0"
__all__ = ["Learner", "LearnerConfig", "Task", "TaskContext"]


def __getattr__(name: str):
    # Imported on first use: shard processes import this package and must not load torch.
    if name == "Learner":
        from diloco.learner.api import Learner

        return Learner
    if name == "LearnerConfig":
        from diloco.learner.config import LearnerConfig

        return LearnerConfig
    raise AttributeError(f"module 'diloco' has no attribute {name!r}")
