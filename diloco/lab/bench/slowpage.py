"""The status page under slow clients: a real coordinator process, its page on loopback,
and ``connections`` clients that each send a request's head one byte every ``interval_s``
and never end it (a closed one connects again at once, as a hostile client would).

Per server (``current``: this tree's code; ``--old REV``: also the code of git revision
REV, extracted to a temporary directory, so the two are measured in one run), one JSON
object:

- ``threads_before``, ``threads_max``: the coordinator's thread count (/proc/PID/status)
  before the slow clients and the most sampled while they hang;
- ``get_ms``: GET /status.json from a fresh connection every 0.5 s, before and during
  (p50, p99, max in ms; ``failed``: no 200 within 10 s), and ``connect_ms``, its TCP
  connect alone (about 1,000 ms: the kernel dropped the first SYN and resent it);
- ``heartbeat_ms``: a joined learner's Heartbeat RPC every 0.1 s, before and during;
- ``slow``: the clients' open connections at the end, their connections the server
  closed, and their connects that failed.

Usage: python -m diloco.lab.bench.slowpage [--connections 2000] [--interval-s 2]
       [--seconds 30] [--old REV]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import multiprocessing as mp
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

from diloco import auth
from diloco.clients.coordinator import LearnerSession

REPO = Path(__file__).resolve().parents[3]


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _slow_clients(port: int, connections: int, interval_s: float, stop, counts) -> None:
    """In a process of its own: ``connections`` clients that trickle and never finish."""
    _raise_fd_limit()

    async def client(i: int) -> None:
        await asyncio.sleep(interval_s * i / connections)  # spread over one interval
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                counts["connect_failed"] += 1
                await asyncio.sleep(0.1)
                continue
            counts["open"] += 1
            try:
                writer.write(b"GET /status.json HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
                while not stop.is_set():
                    try:
                        if await asyncio.wait_for(reader.read(1024), interval_s) == b"":
                            break  # closed by the server
                    except asyncio.TimeoutError:
                        pass
                    writer.write(b"a")
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                counts["open"] -= 1
                writer.transport.abort()
            if not stop.is_set():
                counts["closed_by_server"] += 1

    async def main() -> None:
        await asyncio.gather(*(client(i) for i in range(connections)))

    asyncio.run(main())


def _threads(pid: int) -> int:
    return int(re.search(r"^Threads:\s+(\d+)", Path(f"/proc/{pid}/status").read_text(), re.MULTILINE)[1])


def _summary(ms: list[float], failed: int) -> dict:
    ms = sorted(ms)
    pick = lambda q: round(ms[min(int(q * len(ms)), len(ms) - 1)], 2) if ms else None  # noqa: E731
    return {"n": len(ms), "p50": pick(0.5), "p99": pick(0.99), "max": round(ms[-1], 2) if ms else None, "failed": failed}


class _Heartbeats:
    """A learner heartbeating every 0.1 s through the whole run (its lease never lapses
    between windows); each window reads the latencies of its own span."""

    def __init__(self, session: LearnerSession) -> None:
        self.session, self.beats, self.failed, self.errors = session, [], 0, set()
        self.task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            start = time.monotonic()
            try:
                await self.session.heartbeat(tokens=len(self.beats) + self.failed + 1)
                self.beats.append((time.monotonic() - start) * 1000)
            except Exception as error:
                self.failed += 1
                self.errors.add(str(error)[:200])
            await asyncio.sleep(0.1)

    def mark(self) -> tuple[int, int]:
        return len(self.beats), self.failed


async def _window(url: str, heartbeats: _Heartbeats, pid: int, seconds: float) -> dict:
    gets, connects, get_failed, threads, errors = [], [], 0, [], set()
    end = time.monotonic() + seconds
    beats_from, failed_from = heartbeats.mark()
    where = urlsplit(url)

    def get() -> tuple[float, float]:
        """(connect, whole request) in ms: a connect near 1 s is a SYN the kernel dropped and resent."""
        start = time.monotonic()
        conn = http.client.HTTPConnection(where.hostname, where.port, timeout=10)
        try:
            conn.connect()
            connected = time.monotonic()
            conn.request("GET", "/status.json")
            reply = conn.getresponse()
            reply.read()
            assert reply.status == 200
        finally:
            conn.close()
        return (connected - start) * 1000, (time.monotonic() - start) * 1000

    while time.monotonic() < end:
        try:
            connect_ms, get_ms = await asyncio.to_thread(get)
            connects.append(connect_ms)
            gets.append(get_ms)
        except Exception as error:
            get_failed += 1
            errors.add(str(error)[:200])
        threads.append(_threads(pid))
        await asyncio.sleep(0.5)
    heartbeat_ms = _summary(heartbeats.beats[beats_from:], heartbeats.failed - failed_from)
    return {"get_ms": _summary(gets, get_failed), "connect_ms": _summary(connects, 0), "heartbeat_ms": heartbeat_ms,
            "threads": threads,
            "errors": sorted(errors | heartbeats.errors)}


async def _measure(name: str, code: Path, args, work: Path) -> dict:
    data = work / name
    data.mkdir()
    (work / "secret").write_text(auth.new_secret())
    log = open(data / "coordinator.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "diloco", "--insecure", "--log-level", "WARNING", "coordinator", "--host", "127.0.0.1",
         "--port", "0", "--port-file", str(data / "port"), "--data-dir", str(data), "--launcher", "none",
         "--status-port", "0", "--secret-file", str(work / "secret")],
        cwd=code, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # (-m runs the code in cwd)
    stop, counts = None, None
    try:
        deadline = time.monotonic() + 60
        while not ((data / "status-url").exists() and (data / "port").exists()):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the {name} coordinator did not start: {(data / 'coordinator.log').read_text()}")
            await asyncio.sleep(0.1)
        url = (data / "status-url").read_text().strip()
        session = LearnerSession((data / "port").read_text().strip(), timeout_s=10)
        await session.join(auth.join_credential((work / "secret").read_text(), "slowpage", 1), address="slowpage")
        heartbeats = _Heartbeats(session)
        before = await _window(url, heartbeats, proc.pid, args.seconds / 2)

        ctx = mp.get_context("spawn")
        manager = ctx.Manager()
        stop, counts = manager.Event(), manager.dict(open=0, closed_by_server=0, connect_failed=0)
        port = int(url.rsplit(":", 1)[1].rstrip("/"))
        clients = ctx.Process(target=_slow_clients, args=(port, args.connections, args.interval_s, stop, counts))
        clients.start()
        await asyncio.sleep(args.interval_s + 2)  # every client connected and trickling
        during = await _window(url, heartbeats, proc.pid, args.seconds)
        slow = dict(counts)
        stop.set()
        clients.join(args.interval_s + 10)
        heartbeats.task.cancel()
        await session.close()
        return {"server": name, "connections": args.connections, "interval_s": args.interval_s,
                "threads_before": max(before.pop("threads")), "threads_max": max(during.pop("threads")),
                "before": before, "during": during, "slow": slow}
    finally:
        if stop is not None:
            stop.set()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=2000)
    parser.add_argument("--interval-s", type=float, default=2.0)
    parser.add_argument("--seconds", type=float, default=30.0, help="the measured window with the slow clients")
    parser.add_argument("--old", metavar="REV", help="also measure the code of this git revision")
    args = parser.parse_args()
    _raise_fd_limit()
    print(f"# RLIMIT_NOFILE {resource.getrlimit(resource.RLIMIT_NOFILE)}; {os.cpu_count()} CPUs", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="diloco-slowpage-") as tmp:
        work = Path(tmp)
        servers = [("current", REPO)]
        if args.old:
            old = work / "old-code"
            old.mkdir()
            archive = subprocess.run(["git", "-C", str(REPO), "archive", args.old, "diloco"], check=True,
                                     capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
            servers.append((f"old {args.old}", old))
        for name, code in servers:
            print(json.dumps(asyncio.run(_measure(name.split()[0], code, args, work)) | {"server": name}), flush=True)


if __name__ == "__main__":
    main()
