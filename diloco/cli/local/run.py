"""``diloco local``: the whole system on one machine — a coordinator, S shards and M
learners as separate processes on 127.0.0.1 — with live progress, a run directory and a
summary. It drives the cluster the way a user would: learners are added through the
coordinator's AddLearners RPC, and the final global model is fetched with ExportModel.

``LocalRun`` reads as the run goes: ``prepare`` (every check that can refuse the run,
before anything is written), ``open`` (the run directory), ``start`` (the processes, the
learners, the curve exports, the chaos), ``watch`` (a look every second or so until every
learner launched is gone), ``stop`` (learners drained, a snapshot after an interrupt, the
final export, the processes stopped) and ``report`` (summary.json, curves, plots, the
chaos check). Its parts are their modules': ``rundir`` (the directory), ``supervisor``
(the processes), ``progress`` (tables and lines), ``curves`` and ``plots``, ``summary``
(what summary.json holds) and ``diloco.cli.metrics`` (every measure).

Run directory: ``config.json``, ``endpoints.json`` (role, address, pid of every process,
written as they come up), ``admin-token`` (0600; ``diloco admin --run-dir DIR`` drives
the running cluster), ``logs/``, ``shard<m>/tape-S<m>.jsonl``, ``learners/<id>.json``,
``model.safetensors`` (the final global model under the keys of the task model's
``state_dict()``), ``curve/`` (the global model exported at each curve point, and
``evals.jsonl``), ``curves.jsonl``, ``loss.png``, ``timeline.png`` and ``summary.json``;
with ``--tensorboard DIR``, the curves as TensorBoard event files in DIR; with a Hugging
Face task (``Task.save_pretrained``), ``hf/``, the final model as ``from_pretrained``
loads it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import math
import os
import shutil
import signal
import stat
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from diloco.cli.chaos import ChaosMonkey, ChaosNetwork
from diloco.cli.check import describe, write_check
from diloco.cli.export import export_model, write_pretrained
from diloco.cli.local import rundir
from diloco.cli.local.config import LocalConfig
from diloco.cli.local.curves import check_tensorboard, record_global_evals, write_curves, write_tensorboard
from diloco.cli.local.plots import plot_loss
from diloco.cli.local.progress import Failures, closing_lines, final_table, progress_line, progress_table
from diloco.cli.local.summary import RunRecord, build_summary, missing_figures, strict
from diloco.cli.local.supervisor import Cluster, shard_status, take_snapshot
from diloco.cli.metrics import (curve_marks, curve_path, eval_task, learner_events, run_tokens, supervisor_task,
                                tape_stats, tokens_per_step)
from diloco.coordinator import sites
from diloco.coordinator.config import CoordinatorConfig
from diloco.coordinator.launcher import LINK_OVERRIDE
from diloco.coordinator.pin import pin_of
from diloco.errors import DeadlineExceeded, DilocoError, FailedPrecondition, Unavailable
from diloco.files import atomic_write_json, missing_dirs
from diloco.learner.membership import HEARTBEATS_PER_LEASE
from diloco.manifest import manifest_of
from diloco.telemetry import require_prometheus

logger = logging.getLogger(__name__)

DRAIN_LEAD_S = 10 * CoordinatorConfig.lease_s / HEARTBEATS_PER_LEASE
"""How long before the budget is reached (at the learners' rates) the drain is sent, ten of
their heartbeat intervals (a fifth of the coordinator's lease each): a learner trains past
its allotment when its directive arrives later than the budget has left, so the lead
covers a heartbeat interval and a coordinator that stops answering for a while. With the
coordinator SIGSTOPped 5 s at 16 moments of the chaos test's run, 5 runs at five intervals
ended 8,704 to 66,560 tokens over a 768,000 budget, none at ten with ``Budget.rebalance``
(docs/results/budget)."""
DRAIN_FILE = "drain.json"
"""The budget's drain as decided (``Budget.spend``): each training learner's reported count,
that count's age, its rate, the count estimated from them and its allotment."""
EXPORT_ATTEMPTS = 3
"""Tries of the final export (a shard that stops sending fails one in 30 s)."""
LEARNERS_STOP_S = 8.0
"""How long a stop waits for drained learners' summaries (their final pushes take at
most ``FINAL_PUSH_WAIT_S``) before the shards and the coordinator go regardless."""


def run_local(cfg: LocalConfig) -> dict:
    """Run ``cfg`` (or the next part of a stopped run, ``cfg.resume``) and return its summary."""
    return LocalRun(cfg).run()


class LocalRun:
    """One part of a ``diloco local`` run (a resumed run has several)."""

    def __init__(self, cfg: LocalConfig) -> None:
        from rich.console import Console

        self.cfg = cfg
        self.part_started = time.time()
        self.run_dir = cfg.out or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
        self.snapshot_dir = cfg.snapshot_dir or str(self.run_dir / "coordinator" / "snapshots")
        self.console = Console(stderr=True, width=None if sys.stderr.isatty() else 120)  # logs: no table cut at 80
        self.lock = self.resumed_from = None
        self.made_dirs: list[Path] = []
        self.given_mode = 0o700
        # The parts, made as the run starts:
        self.hub = self.cluster = self.admin = self.monkey = self.curves = None
        self.arrived = Arrivals()
        self.progress: Progress | None = None
        self.budget = Budget(cfg.tokens, self.run_dir / DRAIN_FILE)
        self.interrupted_at: float | None = None

    def say(self, line: str) -> None:
        self.console.print(line, soft_wrap=True, markup=False)

    def run(self) -> dict:
        self.prepare()
        with self.undone_unless_started():
            self.open()
            self.hub = sites.new_hub(self.say) if self.cfg.sites else None
            try:
                self.cluster = Cluster(self.cfg, self.run_dir, self.learner_steps, self.pin, self.hub)
            except BaseException:
                if self.hub is not None:
                    sites.remove_hub(self.hub)
                raise
            record = RunRecord(self.run_dir, started_wall=time.time(), resumed_from=self.resumed_from)
            started = time.monotonic()
            with _interrupts() as arrived:
                self.arrived = arrived
                try:
                    self.start(record)
                    self.watch(record, started)
                except KeyboardInterrupt:
                    record.interrupted, self.interrupted_at = True, arrived.first or time.monotonic()
                    self.console.print("interrupted: the learners stop (final pushes, summaries), a snapshot is "
                                       "taken, then the shards and the coordinator stop")
                finally:
                    self.stop(record)
        record.wall_s, record.drained_at = time.monotonic() - started, self.budget.drained_at
        return self.report(record)

    @contextlib.contextmanager
    def undone_unless_started(self):
        """A new run that fails (or is interrupted) before any of its processes started
        leaves nothing behind, so the same --out works next time: the directories it made
        are removed, and an empty directory the user gave is emptied again (its mode back).
        Once a process started, its logs stay for the user to read."""
        try:
            yield
        except BaseException:
            if not self.cfg.resume and (self.cluster is None or not self.cluster.procs):
                self.discard()
            raise

    def discard(self) -> None:
        if self.lock is not None:
            self.lock.close()
            self.lock = None
        rundir.undo_new_run(self.run_dir, self.made_dirs, self.given_mode)

    def prepare(self) -> None:
        """Every check that can refuse the run, before anything is written or started: the
        directory, the devices and extras asked for, the task (built, pinned, evaluated)."""
        cfg = self.cfg
        if cfg.resume:
            self.lock = rundir.lock(self.run_dir)
            self.resumed_from = rundir.resumable(self.run_dir, self.snapshot_dir)
        else:
            rundir.check_new_run_dir(self.run_dir)
            self.made_dirs = missing_dirs(self.run_dir)  # what open makes, deepest first
            if not self.made_dirs:
                self.given_mode = stat.S_IMODE(self.run_dir.stat().st_mode)
            if cfg.snapshot_dir is not None and "://" not in cfg.snapshot_dir:  # a URL's store is checked as used
                rundir.check_dir_flag("--snapshot-dir", Path(cfg.snapshot_dir))
        _check_devices(cfg)
        if cfg.tensorboard is not None:
            check_tensorboard(cfg.tensorboard)
        if cfg.sites:
            sites.check()  # root, namespaces and tc
        if cfg.prometheus:
            require_prometheus()  # the optional extra
        self.task = supervisor_task(cfg.run, cfg.learners)
        manifest = manifest_of(self.task.model)
        cfg.check_cut(len(manifest.synced), manifest.max_fragments())  # --fragments and --shards, in one line
        self.pin = pin_of(self.task.model, cfg.run.fragments)  # the run's model, pinned at the coordinator
        self.eval_start = eval_task(cfg.run, self.task)  # a task whose evaluation fails stops here
        self.batch_tokens = tokens_per_step(cfg.run, self.task)
        self.learner_steps = cfg.learner_steps(self.batch_tokens)
        self.launches = [self.learner_steps] * cfg.learners
        """The inner steps of each learner this part launches."""
        if cfg.resume and cfg.tokens is None:
            self._plan_resumed_steps()

    def _plan_resumed_steps(self) -> None:
        """On a steps budget, a resumed part launches a learner for each learner the stop
        interrupted, each for the steps it had left (``--learners N`` given anew: their total
        shared by N); a run stopped before learners recorded their plan continues as it
        did, each learner with the most steps any one had left."""
        left = rundir.steps_left(self.run_dir)
        if left:
            count = self.cfg.learners if self.cfg.learners != rundir.stored_learners(self.run_dir) else len(left)
            self.launches = rundir.split_steps(left, count)
            self.cfg = replace(self.cfg, learners=count)
            self.learner_steps = max(self.launches)
            return
        self.learner_steps = max(self.learner_steps - rundir.most_steps_done(self.run_dir), 1)
        self.launches = [self.learner_steps] * self.cfg.learners

    def open(self) -> None:
        """A new run's directory and files, or a resumed run's line in resumes.jsonl."""
        cfg, run_dir = self.cfg, self.run_dir
        if cfg.resume:
            self.console.print(f"[bold]diloco local[/]: resuming {run_dir} from snapshot {self.resumed_from}")
            with open(run_dir / "resumes.jsonl", "a") as resumes:
                resumes.write(json.dumps({"t": time.time(), "snapshot": self.resumed_from, "learners": cfg.learners,
                                          "learner_steps": self.learner_steps, "launches": self.launches}) + "\n")
        else:
            self.lock = rundir.start_new_run(run_dir, cfg, self.learner_steps)
            if math.isfinite(self.eval_start):  # the seed is every fragment's version 0
                seed = ("seed", time.time(), dict.fromkeys(range(cfg.run.fragments), 0), self.eval_start)
                record_global_evals(run_dir, [seed], self.task.eval_unit)
        budget = f"{cfg.tokens:,} tokens" if cfg.tokens else f"{self.learner_steps} inner steps each"
        self.console.print(f"[bold]diloco local[/]: task {cfg.run.task}, {cfg.learners} learners, {cfg.shards} shards, "
                           f"{budget}, run directory {run_dir}")

    def start(self, record: RunRecord) -> None:
        """The processes, the admin client, the learners (through AddLearners, as a user
        would), the curve exports and the chaos."""
        from diloco.clients.coordinator import AdminClient

        cfg, cluster = self.cfg, self.cluster
        cluster.start(restore=None if self.resumed_from is None else str(self.resumed_from))
        if cluster.status_url:
            self.say(f"status page: {cluster.status_url}")
        self.token = (self.run_dir / "admin-token").read_text().strip()
        self.admin = AdminClient(cluster.coordinator, self.token, timeout_s=10)
        record.before = {m["id"] for m in self.admin.members(include_gone=True)}  # a resumed run's earlier learners
        _launch(self.admin, cfg, self.launches, self.learner_steps)
        marks = curve_marks(cfg.tokens or cfg.learners * self.learner_steps * self.batch_tokens, cfg.curve_points)
        self.curves = CurveExports(AdminClient(cluster.coordinator, self.token, timeout_s=60), self.run_dir, marks)
        if cfg.chaos.active:  # its clock starts now that the learners are launched
            chaos_admin = AdminClient(cluster.coordinator, self.token, timeout_s=10)
            network = ChaosNetwork(self.hub, cluster.coordinator, tuple(cluster.shards)) if self.hub is not None else None
            self.monkey = ChaosMonkey(cfg.chaos, chaos_admin,
                                      lambda m: cluster.restart_shard(m, chaos_admin, self.monkey.record),
                                      self.learner_steps, self.run_dir / "chaos.jsonl", time.monotonic(), network,
                                      cfg.shards)
            self.monkey.start()

    def watch(self, record: RunRecord, started: float) -> None:
        """Look at the cluster until every learner launched is gone, the time limit passes
        or no launch ever joins: show progress, export the curve points, drain on budget."""
        self.progress = Progress(self.console, self.run_dir, self.cluster, self.cfg.run.fragments,
                                 self.task.eval_unit, started)
        ending = Ending(self.cfg, record, started)
        with self.progress.live():
            while True:
                self.arrived.raise_if_lost()
                members, launches = _patient(lambda: self.admin.listing(include_gone=True), "list the learners")
                _link_learner_logs(self.run_dir, members)
                self.cluster.note_learners(members)
                self.progress.show(members, launches)
                trained = sum(m["tokens"] for m in members)
                self.curves.passed(trained)
                self.budget.spend(trained, members, self.admin, self.monkey)
                if ending.reached([m for m in members if m["id"] not in record.before], trained, self.monkey,
                                  self.console):
                    break
                time.sleep(self.budget.pause())

    def stop(self, record: RunRecord) -> None:
        """Learners first, while the shards serve (their final pushes land, they write their
        summaries); after an interrupt a snapshot to resume from; the final model; then the
        shards and the coordinator (their processes run in sessions of their own)."""
        if self.curves is not None:
            self.curves.close()
        if self.monkey is not None:
            self.monkey.halt()
            self.monkey.join(timeout=60)
        if self.admin is not None:
            record.stopped = _stop_learners(self.admin, self.run_dir, self.say)
            if record.interrupted:  # what --resume continues from: every step trained is in it
                record.stop_snapshot = _snapshot_for_resume(self.admin, self.run_dir, self.say)
            self._export_final(record)
            try:
                record.members, record.launches = self.admin.listing(include_gone=True)
                self.cluster.note_learners(record.members)
            except DilocoError as error:
                logger.warning("could not list the learners: %s", error)
            self.admin.close()
        try:
            self.cluster.stop(say=self.say)
        finally:
            if self.hub is not None:
                sites.remove_hub(self.hub)

    def _export_final(self, record: RunRecord) -> None:
        from diloco.clients.coordinator import AdminClient

        record.exported_at = time.time()
        self.console.print("exporting the trained model from the shards")
        for attempt in range(1, EXPORT_ATTEMPTS + 1):
            try:
                exported = export_model(AdminClient(self.cluster.coordinator, self.token, timeout_s=60),
                                        self.run_dir / "model.safetensors", timeout_s=120)
                record.state, record.versions = exported.state, exported.versions
                return
            except DilocoError as error:  # the cluster may already be gone after Ctrl-C
                record.export_error = str(error)
                logger.warning("could not export the final model (attempt %d of %d): %s", attempt, EXPORT_ATTEMPTS,
                               error)

    def report(self, record: RunRecord) -> dict:
        """summary.json, the global model's eval curve, the figures, the chaos check and the
        closing lines; the summary is returned."""
        from diloco.cli.timeline import draw_timeline

        cfg, run_dir, task, unit = self.cfg, self.run_dir, self.task, self.task.eval_unit
        events = learner_events(run_dir)
        eval_final = eval_task(cfg.run, task, record.state) if record.state is not None else float("nan")
        if record.state is not None and task.save_pretrained is not None:  # a Hugging Face task: RUN_DIR/hf
            pretrained = run_dir / "hf"
            if cfg.resume and pretrained.exists():  # a resumed run's final model replaces its earlier part's
                shutil.rmtree(pretrained)
            write_pretrained(cfg.run.task, task, record.state, pretrained)
        curves, curve = self._global_curve(record, events, eval_final)
        summary = build_summary(cfg, record, events, unit, (self.eval_start, eval_final), curve)
        summary = strict(summary, missing_figures(task, record))
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1, allow_nan=False))
        self.console.print(final_table(summary, events))  # the same records as summary.json, however the run ended
        if curves:
            plot_loss(run_dir, curves, unit)
        if cfg.tensorboard is not None:
            write_tensorboard(curves, cfg.tensorboard, self.part_started)
        if events:
            draw_timeline(run_dir)
        if cfg.chaos.active and not record.interrupted:  # the checker over what the run recorded: check.json
            report = write_check(run_dir)
            self.say(describe(report))
            if not report.ok:
                summary["failures"].append(f"the chaos checker found a violation ({run_dir / 'check.json'}): "
                                           f"{report.first}")
                (run_dir / "summary.json").write_text(json.dumps(summary, indent=1, allow_nan=False))
        for line in closing_lines(summary, run_dir):
            self.say(line)
        if self.interrupted_at is not None:  # from the signal's arrival to this line; the process exits next
            self.say(f"stopped {time.monotonic() - self.interrupted_at:.1f} s after the interrupt arrived (learners "
                     "stopped, snapshot, export, summary: all but the process's exit)")
        self.lock.close()
        return summary

    def _global_curve(self, record: RunRecord, events: dict, eval_final: float) -> tuple[list[dict], list]:
        """The global model's evaluations (each curve point's export and the final model)
        recorded, curves.jsonl written: its records, and summary.json's ``curve``."""
        from safetensors.torch import load_file

        cfg, task = self.cfg, self.task
        if task.eval_batches:
            exports = self.curves.done if self.curves is not None else []
            if record.state is not None:  # a mark seen pass once training was over: the final model is that point
                tokens_at = run_tokens(events)
                exports = [e for e in exports if tokens_at(e[0]) < tokens_at(record.exported_at)]
            evals = [("curve", t, v, eval_task(cfg.run, task, load_file(str(path)))) for t, v, path in exports]
            if record.state is not None:
                evals.append(("final", record.exported_at, record.versions, eval_final))
            record_global_evals(self.run_dir, evals, task.eval_unit)
        curves = write_curves(self.run_dir, events)
        if record.state is None:
            return curves, []
        return curves, [[r["tokens"], round(r["loss"], 4)] for r in curves if r["series"] == "global_eval"]


