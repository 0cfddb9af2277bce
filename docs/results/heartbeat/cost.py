"""What one Heartbeat costs the coordinator, in process and without gRPC: the servicer's
handler (credential check, membership, settle, the vector clock in and out, a fresh
credential) called directly, with N learners joined, each heartbeating in turn with the
clock a learner of that run carries. Prints microseconds per heartbeat and, with
``--profile``, where they go at the largest count (cProfile).

    PYTHONPATH=. python docs/results/heartbeat/cost.py 256 1024 2048   (from a checkout: its diloco)
"""

import asyncio
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

from diloco import auth
from diloco.config import RunConfig
from diloco.coordinator.config import CoordinatorConfig
from diloco.coordinator.runtime import CoordinatorRuntime, RunInfo
from diloco.coordinator.service import CoordinatorServicer
from diloco.v1 import common_pb2, coordinator_pb2

SECRET = "s" * 32


class Context:
    def __init__(self, metadata):
        self.metadata = metadata

    def invocation_metadata(self):
        return self.metadata

    async def abort(self, code, details):
        raise RuntimeError(f"{code}: {details}")


async def markers(*_):
    return ""


async def measure(n: int, rounds: int, profile: bool) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = CoordinatorConfig(Path(tmp), launcher="none", shards=("127.0.0.1:1", "127.0.0.1:2"), max_learners=n,
                                lease_s=3600.0, credential_lifetime_s=7200.0)
        runtime = CoordinatorRuntime(cfg, RunInfo(RunConfig()), markers)
        servicer = CoordinatorServicer(runtime, SECRET, "admin" * 8, None)
        join = auth.join_credential(SECRET, "bench", n)
        learners = []
        for i in range(n):
            learner = runtime.join("default", f"host:{i}", "", "", auth.check_join(SECRET, join))
            learners.append((learner.id, Context(((auth.LEARNER_METADATA, learner.id),
                                                  (auth.CREDENTIAL_METADATA, auth.sign(SECRET, learner.id, 3600))))))
        clock = common_pb2.VectorClock()
        for learner_id, context in learners:  # every learner once: the clocks fill up as in a run
            reply = await servicer.Heartbeat(coordinator_pb2.HeartbeatRequest(learner_id=learner_id, clock=clock), context)
            clock = reply.clock
        requests = []
        for step, (learner_id, context) in enumerate(learners):
            entries = dict(clock.entries)
            entries[learner_id] = entries.get(learner_id, 0) + 10
            requests.append((coordinator_pb2.HeartbeatRequest(learner_id=learner_id, tokens=step, inner_steps=step,
                                                              clock=common_pb2.VectorClock(entries=entries)), context))
        profiler = cProfile.Profile() if profile else None
        started = time.process_time()
        if profiler:
            profiler.enable()
        for _ in range(rounds):
            for request, context in requests:
                await servicer.Heartbeat(request, context)
        if profiler:
            profiler.disable()
        spent = time.process_time() - started
        if profiler:
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)
        return spent / (rounds * n) * 1e6


def main(counts: list[int], profile: bool) -> None:
    for n in counts:
        us = asyncio.run(measure(n, max(1, 4096 // n), profile=False))
        print(f"{n:>6} learners: {us:8.1f} us of CPU per heartbeat, {us * n / 1e6:6.3f} core at one heartbeat "
              f"per learner per second", flush=True)
    if profile:
        asyncio.run(measure(counts[-1], 1, profile=True))


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:] if a != "--profile"] or [256, 1024, 2048], "--profile" in sys.argv)
