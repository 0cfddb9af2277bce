"""The built-in task, named as a user's task file would be: ``--task examples/byte_gpt.py:build``
trains exactly what the default (``diloco.tasks.byte_gpt:build``) trains. Its source,
``diloco/tasks/byte_gpt.py``, is the longest example of the task contract: a model, an
infinite batch stream sharded by ``ctx.learner_index``, a loss, a token count, fixed eval
batches and an eval unit (bits per byte)."""

from diloco.tasks.byte_gpt import build

__all__ = ["build"]