class Progress:
    """What the run shows while it runs: on a terminal a live table; in a log (CI, nohup,
    kubectl logs) one line every 10 s; and each failure once, as it happens. (The live
    table is transient: at the end the final table, from the summary's records, takes its
    place.)"""

    LINE_EVERY_S = 10.0
    STATS_EVERY_S = 5.0

    def __init__(self, console, run_dir: Path, cluster: Cluster, fragments: int, unit: str, started: float) -> None:
        self.console, self.run_dir, self.cluster = console, run_dir, cluster
        self.fragments, self.unit, self.started = fragments, unit, started
        self.failures = Failures(run_dir)
        self.table = None
        self.last_line = self.last_stats = 0.0
        self.step_goodput = None

    @contextlib.contextmanager
    def live(self):
        from rich.live import Live

        if not self.console.is_terminal:
            yield
            return
        with Live(console=self.console, refresh_per_second=2, transient=True) as self.table:
            yield
        self.table = None

    def show(self, members: list[dict], launches: list[dict]) -> None:
        for line in self.failures.new(members, launches):
            self.console.print(line, soft_wrap=True, markup=False)
        events = learner_events(self.run_dir)
        if time.monotonic() - self.last_stats > self.STATS_EVERY_S:
            steps = {m["id"]: m["inner_steps"] for m in members if m["launch_id"]}  # the run's own, as the summary
            self.step_goodput = tape_stats(self.run_dir, self.fragments, steps)["step_goodput"]
            self.last_stats = time.monotonic()
        statuses = shard_status(self.cluster.shards, self.cluster.secret)
        if self.table is not None:
            self.table.update(progress_table(members, statuses, events, self.step_goodput, self.started, self.unit))
        elif time.monotonic() - self.last_line >= self.LINE_EVERY_S:
            self.console.print(progress_line(members, statuses, events, self.started, self.unit), soft_wrap=True)
            self.last_line = time.monotonic()


