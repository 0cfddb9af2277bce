"""What a shard costs under many learners: synthetic learners against a real coordinator and
real shard processes, over mutual TLS, without torch training.

Each configuration starts a coordinator and ``shards`` shard processes as ``diloco local``
does (its ``Cluster``, with fresh certificates and run secret), pinned to a synthetic
model of ``params`` parameters in ``shards`` fragments (one per shard, one tensor each).
``clients`` client processes then run ``learners`` synthetic learners between them, each
a coroutine doing what a learner does on the wire:

- Join with a join credential for all of them (its own connections: no subchannel sharing between
  learners), RegisterModel, heartbeat every fifth of the lease (1 s), Leave at the end.
- Bootstrap each fragment against the initial values it holds (``have``: the shard answers
  with no values while they are still the initial ones).
- Push each fragment every ``sync_every x step_s`` seconds (the cadence of H inner steps
  of ``step_s``), the fragments of one learner spread over that period as streaming does,
  learners starting at seeded random offsets; one push per fragment in flight at most (a
  push that outlasts its period delays the next: the learner falls behind, ``late``). A
  push carries a pre-encoded int4 delta of gaussian values of a trained delta's size
  (1e-3), framed once per client process: the clients spend no CPU encoding.
- Take every reply and decode it, push the next delta against the version the reply
  brought (so the shard's mirror of the learner is the one a real learner keeps), and
  count the replies that were full values (a mirror that drifted is reset that way).

After every learner has joined and bootstrapped, a warm-up of ``warmup_s``, then the
measured window of ``seconds``. Per configuration (one JSON object each):

- ``cpu_s_per_push``: the shards' CPU seconds in the window (every thread, from
  /proc schedstat) / pushes acknowledged in the window; ``cpu_s_per_round`` the same per
  round closed (the shards' versions before and after the window).
- ``p50_reply_ms``, ``p99_reply_ms``: push start to its reply decoded, for the window's
  pushes; ``p99_ack_ms`` to the shard's acknowledgement.
- ``pushes_per_s`` (acknowledged), ``offered_pushes_per_s`` (learners x shards / period),
  ``rounds_per_s``, ``mb_in_per_s``, ``mb_out_per_s`` (wire bytes of pushes and replies).
- ``rss_bytes``: the shards' summed peak RSS (VmHWM) at the end;
  ``rss_bytes_per_param`` = that / the model's parameters; ``rss_now_bytes`` their RSS
  at the window's end (what they hold, without the peaks of pushes arriving together).
- ``coordinator_cpu_s_per_s``: the coordinator's CPU share over the window (every
  learner heartbeats every fifth of the coordinator's lease, 1 s, as learners do).
- ``errors``: every failed call of any learner (join, heartbeat, bootstrap, push, leave),
  by kind and status; ``late``: pushes started after their due time; ``full_replies``.
"""

from __future__ import annotations

import asyncio
import collections
import multiprocessing as mp
import os
import random
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from diloco.clock import VectorClock
from diloco.config import RunConfig
from diloco.errors import InvalidArgument
from diloco.manifest import Entry, Manifest
from diloco.lab.bench.proc import cpu_seconds, peak_rss_bytes, rss_bytes

_ROW = 1024
MAX_LEARNERS = 1024
MAX_PARAMS = 1 << 30
MAX_SHARDS = 16
_OWN_CONNECTION = ("grpc.use_local_subchannel_pool", 1)
TOKENS_PER_STEP = 4096
"""What a synthetic learner reports per inner step (its pushes' and heartbeats' counts)."""


