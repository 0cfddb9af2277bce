"""The clients of the services, one each, used by learners, the command line and tests alike:
``syncer`` (a shard's Push, Bootstrap, Initialize, Status) and ``coordinator`` (a
learner's session; the operator's admin calls)."""
