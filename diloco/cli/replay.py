"""``diloco replay RUN_DIR``: re-run every shard's recorded rounds in one process and
compare the result with the run's final global model.

What is replayed: each shard's life since its last start (a restarted shard appends a
new ``start`` record, then a ``restore`` one when it came back from a snapshot). The
tape says which pushes made each round (participants, their exact weights, the close
reason, share of the live learners); the push log holds those pushes' int4 payloads. Each round is rebuilt in a
fresh ``ShardCore`` with the same configuration and run through the same
``compute_round`` the shard ran, in tape order. The learners are not re-run: the tape and
push log are the complete input of the global model, which is what replay checks.

Each fragment starts from the values it was initialised with (``initial-F<f>.npz`` in the
shard's data directory, written when the first learner offered them, and recorded on the
tape), planned from the run's manifest (``manifest.json`` there).

The comparison point is the version of each fragment that ``diloco local`` exported into
``model.safetensors`` (``summary.json``'s ``final_versions``); the shards may close a
last round on shutdown after that. Parameters a model holds in bf16 or fp16 are exported
rounded, so only an fp32 model can match bit for bit.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from diloco.config import RunConfig
from diloco.errors import FailedPrecondition, InvalidArgument, NotFound
from diloco.manifest import Manifest
from diloco.tape import read_tape

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardReplay:
    shard_id: int
    rounds: int
    restored_from: int | None
    """The snapshot the shard's last life started from, if any."""
    max_abs_diff: float
    fragments: dict[int, int]
    """Fragment -> the version compared."""


def _syncer_config(raw: dict):
    from diloco.syncer.config import MergeConfig, RoundConfig, SyncerConfig

    return SyncerConfig(**{**raw, "rounds": RoundConfig(**raw["rounds"]), "merge": MergeConfig(**raw["merge"])})


def _last_life(records: list[dict], tape: Path) -> list[dict]:
    starts = [i for i, r in enumerate(records) if r["kind"] == "start"]
    if not starts:
        raise InvalidArgument(f"tape {tape} has no start record")
    life = records[starts[-1]:]
    if "config" not in life[0]:
        raise InvalidArgument(f"tape {tape} predates replay support (its start record has no config)")
    return life


def replay_shard(run: RunConfig, tape: Path, push_log: Path, snapshot_dir: str | Path | None,
                 final: dict[str, torch.Tensor], final_versions: dict[int, int], secret: str | None = None) -> ShardReplay:
    """``secret``: the run's, which verifies the snapshot the shard's last life restored from
    (None: the life must not have restored from one)."""
    life = _last_life(list(read_tape(tape)), tape)
    shard = _Replayer(run, tape, push_log, snapshot_dir, final_versions, secret, life[0]["config"])
    for record in life[1:]:
        shard.play(record)
    return shard.result(final)