@dataclass(frozen=True)
class LoadConfig:
    learners: int = 16
    params: int = 1 << 20
    """The model's parameters, split evenly over ``shards`` fragments."""
    shards: int = 1
    seconds: float = 30.0
    warmup_s: float | None = None
    """Pushing before the window; None: one push period and 5 s, so every learner has
    pushed each fragment before it."""
    step_s: float = 0.25
    sync_every: int = RunConfig.sync_every_steps
    pushes_per_s: float | None = None
    """The pushes all learners offer per second, all fragments together: each learner's
    period is then ``learners x shards / pushes_per_s`` (``step_s`` is ignored), so
    configurations of different sizes offer the shards the same work."""
    clients: int = 2
    seed: int = 0

    @property
    def period_s(self) -> float:
        if self.pushes_per_s is not None:
            return self.learners * self.shards / self.pushes_per_s
        return self.step_s * self.sync_every

    @property
    def step_time_s(self) -> float:
        """The inner step time a learner's cadence stands for (``step_s``, or what
        ``pushes_per_s`` makes of it): what its pushes and heartbeats report."""
        return self.period_s / self.sync_every

    @property
    def warmup(self) -> float:
        return self.period_s + 5.0 if self.warmup_s is None else self.warmup_s

    def check(self) -> LoadConfig:
        if not 1 <= self.learners <= MAX_LEARNERS:
            raise InvalidArgument(f"learners must be in [1, {MAX_LEARNERS}], got {self.learners}")
        if not 1 <= self.shards <= MAX_SHARDS:
            raise InvalidArgument(f"shards must be in [1, {MAX_SHARDS}], got {self.shards}")
        if not 0 < self.params <= MAX_PARAMS or self.params % (_ROW * self.shards):
            raise InvalidArgument(f"params must be a multiple of {_ROW} x shards ({_ROW * self.shards}) "
                                  f"in (0, {MAX_PARAMS}], got {self.params}")
        for name in ("seconds", "step_s", "pushes_per_s"):
            if not (getattr(self, name) is None or getattr(self, name) > 0):
                raise InvalidArgument(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.warmup >= 0:
            raise InvalidArgument(f"warmup_s must be >= 0, got {self.warmup_s}")
        if self.sync_every < 1 or self.clients < 1:
            raise InvalidArgument("sync_every and clients must be >= 1")
        return self


def manifest(cfg: LoadConfig) -> Manifest:
    """One fp32 tensor per shard; the plan puts each in a fragment of its own."""
    rows = cfg.params // cfg.shards // _ROW
    return Manifest(tuple(Entry(f"synthetic.{m}.weight", (rows, _ROW), "float32", "parameter")
                          for m in range(cfg.shards)))


def _initial(plan, fragment: int):
    import torch

    g = torch.Generator().manual_seed(1000 + fragment)
    return [torch.randn(p.shape, generator=g) * 0.02 for p in plan.fragments[fragment].pieces]


def _pin(cfg: LoadConfig):
    from diloco.codec import encode, values_digest
    from diloco.coordinator.pin import ModelPin

    m = manifest(cfg)
    plan = m.plan(cfg.shards)
    digests = [values_digest([encode(p.name, t, encoding="fp32") for p, t in zip(f.pieces, _initial(plan, f.id))])
               for f in plan.fragments]
    return ModelPin(m.to_json(), tuple(digests))


# --- the client processes ---------------------------------------------------------------


def _client(index: int, names: list[int], cfg: LoadConfig, coordinator: str, tls_dir: str, token: str,
            ready, sampled, results) -> None:
    from diloco import rpc

    rpc.use_tls(rpc.Tls.from_dir(tls_dir))
    out = asyncio.run(_client_main(names, cfg, coordinator, token, ready, sampled))
    out["rss"] = peak_rss_bytes(os.getpid())
    results.put((index, out))


async def _client_main(names: list[int], cfg: LoadConfig, coordinator: str, token: str, ready, sampled) -> dict:
    """``ready``: a barrier every client and the parent pass once all learners joined;
    ``sampled``: set by the parent once it has read the shards at the window's end (the
    learners stay members until then: a learner that leaves takes its mirrors with it)."""
    import torch

    from diloco.codec import encode, frame, values_digest

    m = manifest(cfg)
    plan = m.plan(cfg.shards)

    def prepare():  # (before any learner joins: nothing waits on this process's event loop yet)
        initial = {f.id: [encode(p.name, t, encoding="fp32") for p, t in zip(f.pieces, _initial(plan, f.id))]
                   for f in plan.fragments}
        g = torch.Generator().manual_seed(cfg.seed)
        deltas = {}  # fragment -> a few pre-encoded deltas and their framed chunks
        for f in plan.fragments:
            for k in range(4):
                encoded = [encode(p.name, torch.randn(p.shape, generator=g) * 1e-3) for p in f.pieces]
                deltas.setdefault(f.id, []).append((encoded, list(frame([e.payload for e in encoded]))))
        return initial, deltas

    initial, deltas = await asyncio.to_thread(prepare)
    shared = _Shared(m.to_json(), initial, {f: values_digest(e) for f, e in initial.items()}, deltas, asyncio.Lock())
    out = {"records": [], "errors": collections.Counter(), "late": 0, "full_replies": 0, "join_s": [],
           "examples": {}}
    stop = asyncio.Event()
    learners = [_Learner(n, cfg, coordinator, token, plan, shared, out, stop) for n in names]
    setup = await asyncio.gather(*(lrn.setup() for lrn in learners), return_exceptions=True)
    live = [lrn for lrn, ok in zip(learners, setup) if ok is True]
    for lrn, ok in zip(learners, setup):
        if isinstance(ok, BaseException):  # (setup counts the failures it expects itself)
            lrn._error("setup", ok)
    await asyncio.to_thread(ready.wait)
    t0 = time.monotonic()
    end = t0 + cfg.warmup + cfg.seconds
    rng = random.Random(cfg.seed * 7919 + (names[0] if names else 0))
    tasks = [asyncio.create_task(lrn.run(t0 + rng.uniform(0, cfg.period_s), end)) for lrn in live]
    await asyncio.gather(*tasks)
    await asyncio.to_thread(sampled.wait, 600)
    stop.set()
    await asyncio.gather(*(lrn.close() for lrn in learners))
    return out


@dataclass
class _Shared:
    """What a client process's learners share: the model's manifest (JSON), each
    fragment's initial values (fp32, as Initialize takes them) and their digests, the
    pre-encoded deltas, and a lock so that one learner at a time offers initial values."""

    manifest_json: str
    initial: dict
    have: dict
    deltas: dict
    offering: asyncio.Lock


class _Learner:
    def __init__(self, number, cfg, coordinator, token, plan, shared, out, stop) -> None:
        self.number, self.cfg, self.coordinator, self.token = number, cfg, coordinator, token
        self.plan, self.shared, self.out, self.stop = plan, shared, out, stop
        self.session = None
        self.channels: dict[str, object] = {}
        self.clients: dict[int, object] = {}
        self.versions: dict[int, int] = {}
        self.heartbeat_task = None
        self.clock = VectorClock()
        self.steps = 0  # the inner steps its pushes stand for

    def _error(self, what: str, error: BaseException) -> None:
        code = getattr(error, "code", None)
        name = code().name if callable(code) else type(error).__name__
        key = f"{what}:{name}"
        self.out["errors"][key] += 1
        self.out["examples"].setdefault(key, str(getattr(error, "details", lambda: error)()))

    async def setup(self) -> bool:
        from diloco import auth
        from diloco.clients.coordinator import LearnerSession
        from diloco.clients.syncer import SyncerClient, open_channel
        from diloco.errors import DilocoError

        started = time.monotonic()
        self.session = LearnerSession(self.coordinator, timeout_s=30, channel_options=[_OWN_CONNECTION])
        try:
            reply = await self.session.join(self.token, address=f"bench:{self.number}")
            topology = await self.session.register_model(self.shared.manifest_json)
        except DilocoError as error:
            self._error("join", error)
            return False
        credential = auth.Credential(reply.learner_id, reply.credential)
        self.credential = credential
        shards = {s.shard_id: s.address for s in topology.shards}
        self.heartbeat_task = asyncio.create_task(self._heartbeats())
        for f in self.plan.fragments:
            address = shards[f.owner(len(shards))]
            if address not in self.channels:
                self.channels[address] = open_channel(address, channel_options=[_OWN_CONNECTION])
            self.clients[f.id] = SyncerClient(self.channels[address], credential, timeout_s=120)
            try:
                await self._ensure_values(f)
                [update] = await self.clients[f.id].bootstrap([f.id], have={f.id: self.shared.have[f.id]})
            except Exception as error:  # noqa: BLE001 - every failure is counted by kind
                self._error("bootstrap", error)
                return False
            self.versions[f.id] = update.version
        self.out["join_s"].append(time.monotonic() - started)
        return True

    async def _ensure_values(self, fragment) -> None:
        """Offer the initial values of a fragment its shard has none of yet, as the first
        learner of a run does (the shard takes them only if they are the pinned ones)."""
        client = self.clients[fragment.id]
        async with self.shared.offering:
            status = await client.status()
            if fragment.id not in {f.fragment for f in status.fragments}:
                await client.initialize(fragment.id, self.shared.manifest_json, self.plan.plan_hash,
                                        self.shared.initial[fragment.id])

    async def _heartbeats(self) -> None:
        from diloco.errors import DilocoError
        from diloco.learner.membership import HEARTBEATS_PER_LEASE

        interval_s = 1.0
        while not self.stop.is_set():
            try:
                reply = await self.session.heartbeat(tokens=self.steps * TOKENS_PER_STEP, inner_steps=self.steps,
                                                     tokens_per_s=TOKENS_PER_STEP / self.cfg.step_time_s)
                self.credential.renew(reply.credential)
                interval_s = reply.lease_s / HEARTBEATS_PER_LEASE  # as a learner's
            except DilocoError as error:
                self._error("heartbeat", error)
            try:
                await asyncio.wait_for(self.stop.wait(), interval_s)
            except asyncio.TimeoutError:
                pass

    async def run(self, first: float, end: float) -> None:
        f_count = len(self.plan.fragments)
        period = self.cfg.period_s
        await asyncio.gather(*(self._push_loop(f.id, first + period * f.id / f_count, end)
                               for f in self.plan.fragments))

    async def _push_loop(self, fragment: int, due: float, end: float) -> None:
        from diloco.wire import PushMeta

        name = self.credential.id
        rng = random.Random(self.number * 31 + fragment)
        while due < end:
            await asyncio.sleep(max(due - time.monotonic(), 0))
            encoded, chunks = rng.choice(self.shared.deltas[fragment])
            self.clock = self.clock.tick(name)
            meta = PushMeta(name, fragment, self.versions[fragment], TOKENS_PER_STEP * self.cfg.sync_every,
                            self.cfg.sync_every, self.cfg.step_time_s, self.clock, tuple(e.spec for e in encoded))
            acked: list[float] = []
            started = time.monotonic()
            try:
                result = await self.clients[fragment].push(meta, encoded, on_ack=lambda *_: acked.append(time.monotonic()),
                                                            chunks=chunks)
            except Exception as error:  # noqa: BLE001 - every failure is counted by kind
                self._error("push", error)
                due += self.cfg.period_s
                continue
            done = time.monotonic()
            update = result.update
            if any(s.kind == "full" for s in update.segments):
                self.out["full_replies"] += 1
            self.versions[fragment] = update.version
            self.steps += self.cfg.sync_every // len(self.plan.fragments) or 1
            self.out["records"].append((started, acked[0] if acked else done, done, result.bytes_up, update.wire_bytes))
            due += self.cfg.period_s
            if due < done:
                self.out["late"] += 1
                due = done

    async def close(self) -> None:
        from diloco.errors import DilocoError

        if self.heartbeat_task is not None:
            await self.heartbeat_task
            try:
                await self.session.leave(reason="bench load done")
            except DilocoError as error:
                self._error("leave", error)
        for channel in self.channels.values():
            await channel.close()
        if self.session is not None:
            await self.session.close()


# --- one configuration --------------------------------------------------------------------


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(int(q * len(values)), len(values) - 1)]