class Budget:
    """The run's token budget (``--tokens``), met to within a step per learner: shortly
    before it is reached (``DRAIN_LEAD_S`` at the current rate), what is left of it is
    allotted to the training learners by their rates, and each is drained after its own
    token count reaches its allotment (``allot``; the learner counts its own steps, so
    neither the counts' age nor the directive's delay adds tokens). A learner whose
    directive reached it past its allotment (a coordinator that stopped answering across
    the drain) trains that much over, and one that runs out of its steps or dies before
    its allotment that much short: the others' allotments are moved by it while they
    train (``rebalance``). A learner that joins later is drained at once."""

    def __init__(self, tokens: int | None, record: Path | None = None) -> None:
        self.tokens = tokens
        self.record = record
        """Where the drain's decisions are written (``DRAIN_FILE``); None: nowhere."""
        self.decisions: dict = {}
        """What ``DRAIN_FILE`` holds: the drain's decision and each later move."""
        self.rate = 0.0
        """The training learners' tokens/s, together."""
        self.spent = 0
        """Tokens trained, as of the last look (``spend``)."""
        self.draining: set[str] = set()
        self.drained_at: float | None = None
        """Unix time of the first drain."""
        self.allotments: dict[str, int] = {}
        """Each allotted learner's current allotment."""
        self.allotted = 0
        """What the first allotments summed to: the allotted learners' share of the budget."""

    def spend(self, trained: int, members: list[dict], admin, monkey: ChaosMonkey | None) -> None:
        if self.tokens is None:
            return
        now = time.time()
        if self.allotments:
            self.rebalance(members, admin, now)
        training = [m for m in members if m["state"] in ("active", "joining")]
        rates = {m["id"]: _rate(m) for m in training}
        self.rate = sum(rates.values())
        # A count is up to a heartbeat interval old (more on a loaded host): what each learner
        # has trained since, at its rate, is spent too.
        counts = {m["id"]: _estimate(m, now) for m in training}
        self.spent = spent = trained + sum(counts[m["id"]] - m["tokens"] for m in training)
        if spent + self.rate * DRAIN_LEAD_S < self.tokens:
            return
        if monkey is not None:  # the budget is spent: no more faults, drain everyone (and anyone who joins late)
            monkey.halt()
        todo = [{**m, "tokens": counts[m["id"]]} for m in training if m["id"] not in self.draining]
        if todo:
            after = {} if self.draining else allot(self.tokens - spent, todo, rates)
            if not self.draining:
                self._write({"unix_s": now, "budget": self.tokens, "spent": spent, "rate": self.rate, "learners": {
                    m["id"]: {"reported": m["tokens"], "rate": rates[m["id"]], "count_age_s": _age(m, now),
                              "estimated": counts[m["id"]], "allotment": after.get(m["id"])} for m in training},
                    "moved": []})
            drained = _patient(lambda: _drain(admin, [m["id"] for m in todo], after), "drain the learners")
            self.draining |= set(drained)
            self.allotments.update({i: a for i, a in after.items() if i in drained})
            self.allotted = sum(self.allotments.values())
            self.drained_at = self.drained_at or time.time()

    def rebalance(self, members: list[dict], admin, now: float) -> None:
        """Keep the allotted learners' total on what was allotted: what they will have
        trained (a learner gone, its count; one still draining, its allotment or, past it,
        its count) is compared with it, and beyond a step per learner the difference is
        moved onto the allotments of the learners still training. Over (a learner whose
        directive reached it past its allotment): taken from those short of theirs, in
        proportion to what each has left (its estimated count when a new directive reaches
        it, two heartbeat intervals on, kept as is). Short (a learner that ran out of its
        steps, or died, before its allotment): given to them by their rates."""
        allotted = [m for m in members if m["id"] in self.allotments]
        draining = [m for m in allotted if m["state"] == "draining"]
        projected = sum(m["tokens"] if m["state"] != "draining" else max(self.allotments[m["id"]], m["tokens"])
                        for m in allotted)
        off = projected - self.allotted
        if abs(off) <= sum(m["tokens"] // max(m["inner_steps"], 1) for m in allotted) or not draining:
            return
        if off > 0:
            reach_s = 2 * CoordinatorConfig.lease_s / HEARTBEATS_PER_LEASE
            weights = {m["id"]: int(self.allotments[m["id"]] - _estimate(m, now) - _rate(m) * reach_s) for m in draining}
        else:
            weights = {m["id"]: _rate(m) for m in draining}
        weights = {i: w for i, w in weights.items() if w > 0}
        if not weights:
            return
        total = sum(weights.values())
        moved = min(off, total) if off > 0 else off  # at most the room there is
        shares = {i: int(moved * w / total) for i, w in weights.items()}
        shares[max(weights, key=weights.get)] += moved - sum(shares.values())
        new = {i: self.allotments[i] - s for i, s in shares.items() if s}
        # (one that left since the listing is not an error: ``_drain`` skips it)
        _patient(lambda: _drain(admin, list(new), new), "move the allotments")
        self.allotments.update(new)
        self.decisions["moved"].append({"unix_s": now, "off": off, "allotments": new})
        self._write(self.decisions)

    def _write(self, decisions: dict) -> None:
        self.decisions = decisions
        if self.record is not None:
            atomic_write_json(self.record, decisions)

    def pause(self) -> float:
        """Seconds to the next look: near the budget, just in time for the drain; once
        drained, often enough to see the end soon."""
        if self.draining:
            return 0.25
        if self.tokens is not None and self.rate > 0:
            return min(1.0, max((self.tokens - self.spent) / self.rate - DRAIN_LEAD_S, 0.05))
        return 1.0


class Ending:
    """When the watch ends: every learner the run launched has joined and is gone, the
    time limit passed, or no launch joins after every member is gone."""

    def __init__(self, cfg: LocalConfig, record: RunRecord, started: float) -> None:
        self.cfg, self.record, self.started = cfg, record, started
        self.idle_since: float | None = None

    def reached(self, current: list[dict], trained: int, monkey: ChaosMonkey | None, console) -> bool:
        cfg = self.cfg
        # The run's learners are those it launched; one that joined by itself with the
        # run's credential (an own-loop script, a hostile one) does not hold the end: the
        # stop drains it with the rest.
        if _finished(cfg, [m for m in current if m["launch_id"]], monkey):
            return True
        if cfg.time_limit_s is not None and time.monotonic() - self.started > cfg.time_limit_s:
            console.print(f"time limit of {cfg.time_limit_s:g} s reached at {trained:,} tokens: stopping")
            self.record.time_limited = True
            return True
        # A launch that never joins (the learner died while starting) must not hang the run:
        # once every member is gone, wait for late joiners only so long.
        if not (current and all(m["state"] in ("left", "failed") for m in current)):
            self.idle_since = None
            return False
        self.idle_since = self.idle_since or time.monotonic()
        if time.monotonic() - self.idle_since <= cfg.startup_timeout_s:
            return False
        logger.warning("%d launched learners never joined; see %s", _missing(cfg, current, monkey),
                       self.record.run_dir / "coordinator" / "learners")
        return True


class CurveExports:
    """The global model's exports at the curve points, one at a time on a thread of their
    own: the supervisor's loop, which sends the budget's drain, never waits on one (an
    export takes 0.04-0.16 s on the default model, seconds on a loaded machine). A mark
    that passes while the previous export still runs is skipped: the curve has a point
    fewer, and the run says so in its log."""

    def __init__(self, admin, run_dir: Path, marks: list[int]) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.admin, self.run_dir, self.marks = admin, run_dir, marks
        self.done: list[tuple[float, dict[int, int], Path]] = []
        """(unix time asked, each fragment's version, the file) of each export that landed."""
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="diloco-curve-export")
        self._pending = None

    def passed(self, trained: int) -> None:
        """The learners have trained ``trained`` tokens: export the global model if a mark
        was passed since the last look."""
        if self.marks and trained >= self.marks[0]:
            self.marks = [m for m in self.marks if m > trained]
            self.mark(trained)

    def mark(self, tokens: int) -> None:
        if self._pending is not None and not self._pending.done():
            logger.info("the eval curve skips the point at %d tokens: the previous export still runs", tokens)
            return
        self._pending = self._pool.submit(self._export, tokens)

    def _export(self, tokens: int) -> None:
        asked, path = time.time(), curve_path(self.run_dir, tokens)
        try:
            exported = export_model(self.admin, path, timeout_s=60)
        except DilocoError as error:  # a shard restarting: the curve lacks this point
            logger.warning("could not export the model for the eval curve at %d tokens: %s", tokens, error)
            return
        self.done.append((asked, exported.versions, path))

    def close(self) -> None:
        """Wait for the export in flight (before the cluster stops), then let go."""
        self._pool.shutdown(wait=True)
        self.admin.close()


