"""The product's command line: ``main`` (the top-level flags and how a command runs),
``services`` (syncer, learner), ``coordinator`` (coordinator, admin), ``runs`` (local,
replay, check, timeline, tape, certs), ``common`` (the run config's and telemetry's flags)
and ``settings`` (flags from config fields, --config files); ``local`` (the one-machine
supervisor), ``chaos`` and ``check`` (faults and the checker of a run's history),
``metrics`` (goodput, uptime, eval: the same code for every system), ``replay``,
``timeline``, ``export`` and ``certs``. It imports the kernel and the services, never the
lab (``diloco.lab``)."""