class _Replayer:
    """One shard's last life rebuilt record by record: a fresh ``ShardCore`` planned from the
    run's manifest, each fragment's initial values or the snapshot it restored from, the
    recorded pushes (from the push log) and each round through ``compute_round`` with the
    tape's weights, clips, gates and momentum step."""

    def __init__(self, run: RunConfig, tape: Path, push_log: Path, snapshot_dir: str | Path | None,
                 final_versions: dict[int, int], secret: str | None, config: dict) -> None:
        from diloco.syncer.core.shard import ShardCore
        from diloco.syncer.pushlog import read_push_log
        from diloco.syncer.runtime import MANIFEST_FILE

        self.tape, self.push_log, self.snapshot_dir, self.secret = tape, push_log, snapshot_dir, secret
        self.final_versions = final_versions
        self.cfg = _syncer_config(config)
        self.data_dir = tape.parent
        if not (self.data_dir / MANIFEST_FILE).is_file():
            raise NotFound(f"no {MANIFEST_FILE} in {self.data_dir}: shard {self.cfg.shard_id} never got a model")
        manifest_json = (self.data_dir / MANIFEST_FILE).read_text()
        self.plan = Manifest.from_json(manifest_json).plan(run.fragments)
        self.core = ShardCore(self.cfg)
        self.core.adopt_plan(self.plan, manifest_json)
        self.logged = {(m.learner_id, m.fragment, m.seq): (m, p, w) for m, p, w in read_push_log(push_log)}
        self.targeted: dict[tuple[str, int, int], tuple] = {}
        self.restored_from: int | None = None
        self.compared: dict[int, list[torch.Tensor]] = {}
        self.rounds = 0
        for fragment_id in self.core.fragments:
            self._capture(fragment_id)

    def _capture(self, fragment_id: int) -> None:
        """Keep the fragment's parameters if it is at the version the run exported."""
        state = self.core.fragments[fragment_id]
        if self.final_versions.get(fragment_id) == state.version:
            self.compared[fragment_id] = [torch.from_numpy(t.copy()) for t in state.params]

    def play(self, r: dict) -> None:
        from diloco.syncer.core.shard import DUPLICATE

        if r["kind"] == "initialize":
            self._initialize(r)
        elif r["kind"] == "restore":
            self._restore(r)
        elif r["kind"] == "round_failed":
            raise FailedPrecondition(
                f"tape {self.tape}: round {r['fragment']}@{r['version']} failed in the run ({r['error']}); a failed "
                "step may have left part of its update, which replay cannot reproduce"
            )
        elif r["kind"] == "push" and r["outcome"] != DUPLICATE:
            key = (r["learner"], r["fragment"], r["clock"][r["learner"]])
            if key not in self.logged:
                raise FailedPrecondition(f"push log {self.push_log} lacks the push {key} that the tape records")
            self.targeted[(r["learner"], r["fragment"], r["target_version"])] = self.logged[key]
        elif r["kind"] == "round":
            self._round(r)

    def _initialize(self, r: dict) -> None:
        from diloco.syncer import snapshot as snapshot_files
        from diloco.syncer.runtime import initial_name

        initial = snapshot_files.loads(self.data_dir / initial_name(r["fragment"]))
        # A shard that came back without its state started from an anchor, at its version.
        self.core.add_fragment(r["fragment"], initial["pieces"], r.get("version", 0))
        self._capture(r["fragment"])

    def _restore(self, r: dict) -> None:
        from diloco.syncer import snapshot as snapshot_files
        from diloco.syncer.core import snapshot

        if not self.secret:
            raise NotFound(f"shard {self.cfg.shard_id} restored from snapshot {r['snapshot']}: replay needs the run's "
                           "secret to verify it")
        snapshot_id, state, channel = snapshot_files.load_for_restore(str(r["snapshot"]), self.snapshot_dir,
                                                                      self.cfg.shard_id, self.secret)
        snapshot.restore(self.core, state, 0.0)
        for meta, payload, wire_bytes in channel:
            self.core.accept(meta, payload, wire_bytes, 0.0)
        self.restored_from = snapshot_id
        self.compared.clear()
        for fragment_id in self.core.fragments:
            self._capture(fragment_id)

    def _round(self, r: dict) -> None:
        from diloco.syncer.core.outer import MomentumStep
        from diloco.syncer.core.rounds import Close
        from diloco.syncer.core.shard import Pending, compute_round

        state = self.core.fragments[r["fragment"]]
        opened = {}
        for learner in r["participants"]:
            push = self.targeted.get((learner, r["fragment"], r["version"]))
            if push is not None:
                opened[learner] = Pending(push[0], push[1], 0.0, push[2])
            elif learner in state.open:  # restored with the snapshot
                opened[learner] = state.open[learner]
            else:
                raise FailedPrecondition(f"tape {self.tape}: round {r['fragment']}@{r['version']} merged a push from "
                                         f"{learner} that was never recorded")
        state.open, state.next = opened, {}
        job = self.core.begin_round(r["fragment"], Close(r["reason"], r["grace_s"]), 0.0)
        if job.version != r["version"]:
            raise FailedPrecondition(f"tape {self.tape}: fragment {r['fragment']} is at {job.version - 1}, the tape "
                                     f"closes {r['version']}")
        job = replace(job, weights=tuple(r["weights"]), participation=r.get("participation", 1.0),
                      clip=tuple(r.get("clip", ())), gate=tuple(r.get("gate", ())), trust=tuple(r.get("trust", ())),
                      outer=MomentumStep(*r["outer"]) if "outer" in r else None)
        self.core.finish_round(job, compute_round(job, self.cfg), 0.0)
        self.rounds += 1
        self._capture(r["fragment"])

    def result(self, final: dict[str, torch.Tensor]) -> ShardReplay:
        """The largest difference from the run's final model over the fragments compared."""
        missing = sorted(set(self.final_versions) & set(self.core.fragments) - set(self.compared))
        if missing:
            raise FailedPrecondition(
                f"shard {self.cfg.shard_id}: the replay never reached the final version of fragments {missing} "
                f"({ {f: self.final_versions[f] for f in missing} })"
            )
        diff = 0.0
        for fragment_id, params in self.compared.items():
            for mine, theirs in zip(params, self.plan.gather(fragment_id, final)):
                diff = max(diff, float((mine - theirs.reshape(mine.shape)).abs().max()))
        return ShardReplay(self.cfg.shard_id, self.rounds, self.restored_from, diff,
                           {f: self.final_versions[f] for f in sorted(self.compared)})


def _run_secret(run_dir: Path, tapes: list[Path]) -> str | None:
    """The run secret, which authenticates the snapshots that restarted shards came back
    from; a run whose shards never restored from one has nothing to verify. Never an empty
    key: a manifest signed with it would pass."""
    restored = [tape for tape in tapes if any(r["kind"] == "restore" for r in _last_life(list(read_tape(tape)), tape))]
    path = run_dir / "secret"
    secret = path.read_text().strip() if path.is_file() else ""
    if restored and not secret:
        raise NotFound(f"{path} is missing or empty: {', '.join(t.parent.name for t in restored)} restored from a "
                       "snapshot, which only the run's secret can verify")
    return secret or None


def replay(run_dir: Path, snapshot_dir: str | Path | None = None) -> list[ShardReplay]:
    run_dir = Path(run_dir)
    for name in ("run.json", "model.safetensors", "summary.json"):
        if not (run_dir / name).is_file():
            raise NotFound(f"{run_dir} is not a finished diloco local run directory: no {name}")
    run = RunConfig.from_json((run_dir / "run.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    if "final_versions" not in summary:
        raise InvalidArgument(f"{run_dir / 'summary.json'} has no final_versions (written by an older diloco)")
    final_versions = {int(f): int(v) for f, v in summary["final_versions"].items()}
    tapes = sorted(run_dir.glob("shard*/tape-S*.jsonl"))
    if not tapes:
        raise NotFound(f"no shard tapes under {run_dir}")
    secret = _run_secret(run_dir, tapes)
    from safetensors.torch import load_file

    final = {k: v.float() for k, v in load_file(str(run_dir / "model.safetensors")).items()}
    results = []
    for tape in tapes:
        shard_id = int(tape.stem.rsplit("S", 1)[1])
        push_log = tape.parent / f"pushes-S{shard_id}.log"
        if not push_log.is_file():
            raise NotFound(f"no push log {push_log}: the shard ran without --push-log")
        results.append(replay_shard(run, tape, push_log, snapshot_dir or run_dir / "coordinator" / "snapshots",
                                    final, final_versions, secret))
    return results