PATIENCE_S = 60.0
"""How long the watch retries a call that timed out or found the coordinator unavailable:
after a stall of the whole host (a VM pause, SIGSTOP, a laptop's sleep) a call in flight
runs out of its deadline, and every process needs a moment to catch up."""


def allot(left: int, members: list[dict], rates: dict[str, float]) -> dict[str, int]:
    """What is ``left`` of the budget, shared among ``members`` by their current token
    ``rates``: learner -> the token count (its own, as last reported) to train to before it
    leaves. The shares sum to ``left`` exactly (the largest takes the rounding). An active
    member with no rate yet (it has just started training: what it trains until the drain
    reaches it counts) shares at the others' mean rate; a joining one, and everyone once
    nothing is left, gets none: they leave at once."""
    known = [rates[m["id"]] for m in members if rates.get(m["id"], 0) > 0]
    if left <= 0 or not known:
        return {}
    weights = {m["id"]: rates.get(m["id"], 0) or sum(known) / len(known)
               for m in members if rates.get(m["id"], 0) > 0 or m["state"] == "active"}
    total = sum(weights.values())
    shares = {i: int(left * w / total) for i, w in weights.items()}
    shares[max(weights, key=weights.get)] += left - sum(shares.values())
    tokens = {m["id"]: m["tokens"] for m in members}
    return {i: tokens[i] + share for i, share in shares.items()}