def _versions(cluster) -> int:
    from diloco.cli.local.supervisor import shard_status

    total = 0
    for status in shard_status(cluster.shards, cluster.secret):
        if isinstance(status, BaseException):
            raise InvalidArgument(f"a benchmark shard did not answer: {status}")
        total += sum(f.version for f in status.fragments)
    return total


def run_one(cfg: LoadConfig, say=lambda line: None) -> dict:
    from diloco import auth
    from diloco.files import atomic_write
    from diloco.cli.local.config import LocalConfig
    from diloco.cli.local.supervisor import Cluster

    cfg.check()
    run = RunConfig(fragments=cfg.shards, sync_every_steps=cfg.sync_every)
    with tempfile.TemporaryDirectory(prefix="diloco-load-") as tmp:
        run_dir = Path(tmp)
        atomic_write(run_dir / "secret", auth.new_secret())
        atomic_write(run_dir / "run.json", run.to_json())
        local = LocalConfig(run=run, learners=cfg.learners, shards=cfg.shards, fork_server=False)  # no learner is launched
        cluster = Cluster(local, run_dir, learner_steps=1, pin=_pin(cfg))
        sampled = None
        try:
            cluster.start()
            # (one credential for every synthetic learner: the run's own admits join_learners)
            token = auth.join_credential((run_dir / "secret").read_text().strip(), "load", cfg.learners)
            ctx = mp.get_context("spawn")
            clients = min(cfg.clients, cfg.learners)
            ready, sampled, results = ctx.Barrier(clients + 1), ctx.Event(), ctx.Queue()
            procs = [ctx.Process(target=_client, args=(i, list(range(i, cfg.learners, clients)), cfg, cluster.coordinator,
                                                       str(run_dir / "tls"), token, ready, sampled, results),
                                 daemon=True)  # (ended with this process, whatever happens to it)
                     for i in range(clients)]
            for p in procs:
                p.start()
            try:
                ready.wait(timeout=120 + cfg.learners)
            except threading.BrokenBarrierError:
                raise InvalidArgument(f"the client processes did not get their learners joined within "
                                      f"{120 + cfg.learners} s; see {run_dir / 'logs'}") from None
            t0 = time.monotonic()
            say(f"{cfg.learners} learners joined; warm-up {cfg.warmup:g} s, then {cfg.seconds:g} s measured")
            pids = [p.pid for p in cluster.shard_procs]
            coordinator_pid = next(p.pid for role, p in cluster.procs if role == "coordinator")
            time.sleep(max(t0 + cfg.warmup - time.monotonic(), 0))
            cpu0, coord0, versions0 = sum(map(cpu_seconds, pids)), cpu_seconds(coordinator_pid), _versions(cluster)
            time.sleep(max(t0 + cfg.warmup + cfg.seconds - time.monotonic(), 0))
            cpu1, coord1, versions1 = sum(map(cpu_seconds, pids)), cpu_seconds(coordinator_pid), _versions(cluster)
            rss, rss_now = sum(map(peak_rss_bytes, pids)), sum(map(rss_bytes, pids))
            sampled.set()
            outs = [results.get(timeout=300) for _ in procs]
            for p in procs:
                p.join(timeout=30)
        finally:
            if sampled is not None:
                sampled.set()
            cluster.stop()
    return _report(cfg, [o for _, o in outs], t0, cpu1 - cpu0, coord1 - coord0, versions1 - versions0, rss, rss_now)


