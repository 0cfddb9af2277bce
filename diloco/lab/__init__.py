"""The lab: what measures the product and compares it with other systems. ``commands``
(the ``diloco compare``, ``baseline``, ``bench`` and ``simulate`` commands), ``compare``
and ``baseline`` (data-parallel and torchft on the same task and workload), ``bandwidth``
(the sweep over link rates), ``bench`` (benchmarks printing ratios measured side by side),
``simulate`` (goodput at scale, the capacity model) and ``reference`` (docs/SETTINGS.md).
The lab may import anything of the product; nothing of the product imports the lab."""