def _counted_s(member: dict) -> float:
    """When a member's counts were taken (0: no heartbeat yet), not when they arrived: a
    heartbeat a stalled coordinator held arrives with counts from before the stall."""
    return (member["counted_unix_ms"] or member["last_heartbeat_unix_ms"]) / 1000


def _rate(member: dict) -> float:
    """Its rate as it measures it, over its last steps on its own clock: not over the times
    its heartbeats arrived, which a stalled coordinator bunches (a count sent before a 5 s
    stall and the next one after it read as six times the rate)."""
    return member["tokens_per_s"] if _counted_s(member) else 0.0


def _age(member: dict, now: float) -> float | None:
    return round(max(now - _counted_s(member), 0.0), 3) if _counted_s(member) else None


def _estimate(member: dict, now: float) -> int:
    """Its count now: as last reported, plus what it has trained since at its rate."""
    return member["tokens"] + int(_rate(member) * (_age(member, now) or 0.0))


def _drain(admin, learner_ids: list[str], after_tokens: dict[str, int] | None = None) -> list[str]:
    """Drain these learners (``after_tokens``: see ``allot``); one that left since they were
    listed (its own steps done) is not an error. Returns the ids drained."""
    after_tokens = after_tokens or {}

    def drain(ids: list[str]) -> None:
        admin.remove_learners(ids, drain=True, after_tokens={i: after_tokens[i] for i in ids if i in after_tokens})

    for _ in range(3):
        if not learner_ids:
            return []
        try:
            drain(learner_ids)
            return learner_ids
        except FailedPrecondition:  # "already gone: L1": drain the ones still there
            live = {m["id"] for m in admin.members() if m["state"] in ("joining", "active", "draining")}
            learner_ids = [i for i in learner_ids if i in live]
    drain(learner_ids)
    return learner_ids