def _report(cfg: LoadConfig, outs: list[dict], t0: float, shard_cpu_s: float, coordinator_cpu_s: float,
            rounds: int, rss: int, rss_now: int) -> dict:
    lo, hi = t0 + cfg.warmup, t0 + cfg.warmup + cfg.seconds
    window = [r for o in outs for r in o["records"] if lo <= r[1] < hi]
    errors, examples = collections.Counter(), {}
    for o in outs:
        errors.update(o["errors"])
        examples.update(o["examples"])
    reply_ms = [(r[2] - r[0]) * 1e3 for r in window]
    ack_ms = [(r[1] - r[0]) * 1e3 for r in window]
    pushes = len(window)
    return {
        "learners": cfg.learners,
        "params": cfg.params,
        "shards": cfg.shards,
        "seconds": cfg.seconds,
        "period_s": cfg.period_s,
        "offered_pushes_per_s": round(cfg.learners * cfg.shards / cfg.period_s, 2),
        "pushes_per_s": round(pushes / cfg.seconds, 2),
        "rounds_per_s": round(rounds / cfg.seconds, 2),
        "cpu_s_per_push": round(shard_cpu_s / pushes, 5) if pushes else None,
        "cpu_s_per_round": round(shard_cpu_s / rounds, 5) if rounds else None,
        "shard_cpu_share": round(shard_cpu_s / cfg.seconds / cfg.shards, 3),
        "coordinator_cpu_s_per_s": round(coordinator_cpu_s / cfg.seconds, 3),
        "p50_reply_ms": round(_percentile(reply_ms, 0.5), 1),
        "p99_reply_ms": round(_percentile(reply_ms, 0.99), 1),
        "p99_ack_ms": round(_percentile(ack_ms, 0.99), 1),
        "mb_in_per_s": round(sum(r[3] for r in window) / cfg.seconds / 1e6, 2),
        "mb_out_per_s": round(sum(r[4] for r in window) / cfg.seconds / 1e6, 2),
        "rss_bytes": rss,
        "rss_bytes_per_param": round(rss / cfg.params, 2),
        "rss_now_bytes": rss_now,
        "client_rss_bytes": sum(o["rss"] for o in outs),
        "joined": sum(len(o["join_s"]) for o in outs),
        "p99_join_s": round(_percentile([s for o in outs for s in o["join_s"]], 0.99), 2),
        "late": sum(o["late"] for o in outs),
        "full_replies": sum(o["full_replies"] for o in outs),
        "errors": dict(sorted(errors.items())),
        "error_examples": examples,
        "config": asdict(cfg),
    }


