"""Decoupled DiLoCo over gRPC.

The public API: ``diloco.Task`` and ``diloco.TaskContext`` (what a ``--task`` function
takes and returns) and ``diloco.Learner`` (Decoupled DiLoCo around your own training
loop: ``Learner.join(model, coordinator=..., join_token=..., tls_dir=...)``, then
``learner.step(tokens)`` after each optimizer step; docs/own-loop.md). The rest of this
package is the kernel every service shares (codec, fragment plan, clocks, manifest) and
the tools above them (CLI, ``diloco local``).
"""

from diloco.task import Task, TaskContext

__version__ = "0.1.0"
__all__ = ["Learner", "LearnerConfig", "Task", "TaskContext"]


def __getattr__(name: str):
    # Imported on first use: shard processes import this package and must not load torch.
    if name == "Learner":
        from learner.api import Learner

        return Learner
    if name == "LearnerConfig":
        from learner.config import LearnerConfig

        return LearnerConfig
    raise AttributeError(f"module 'diloco' has no attribute {name!r}")