def _patient(call, what: str):
    """``call()``, retried for ``PATIENCE_S`` while it times out or the coordinator is
    unavailable: a transient after a stall is no reason to abandon the run."""
    deadline = time.monotonic() + PATIENCE_S
    while True:
        try:
            return call()
        except (DeadlineExceeded, Unavailable) as error:
            if time.monotonic() >= deadline:
                raise
            logger.warning("could not %s (%s): trying again", what, error)
            time.sleep(1.0)


def _launch(admin, cfg: LocalConfig, steps: list[int], default_steps: int) -> None:
    """A learner through AddLearners for each entry of ``steps`` (its inner steps; the
    learners' settings say ``default_steps``)."""
    slow, devices, links = dict(cfg.slow_learners), dict(cfg.learner_devices), dict(cfg.links)
    for index, planned in enumerate(steps):
        overrides = {"slow_factor": str(slow[index])} if index in slow else {}
        if planned != default_steps:
            overrides["steps"] = str(planned)
        if index in devices:
            overrides["device"] = devices[index]
        if index in links:
            overrides[LINK_OVERRIDE] = str(links[index])
        failed = [r for r in admin.add_learners(1, overrides=overrides) if not r["ok"]]
        if failed:
            raise Unavailable(f"could not launch learners: {failed}")


