"""The ``diloco`` command: ``main`` (the entry point and the transport flags), ``services``
(syncer, learner), ``coordinator`` (coordinator, admin), ``runs`` (local, compare,
baseline, bench, simulate, replay, timeline, tape, certs), ``common`` (the run config's
and telemetry's flags) and ``settings`` (flags from config fields, --config files)."""
