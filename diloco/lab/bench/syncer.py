"""How fast one shard takes in pushes and closes rounds, next to raw loopback TCP and
memcpy measured in the same run.

- tcp_loopback_mbps: two processes, one ``sendall``s 1 GiB in 4 MiB writes, the other
  receives it; MB/s (10^6 bytes per second) from first to last byte at the receiver.
- ingress_mbps: a real shard process (``diloco syncer``) owning one fragment of
  ``params`` parameters; ``learners`` client processes released together by a barrier
  each push one real int4 delta (pre-encoded and pre-framed, so client CPU is not
  counted), after one untimed warm-up push each; per round, wire bytes of all pushes / time from release to the last ack (the
  ack comes after the shard received, unframed, checksummed and decoded the push). The
  median over rounds is reported. ingress_ratio = ingress / raw TCP.
- grpc_noop_mbps: the same clients, the same chunks, the same measurement, against a
  bare ``grpc.aio`` server process that does nothing with what it receives (raw bytes,
  no protos, no work): what Python gRPC itself moves here. ingress_vs_grpc = ingress /
  grpc_noop, the share of that ceiling the shard reaches.
- merge_ms: in this process, ``compute_round`` for one round of ``learners`` deltas at the
  learners' default codec (gates, merge, outer step, quantized update), best of 5;
  replies_ms: ``condense_replies`` after it, a condensed reply to each of the ``learners``
  (each mirrored, as after its bootstrap) at the shard's default reply codec, best of 5;
  memcpy_ms: ``learners`` copies of the fragment (``dst.copy_(src)`` from ``learners``
  distinct fp32 sources, as the merge reads ``learners`` distinct deltas), best of 5;
  merge_ratio = merge_ms / memcpy_ms, replies_ratio = replies_ms / memcpy_ms.
- rounds_per_s: full rounds (push, merge, update back to every learner) per second.
- rss: the shard process's peak resident memory (VmHWM) after the run.
- shard_cpu_ms_per_round: the shard process's CPU time (user + system) over the measured
  rounds, per round: ingress, merge, framing and the replies to every learner.
  shard_mb_per_cpu_s = wire MB pushed per shard CPU-second: how much push traffic one
  core could absorb if the shard had it to itself (here it shares 2 cores with the
  learners).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from diloco.errors import InvalidArgument
from diloco.manifest import Entry, Manifest
from diloco.lab.bench.proc import cpu_seconds, peak_rss_bytes

_TCP_TOTAL = 1 << 30
_TCP_WRITE = 4 << 20


def _tcp_receiver(port_queue, result_queue) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port_queue.put(server.getsockname()[1])
        conn, _ = server.accept()
        with conn:
            buf = bytearray(_TCP_WRITE)
            view, received, started = memoryview(buf), 0, None
            while received < _TCP_TOTAL:
                n = conn.recv_into(view)
                if n == 0:
                    break
                if started is None:
                    started = time.perf_counter()
                received += n
            result_queue.put((received, time.perf_counter() - started))


def tcp_loopback_mbps() -> float:
    ctx = mp.get_context("spawn")
    ports, results = ctx.Queue(), ctx.Queue()
    receiver = ctx.Process(target=_tcp_receiver, args=(ports, results))
    receiver.start()
    port = ports.get(timeout=30)
    data = bytes(_TCP_WRITE)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        for _ in range(_TCP_TOTAL // _TCP_WRITE):
            sock.sendall(data)
    received, seconds = results.get(timeout=120)
    receiver.join(timeout=30)
    return received / seconds / 1e6


def _client(index: int, address: str, secret: str, params: int, rounds: int, barrier, warm, results) -> None:
    from diloco import auth
    from diloco.clock import VectorClock
    from diloco.codec import encode, frame
    from diloco.clients.syncer import SyncerClient, open_channel
    from diloco.wire import PushMeta

    name = f"L{index}"
    plan = synthetic(params).plan(1)
    g = torch.Generator().manual_seed(index)
    encoded = [encode(p.name, torch.randn(p.shape, generator=g) * 1e-3) for p in plan.fragments[0].pieces]
    chunks = list(frame([e.payload for e in encoded]))

    async def main():
        channel = open_channel(address)
        client = SyncerClient(channel, auth.Credential(name, secret=secret), timeout_s=120)
        version, clock, timings = 0, VectorClock(), []
        for r in range(1 + rounds):
            clock = clock.tick(name)
            meta = PushMeta(name, 0, version, 4096, 8, 0.1, clock, tuple(e.spec for e in encoded))
            acked = []
            await asyncio.to_thread(barrier.wait)
            start = time.monotonic()
            result = await client.push(meta, encoded, on_ack=lambda *_: acked.append(time.monotonic()), chunks=chunks)
            version = result.update.version
            if r == 0:
                await asyncio.to_thread(warm.wait)
                continue
            timings.append((start, acked[0], time.monotonic(), result.bytes_up, result.update.wire_bytes))
        await channel.close()
        return timings

    results.put((index, asyncio.run(main())))


_NOOP_METHOD = "/bench.Noop/Push"


def _noop_server(port_queue) -> None:
    import grpc

    async def push(requests, context):
        async for _ in requests:
            pass
        yield b"ok"

    async def main():
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 8 << 20)])
        handler = grpc.stream_stream_rpc_method_handler(push)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Noop", {"Push": handler}),))
        port_queue.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def _noop_client(index: int, port: int, params: int, rounds: int, barrier, warm, results) -> None:
    import grpc

    from diloco.codec import encode, frame

    plan = synthetic(params).plan(1)
    g = torch.Generator().manual_seed(index)
    chunks = list(frame([encode(p.name, torch.randn(p.shape, generator=g) * 1e-3).payload for p in plan.fragments[0].pieces]))

    async def main():
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 8 << 20)])
        push, timings = channel.stream_stream(_NOOP_METHOD), []
        for r in range(1 + rounds):
            await asyncio.to_thread(barrier.wait)
            start = time.monotonic()
            async for _ in push(iter(chunks)):
                break
            if r == 0:
                await asyncio.to_thread(warm.wait)
                continue
            timings.append((start, time.monotonic(), sum(map(len, chunks))))
        await channel.close()
        return timings

    results.put((index, asyncio.run(main())))


def _run_clients(ctx, target, args, learners: int, warmed=lambda: None) -> dict:
    """Start ``learners`` client processes; each makes one untimed warm-up push (channel
    set-up, first allocations), then ``rounds`` timed ones released together. ``warmed``
    runs once every warm-up push is done."""
    barrier, warm, results = ctx.Barrier(learners), ctx.Barrier(learners + 1), ctx.Queue()
    clients = [ctx.Process(target=target, args=(i, *args, barrier, warm, results)) for i in range(learners)]
    for c in clients:
        c.start()
    warm.wait(timeout=600)
    warmed()
    timings = dict(results.get(timeout=600) for _ in clients)
    for c in clients:
        c.join(timeout=30)
    return timings


def _median_round_mbps(timings: dict, rounds: int, end: int, size: int) -> float:
    """Median over rounds of (wire bytes of all pushes) / (release to the last ``end``)."""
    per_round = []
    for r in range(rounds):
        rows = [t[r] for t in timings.values()]
        start = min(row[0] for row in rows)
        per_round.append(sum(row[size] for row in rows) / (max(row[end] for row in rows) - start) / 1e6)
    return statistics.median(per_round)


def grpc_noop_mbps(params: int, learners: int, rounds: int) -> float:
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    server = ctx.Process(target=_noop_server, args=(ports,))
    server.start()
    try:
        timings = _run_clients(ctx, _noop_client, (ports.get(timeout=60), params, rounds), learners)
    finally:
        server.terminate()
        server.join(timeout=30)
    return _median_round_mbps(timings, rounds, end=1, size=2)


def _round_and_memcpy_ms(params: int, learners: int) -> tuple[float, float, float]:
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


_SYNTHETIC_ROW = 1024


def synthetic(params: int) -> Manifest:
    """The benchmark's model: one fp32 tensor of ``params`` parameters."""
    return Manifest((Entry("synthetic.weight", (params // _SYNTHETIC_ROW, _SYNTHETIC_ROW), "float32", "parameter"),))


def synthetic_values(plan) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(p.shape, generator=g) * 0.02 for p in plan.fragments[0].pieces]


def _initialize(address: str, secret: str, params: int) -> None:
    """Give the benchmark shard its starting values, as the first learner of a run does."""
    from diloco import auth
    from diloco.codec import encode
    from diloco.clients.syncer import SyncerClient, open_channel

    manifest = synthetic(params)
    plan = manifest.plan(1)
    encoded = [encode(p.name, t, encoding="fp32") for p, t in zip(plan.fragments[0].pieces, synthetic_values(plan))]

    async def main():
        async with open_channel(address) as channel:
            await SyncerClient(channel, auth.Credential("L0", secret=secret), timeout_s=120).initialize(
                0, manifest.to_json(), plan.plan_hash, encoded)

    asyncio.run(main())


def run(params: int = 4 * 1024 * 1024, learners: int = 8, rounds: int = 30) -> dict:
    if params <= 0 or params % 1024 or learners <= 0 or rounds <= 0:
        raise InvalidArgument("params must be a positive multiple of 1024; learners and rounds positive")
    tcp = tcp_loopback_mbps()
    noop = grpc_noop_mbps(params, learners, rounds)
    merge_ms, replies_ms, memcpy_ms = _round_and_memcpy_ms(params, learners)

    secret = "bench-secret"
    with tempfile.TemporaryDirectory() as tmp:
        port_file, secret_file = Path(tmp) / "port", Path(tmp) / "secret"
        secret_file.write_text(secret)
        shard = subprocess.Popen(
            [sys.executable, "-m", "diloco", "--insecure", "syncer", "--fragments", "1",
             "--learners", ",".join(f"L{i}" for i in range(learners)), "--grace", "off",
             "--port-file", str(port_file), "--secret-file", str(secret_file)],
            stdout=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 60
            while not port_file.exists():
                if shard.poll() is not None or time.monotonic() > deadline:
                    raise InvalidArgument("the benchmark shard did not start")
                time.sleep(0.05)
            address = port_file.read_text().strip()
            _initialize(address, secret, params)
            cpu: list[float] = []
            timings = _run_clients(
                mp.get_context("spawn"), _client, (address, secret, params, rounds), learners,
                warmed=lambda: cpu.append(cpu_seconds(shard.pid)),
            )
            shard_cpu_s = cpu_seconds(shard.pid) - cpu[0]
            peak_rss = peak_rss_bytes(shard.pid)
        finally:
            shard.terminate()
            shard.wait(timeout=30)

    ingress = _median_round_mbps(timings, rounds, end=1, size=3)
    pushed = sum(row[3] for t in timings.values() for row in t)
    first = min(timings[i][0][0] for i in range(learners))
    last = max(timings[i][-1][2] for i in range(learners))
    # Ratios are of the figures as reported, so each equals its printed parts.
    tcp, noop, ingress = round(tcp, 1), round(noop, 1), round(ingress, 1)
    merge_ms, replies_ms, memcpy_ms = round(merge_ms, 2), round(replies_ms, 2), round(memcpy_ms, 2)
    return {
        "tcp_loopback_mbps": tcp,
        "grpc_noop_mbps": noop,
        "ingress_mbps": ingress,
        "ingress_ratio": round(ingress / tcp, 3),
        "ingress_vs_grpc": round(ingress / noop, 3),
        "merge_ms": merge_ms,
        "memcpy_ms": memcpy_ms,
        "merge_ratio": round(merge_ms / memcpy_ms, 2),
        "replies_ms": replies_ms,
        "replies_ratio": round(replies_ms / memcpy_ms, 2),
        "rounds_per_s": round(rounds / (last - first), 2),
        "shard_cpu_ms_per_round": round(shard_cpu_s / rounds * 1e3, 1),
        "shard_mb_per_cpu_s": round(pushed / shard_cpu_s / 1e6, 1),
        "rss_peak_mb": round(peak_rss / 1e6, 1),
        "rss_bytes_per_param": round(peak_rss / params, 1),
        "rss_budget_mb": round((20 * params + 300e6) / 1e6, 1),
        "params": params,
        "learners": learners,
        "rounds": rounds,
    }