def _stop_learners(admin, run_dir: Path, say: Callable[[str], None]) -> list[str]:
    """Drain every live learner while the shards still serve, so its final pushes land and
    it writes its summary; wait for those summaries (at most ``LEARNERS_STOP_S``; a second
    Ctrl-C stops waiting). Returns the ids drained."""
    try:
        live = _drain(admin, [m["id"] for m in admin.members()])  # joining, active or draining
    except DilocoError as error:
        say(f"could not stop the learners through the coordinator: {error}")
        return []
    if not live:
        return []
    say(f"stopping {len(live)} learners: {', '.join(live)}")
    deadline = time.monotonic() + LEARNERS_STOP_S
    try:
        while (waiting := [i for i in live if not (run_dir / "learners" / f"{i}.json").exists()]) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
    except KeyboardInterrupt:
        say("stopped waiting for the learners (interrupted again)")
        return live
    if waiting:
        say(f"{', '.join(waiting)} did not stop within {LEARNERS_STOP_S:g} s: the coordinator stops them")
    return live


def _finished(cfg: LocalConfig, members: list[dict], monkey: ChaosMonkey | None) -> bool:
    """Every learner launched has joined and is gone. A chaos action in progress (a kill
    whose replacement is being launched, a network fault, a victim of one that may yet
    be failed and replaced) means not yet."""
    if monkey is not None and not (monkey.settled() and monkey.acting.acquire(blocking=False)):
        return False
    try:
        expected = cfg.learners + (monkey.launched if monkey is not None else 0)
        return len(members) >= expected and all(m["state"] in ("left", "failed") for m in members)
    finally:
        if monkey is not None:
            monkey.acting.release()


