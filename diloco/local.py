"""``diloco local``: the whole system on one machine — a coordinator, S shards and M
learners as separate processes on 127.0.0.1 — with live progress, a run directory and a
summary. It drives the cluster the way a user would: learners are added through the
coordinator's AddLearners RPC, and the final global model is fetched with Bootstrap.

Run directory: ``config.json``, ``endpoints.json`` (role, address, pid of every process,
written as they come up), ``admin-token`` (0600; ``diloco admin --run-dir DIR`` drives
the running cluster), ``logs/``, ``shard<m>/tape-S<m>.jsonl``, ``learners/<id>.json``,
``model.pt`` (the final global model, a plain state dict), ``summary.json`` and
``eval_loss.png``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from diloco import auth
from diloco.config import RunConfig
from diloco.errors import InvalidArgument, Unavailable
from diloco.tape import read_tape

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalConfig:
    run: RunConfig = field(default_factory=RunConfig)
    learners: int = 3
    shards: int = 2
    quorum: int = 1
    grace: str = "auto"
    """auto, off, or seconds."""
    steps: int = 150
    """Inner steps per learner."""
    outer_lr: float = 1.0
    """The local defaults average the merged deltas without outer momentum: at this short a
    sync period, with ~1.5 of 3 learners per round, momentum 0.9 re-applies overlapping
    progress and the run barely learns (measured, 3 learners x 150 steps: final eval
    7.17 bits/byte with lr 0.7 / momentum 0.9, 3.61 with lr 1.0 / momentum 0)."""
    outer_momentum: float = 0.0
    batch_size: int = 16
    out: Path | None = None
    startup_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.learners < 1 or self.shards < 1 or self.steps < 1 or self.quorum < 1:
            raise InvalidArgument("learners, shards, steps and quorum must all be >= 1")
        if self.shards > self.run.fragments:
            raise InvalidArgument(f"{self.shards} shards for {self.run.fragments} fragments: some shard would own none")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """The processes of one local run; every one of them ends when the run does."""

    def __init__(self, cfg: LocalConfig, run_dir: Path) -> None:
        self.cfg, self.dir = cfg, run_dir
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.endpoints: list[dict] = []
        self.coordinator = f"127.0.0.1:{_free_port()}"
        self.shards = [f"127.0.0.1:{_free_port()}" for _ in range(cfg.shards)]

    def _spawn(self, role: str, args: list[str]) -> subprocess.Popen:
        log = open(self.dir / "logs" / f"{role}.log", "ab")
        proc = subprocess.Popen([sys.executable, "-m", "diloco.cli", "--log-level", "INFO", *args],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append((role, proc))
        return proc

    def _endpoint(self, role: str, address: str, pid: int) -> None:
        self.endpoints.append({"role": role, "address": address, "pid": pid})
        tmp = self.dir / "endpoints.json.tmp"
        tmp.write_text(json.dumps(self.endpoints, indent=1))
        os.replace(tmp, self.dir / "endpoints.json")

    def start(self) -> None:
        (self.dir / "logs").mkdir(parents=True, exist_ok=True)
        run_file = self.dir / "run.json"
        common = ["--secret-file", str(self.dir / "secret"), "--run-config", str(run_file)]
        learner_cmd = (f"{sys.executable} -m diloco.cli --log-level INFO learner --steps {self.cfg.steps} "
                       f"--eval-every {max(self.cfg.steps // 6, 1)} "
                       f"--batch-size {self.cfg.batch_size} --summary-dir {self.dir / 'learners'}")
        coord = self._spawn("coordinator", [
            "coordinator", "--port", self.coordinator.rsplit(":", 1)[1], "--data-dir", str(self.dir / "coordinator"),
            "--shards", ",".join(self.shards), "--learner-command", learner_cmd, *common,
        ])
        for m, address in enumerate(self.shards):
            shard = self._spawn(f"shard{m}", [
                "syncer", "--shard-id", str(m), "--shards", str(self.cfg.shards), "--port", address.rsplit(":", 1)[1],
                "--data-dir", str(self.dir / f"shard{m}"), "--coordinator", self.coordinator,
                "--quorum", str(self.cfg.quorum), "--grace", self.cfg.grace,
                "--outer-lr", str(self.cfg.outer_lr), "--outer-momentum", str(self.cfg.outer_momentum),
                "--snapshot-dir", str(self.dir / "coordinator" / "snapshots"), *common,
            ])
            self._wait_serving(address, f"shard {m}", shard)
            self._endpoint(f"shard{m}", address, shard.pid)
        self._wait_serving(self.coordinator, "the coordinator", coord)
        self._endpoint("coordinator", self.coordinator, coord.pid)
        token_file = self.dir / "coordinator" / "admin-token"
        _wait(lambda: token_file.exists(), self.cfg.startup_timeout_s, "the admin token")
        (self.dir / "admin-token").write_text(token_file.read_text())
        os.chmod(self.dir / "admin-token", 0o600)

    def _wait_serving(self, address: str, what: str, proc: subprocess.Popen) -> None:
        def serving() -> bool:
            if proc.poll() is not None:
                raise Unavailable(f"{what} exited with code {proc.returncode}; see {self.dir / 'logs'}")
            host, port = address.rsplit(":", 1)
            with socket.socket() as s:
                return s.connect_ex((host, int(port))) == 0

        _wait(serving, self.cfg.startup_timeout_s, what)

    def stop(self) -> None:
        """SIGTERM everything (the coordinator reaps its learners), SIGKILL what lingers."""
        for _, proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        for _, proc in self.procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise Unavailable(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.1)


# --- progress ------------------------------------------------------------------------


def _shard_status(addresses: list[str]) -> list:
    from syncer.client import SyncerClient, open_channel

    async def one(address):
        async with open_channel(address) as channel:
            return await SyncerClient(channel, "", "", timeout_s=2).status()

    async def all_():
        return await asyncio.gather(*(one(a) for a in addresses), return_exceptions=True)

    return asyncio.run(all_())


def _progress_table(members: list[dict], statuses: list, started: float):
    from rich.table import Table

    table = Table(title=f"diloco local — {time.monotonic() - started:5.0f} s", title_justify="left")
    for column in ("learner", "state", "pool", "tokens", "tokens/s", "inner steps"):
        table.add_column(column, justify="right" if column.startswith(("tokens", "inner")) else "left")
    for m in members:
        table.add_row(m["id"], m["state"], m.get("pool", ""), f"{m.get('tokens', 0):,}",
                      f"{m.get('tokens_per_s', 0):,.0f}", f"{m.get('inner_steps', 0):,}")
    ok = [s for s in statuses if not isinstance(s, BaseException)]
    versions = [f.version for s in ok for f in s.fragments]
    table.caption = (
        f"global tokens {sum(m.get('tokens', 0) for m in members):,} · outer versions "
        f"{min(versions, default=0)}–{max(versions, default=0)} · rounds {sum(s.rounds_closed for s in ok)} · "
        f"pushes {sum(s.pushes_received for s in ok)} · wire ↑{sum(s.bytes_received for s in ok) / 1e6:.1f} MB "
        f"↓{sum(s.bytes_sent for s in ok) / 1e6:.1f} MB"
    )
    return table


# --- results -------------------------------------------------------------------------


def _fetch_model(cluster: Cluster, secret: str, run: RunConfig) -> dict[str, torch.Tensor]:
    from syncer.client import SyncerClient, open_channel

    plan = run.plan()
    state = {name: torch.empty(shape) for name, shape in run.named_shapes()}

    async def fetch():
        updates = []
        for address in cluster.shards:
            async with open_channel(address) as channel:
                updates += await SyncerClient(channel, "C", auth.sign(secret, "C"), timeout_s=30).bootstrap()
        return updates

    for update in asyncio.run(fetch()):
        for view, value in zip(plan.gather(update.fragment, state), update.segments[-1].tensors):
            view.copy_(value)
    return state


def _eval_bpb(run: RunConfig, state: dict[str, torch.Tensor] | None, batches: int = 8) -> float:
    from diloco.model import GPT
    from learner.data import load_corpus

    model = GPT(run.model)
    if state is not None:
        model.load_state_dict(state)
    corpus = load_corpus(None, 0, 8)
    losses = []
    with torch.no_grad():
        for i in range(batches):
            x, y = corpus.eval.batch(i, 16, run.model.context, seed=12345)
            losses.append(float(model(x, y)[1]))
    return sum(losses) / len(losses) / math.log(2)


def tape_stats(run_dir: Path, fragments: int, learner_steps: int) -> dict:
    """Rounds, participants and grace from the shards' tapes; goodput (README): the share
    of learner fragment-steps whose delta was merged with weight > 0."""
    rounds, merged = [], set()
    pushes = []
    for tape in sorted(run_dir.glob("shard*/tape-S*.jsonl")):
        for r in read_tape(tape):
            if r["kind"] == "round":
                rounds.append(r)
                merged |= {(p, r["fragment"], r["version"]) for p, w in zip(r["participants"], r["weights"]) if w > 0}
            elif r["kind"] == "push" and r["outcome"] != "duplicate":
                pushes.append(r)
    merged_steps = sum(p["steps"] for p in pushes if (p["learner"], p["fragment"], p["target_version"]) in merged)
    total = learner_steps * fragments
    closes = sorted(r["t"] for r in rounds)
    return {
        "rounds": len(rounds),
        "mean_participants": round(sum(len(r["participants"]) for r in rounds) / len(rounds), 3) if rounds else 0.0,
        "mean_grace_s": round(sum(r["grace_s"] for r in rounds) / len(rounds), 4) if rounds else 0.0,
        "goodput": round(min(merged_steps / total, 1.0), 4) if total else 0.0,
        "round_closes": closes,
    }


def uptime(closes: list[float], start: float, end: float, period_s: float) -> tuple[float, float]:
    """(uptime, global stall seconds): the global model is up in every window of length
    ``period_s`` that saw a round close; a stall is time beyond ``period_s`` between two
    closes (or from the start to the first, or the last to the end)."""
    if end <= start or period_s <= 0:
        return 0.0, 0.0
    points = [start, *[c for c in closes if start <= c <= end], end]
    stall = sum(max(b - a - period_s, 0.0) for a, b in zip(points, points[1:]))
    return round(1.0 - stall / (end - start), 4), round(stall, 3)


def plot_eval(run_dir: Path, learner_summaries: list[dict], final_bpb: float, tokens: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for s in learner_summaries:
        history = s.get("eval_history") or []
        ax.plot([h[1] for h in history], [h[2] for h in history], marker="o", ms=3, label=s["learner_id"])
    end = max((s["tokens"] for s in learner_summaries), default=0)
    ax.scatter([end], [final_bpb], color="black", zorder=3,
               label=f"final global model ({tokens:,} tokens from all learners)")
    ax.set_xlabel("tokens seen by each learner")
    ax.set_ylabel("eval loss (bits per byte)")
    ax.set_title("diloco local: eval loss vs tokens")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(run_dir / "eval_loss.png", dpi=120)
    plt.close(fig)


# --- the command ---------------------------------------------------------------------


def run_local(cfg: LocalConfig) -> dict:
    from rich.console import Console
    from rich.live import Live

    from coordinator.client import AdminClient

    run_dir = cfg.out or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "learners").mkdir(exist_ok=True)
    secret = auth.new_secret()
    (run_dir / "secret").write_text(secret)
    os.chmod(run_dir / "secret", 0o600)
    (run_dir / "run.json").write_text(cfg.run.to_json())
    (run_dir / "config.json").write_text(json.dumps({**asdict(cfg), "out": str(run_dir), "run": json.loads(cfg.run.to_json())}, indent=1))
    console = Console(stderr=True)
    console.print(f"[bold]diloco local[/]: {cfg.learners} learners, {cfg.shards} shards, run directory {run_dir}")
    eval_start = _eval_bpb(cfg.run, None)
    cluster = Cluster(cfg, run_dir)
    started_wall, started = time.time(), time.monotonic()
    admin = None
    interrupted = False
    try:
        cluster.start()
        admin = AdminClient(cluster.coordinator, (run_dir / "admin-token").read_text().strip(), timeout_s=10)
        results = admin.add_learners(cfg.learners)
        failed = [r for r in results if not r["ok"]]
        if failed:
            raise Unavailable(f"could not launch learners: {failed}")
        with Live(console=console, refresh_per_second=2) as live:
            while True:
                members = admin.members(include_gone=True)
                live.update(_progress_table(members, _shard_status(cluster.shards), started))
                done = len(members) >= cfg.learners and all(m["state"] in ("left", "failed") for m in members)
                if done:
                    break
                time.sleep(1.0)
    except KeyboardInterrupt:
        interrupted = True
        console.print("interrupted: stopping every process")
    finally:
        state = None
        try:
            if cluster.procs:
                state = _fetch_model(cluster, secret, cfg.run)
        except Exception as error:  # the cluster may already be gone after Ctrl-C
            logger.warning("could not fetch the final model: %s", error)
        members = admin.members(include_gone=True) if admin is not None and not interrupted else []
        if admin is not None:
            admin.close()
        cluster.stop()
    wall_s = time.monotonic() - started
    summaries = [json.loads(p.read_text()) for p in sorted((run_dir / "learners").glob("*.json"))]
    if state is not None:
        torch.save(state, run_dir / "model.pt")
    eval_final = _eval_bpb(cfg.run, state) if state is not None else float("nan")
    tokens = sum(s["tokens"] for s in summaries)
    steps = sum(s["inner_steps"] for s in summaries)
    stats = tape_stats(run_dir, cfg.run.fragments, steps)
    step_time = sum(s["train_s"] for s in summaries) / max(steps, 1)
    period = cfg.run.sync_every_steps / cfg.run.fragments * step_time * 4
    up, stall = uptime(stats.pop("round_closes"), started_wall + (wall_s - max((s["wall_s"] for s in summaries), default=0)), started_wall + wall_s, period)
    summary = {
        "tokens": tokens,
        "wall_s": round(wall_s, 2),
        "eval_loss_start": round(eval_start, 4),
        "eval_loss_final": round(eval_final, 4),
        "goodput": stats.pop("goodput"),
        "uptime": up,
        "global_stall_s": stall,
        "bytes_up": sum(s["bytes_up"] for s in summaries),
        "bytes_down": sum(s["bytes_down"] for s in summaries),
        **stats,
        "learners_joined": len(members) if members else len(summaries),
        "learners_failed": sum(1 for m in members if m["state"] == "failed"),
        "interrupted": interrupted,
        "run_dir": str(run_dir),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    if summaries and state is not None:
        plot_eval(run_dir, summaries, eval_final, tokens)
    return summary
