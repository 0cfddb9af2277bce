"""Baselines the Decoupled system is measured against, on the same model, data, token
budget and number of workers as ``diloco local``:

- ``dp``: synchronous data-parallel, one gradient all-reduce per step (gloo on
  127.0.0.1), checkpoints, and the elastic-restart failure behaviour of real DP jobs;
- ``torchft``: torchft's Streaming DiLoCo (an optional extra, ``diloco[peers]``).

Both write a run directory and a ``summary.json`` with the metric keys ``diloco compare``
reads (``common.SUMMARY_KEYS``); ``common`` holds the definitions they share.
"""
