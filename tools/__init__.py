"""Tools: everything that drives or measures a run, above the services.

``cli`` (the ``diloco`` command), ``local`` (the one-machine supervisor: processes,
progress, plots), ``metrics`` (goodput, uptime, eval), ``compare`` and ``baseline`` (the
systems Decoupled DiLoCo is measured against), ``bench``, ``simulate``, ``chaos``,
``replay``, ``timeline``, ``export`` and ``certs``. Tools may import the kernel
(``diloco``) and the services; nothing below imports a tool (tests/unit/test_layering.py).
"""