CLIENT_BYTES = 400e6
"""What a client process holds besides its learners' share of the model (Python, torch,
gRPC; 250-440 MB measured with 1 to 128 learners each)."""


CLIENT_BYTES_PER_PARAM = 26
"""And per parameter of the model: its initial values (4 bytes), four pre-encoded deltas
(2.1), and the decoded replies of the pushes in flight (4 each)."""


def memory_needed(cfg: LoadConfig) -> float:
    """Bytes a configuration needs: the shards as the capacity model predicts them and the
    client processes."""
    from diloco.lab.simulate.capacity import COSTS, predict

    shards = cfg.shards * predict(COSTS, cfg.params / cfg.shards, cfg.learners)["rss_bytes"]
    clients = min(cfg.clients, cfg.learners)
    return shards + clients * (CLIENT_BYTES + cfg.params * CLIENT_BYTES_PER_PARAM)


def available_bytes() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return float("inf")


def run(configs: list[LoadConfig], say=lambda line: print(line, file=sys.stderr)):
    """Each configuration's result, as soon as it is measured. All are checked first,
    their memory too: one this machine cannot hold is refused before anything starts."""
    available = available_bytes()
    for c in configs:
        c.check()
        if (needed := memory_needed(c)) > 0.9 * available:
            raise InvalidArgument(
                f"{c.learners} learners on {c.params} parameters over {c.shards} shard(s) need about "
                f"{needed / 1e9:.1f} GB (the capacity model's shards and the client processes); "
                f"this machine has {available / 1e9:.1f} GB available")
    for i, c in enumerate(configs, 1):
        say(f"[{i}/{len(configs)}] {c.learners} learners, {c.params} parameters, {c.shards} shard(s)")
        yield run_one(c, say)