def _missing(cfg: LocalConfig, members: list[dict], monkey: ChaosMonkey | None) -> int:
    return cfg.learners + (monkey.launched if monkey is not None else 0) - len(members)


class Arrivals:
    first: float | None = None
    """time.monotonic() when the first SIGINT or SIGTERM arrived (None: none yet)."""
    raised: int = 0
    """KeyboardInterrupts the handler raised."""

    def raise_if_lost(self) -> None:
        """Raise the handler's KeyboardInterrupt again, for a caller that is still running
        although it was raised: Python runs a handler wherever its main thread is, and one
        raised inside a finalizer (``__del__``) or a callback Python calls is printed and
        dropped ("Exception ignored in ..."). Seen: a SIGTERM lost in a tokenizer's
        ``__del__``, and the run trained on to its time limit."""
        if self.raised:
            raise KeyboardInterrupt


@contextlib.contextmanager
def _interrupts():
    """SIGINT (Ctrl-C) and SIGTERM (``timeout``, ``kill``) stop a run alike: the final model
    is exported and every process stopped. One handler for both raises KeyboardInterrupt
    (or hands over to the handler it replaced, when that is Python's: ``diloco compare``'s,
    which records the signal). When the first arrived is noted as it arrives: Python runs a
    handler only once its main thread is back in Python code, so a thread woken by the
    signal's wakeup byte notes it (the handler, in case it comes first). Off the main
    thread, where Python installs no handler, nothing is noted. Every process of the run
    also watches this one (``--exit-with-parent``), so a SIGKILL here leaves nothing
    running either."""
    import threading

    arrived = Arrivals()
    if threading.current_thread() is not threading.main_thread():
        yield arrived
        return
    previous: dict[int, object] = {}

    def interrupt(signum, frame):
        arrived.first = arrived.first or time.monotonic()
        handler = previous.get(signum)
        if callable(handler):
            handler(signum, frame)
        arrived.raised += 1
        raise KeyboardInterrupt

    def note(wakeups: int) -> None:
        try:
            while os.read(wakeups, 64):  # one byte per signal, until the write end closes
                arrived.first = arrived.first or time.monotonic()
        finally:
            os.close(wakeups)

    wakeups, wakeup = os.pipe()
    os.set_blocking(wakeup, False)
    threading.Thread(target=note, args=(wakeups,), name="diloco-signal-arrivals", daemon=True).start()
    previous_wakeup = signal.set_wakeup_fd(wakeup, warn_on_full_buffer=False)
    for signum in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(signum) is not signal.SIG_IGN:  # (a SIGINT ignored, as in a background job, stays so)
            previous[signum] = signal.signal(signum, interrupt)
    try:
        yield arrived
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        signal.set_wakeup_fd(previous_wakeup)
        os.close(wakeup)  # the thread then reads the end and closes its own


def _link_learner_logs(run_dir: Path, members: list[dict]) -> None:
    """logs/<learner id>.log for each learner that joined: a link to the log its launcher
    writes by launch id (the id is known only once it joins)."""
    for member in members:
        link = run_dir / "logs" / f"{member['id']}.log"
        if member["launch_id"] and not link.is_symlink():
            with contextlib.suppress(FileExistsError):
                link.symlink_to(Path("..") / "coordinator" / "learners" / f"{member['launch_id']}.log")


def _snapshot_for_resume(admin, run_dir: Path, say: Callable[[str], None]) -> int | None:
    """A snapshot of the interrupted run, taken once its learners stopped and before the
    shards do (within 60 s; a second Ctrl-C gives up on it): ``diloco local --resume
    RUN_DIR`` continues from it, with every step the learners trained."""
    say("taking a snapshot to resume from")
    try:
        snapshot_id, state = take_snapshot(admin)
        if state == "complete":
            say(f"snapshot {snapshot_id} taken: `diloco local --resume {run_dir}` continues the run")
            return snapshot_id
        say(f"snapshot {snapshot_id} {state}; --resume would start from an earlier one, if any")
    except KeyboardInterrupt:
        say("snapshot abandoned (interrupted again)")
    except DilocoError as error:
        say(f"no snapshot to resume from: {error}")
    return None


def _check_devices(cfg: LocalConfig) -> None:
    """A learner device this machine cannot give fails the run before anything starts."""
    devices = {device for _, device in cfg.learner_devices}
    if "xla" in devices and importlib.util.find_spec("torch_xla") is None:
        raise FailedPrecondition(
            "--learner-device ...:xla: torch-xla is not installed here. It pins its own torch, so it goes in a venv of "
            "its own: pip install -c constraints-xla.txt -e '.[xla]' (on a CPU also set PJRT_DEVICE=CPU CPU_NUM_DEVICES=4)"
        )
    if "cuda" in devices and not torch.cuda.is_available():
        raise FailedPrecondition("--learner-device ...:cuda: torch sees no CUDA device here (torch.cuda.is_available() is False)")
