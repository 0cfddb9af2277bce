"""``diloco.lab.bench.syncer._round_and_memcpy_ms`` as committed in f1c3f8f's successor, for a tree
that predates it (round.py uses it there)."""

import time

import torch

from diloco.lab.bench.syncer import synthetic, synthetic_values


def round_and_memcpy_ms(params: int, learners: int) -> tuple[float, float, float]:
    """(merge_ms, replies_ms, memcpy_ms): best of 5 rounds of ``learners`` pushes at the
    learners' default codec, each learner mirrored (it took the full values first, as after
    a bootstrap), so the round answers each with a condensed reply at the shard's default
    reply codec."""
    from diloco.clock import VectorClock
    from diloco.codec import encode
    from diloco.codec.sparse import kept_for
    from diloco.learner.config import LearnerConfig
    from diloco.syncer.config import RoundConfig, SyncerConfig
    from diloco.wire import PushMeta
    from diloco.syncer.core.shard import ShardCore, compute_round, condense_replies, inspect_payload

    plan = synthetic(params).plan(1)
    core = ShardCore(SyncerConfig(rounds=RoundConfig(grace_mode="off")), plan, {0: synthetic_values(plan)})
    core.set_membership({f"L{i}" for i in range(learners)}, set())
    pieces = plan.fragments[0].pieces
    learner = LearnerConfig()
    codec = {"encoding": learner.delta_codec, "kept": kept_for(learner.delta_density, learner.block_size)}
    g = torch.Generator().manual_seed(0)
    payloads = []
    for i in range(learners):
        encoded = [encode(p.name, torch.randn(p.shape, generator=g) * 1e-3, **codec) for p in pieces]
        payloads.append((tuple(e.spec for e in encoded), inspect_payload([e.spec for e in encoded], b"".join(e.payload for e in encoded))))
    best_merge = best_replies = float("inf")
    for r in range(6):
        for i, (specs, payload) in enumerate(payloads):
            name, version = f"L{i}", core.fragments[0].version
            core.update_for(0, version, name)  # what the learner holds: mirrored from here
            meta = PushMeta(name, 0, version, 4096, 8, 0.1, VectorClock({name: r + 1}), specs)
            core.accept(meta, payload, 0, now=float(r))
        job = core.begin_round(0, core.decide(0, float(r)), float(r))
        started = time.perf_counter()
        segment = compute_round(job, core.cfg)
        merged = time.perf_counter()
        condensed, base = condense_replies(job, core.cfg)
        replied = time.perf_counter()
        if r:  # the first round makes every mirror's first base
            best_merge, best_replies = min(best_merge, merged - started), min(best_replies, replied - merged)
        core.finish_round(job, segment, float(r), condensed, base)
    # One copy per learner's fragment, from distinct sources like the merge's distinct inputs
    # (copying one source eight times would run from the last-level cache).
    sources = [torch.randn(params) for _ in range(learners)]
    dst = torch.empty(params)
    best_copy = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for src in sources:
            dst.copy_(src)
        best_copy = min(best_copy, time.perf_counter() - started)
    return best_merge * 1e3, best_replies * 1e3, best_copy * 1e3
