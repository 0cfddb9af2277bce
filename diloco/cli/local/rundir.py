"""A local run's directory: new (or empty) for a new run, its own run's for a resume, and
held by one supervisor at a time (``supervisor.lock``)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import asdict, replace
from pathlib import Path

from diloco import auth
from diloco.config import RunConfig
from diloco.errors import AlreadyExists, DilocoError, FailedPrecondition, InvalidArgument, NotFound
from diloco.files import PRIVATE_DIR, atomic_write, check_makeable, private_dir
from diloco.snapshots import snapshot_ids
from diloco.cli.local.config import LocalConfig


def check_dir_flag(flag: str, directory: Path) -> None:
    """The directory ``flag`` names can be made (or is there) and written, or one line
    saying why not in the OS's words; nothing is left behind."""
    try:
        check_makeable(directory)
    except OSError as error:
        where = f"{error.filename}: " if error.filename and str(error.filename) != str(directory) else ""
        raise InvalidArgument(f"{flag} {directory} cannot be used: {where}{error.strerror}") from None


def check_new_run_dir(run_dir: Path) -> None:
    """A run directory is new or empty, and can be made and written: never another run's
    (live or finished), whose secret, tapes and coordinator state a second run would mix
    with its own."""
    if run_dir.exists() and not run_dir.is_dir():
        raise InvalidArgument(f"--out {run_dir} is a file, not a directory")
    if not run_dir.exists() or not any(run_dir.iterdir()):
        check_dir_flag("--out", run_dir)
        return
    live = []
    with contextlib.suppress(OSError, ValueError):
        for entry in json.loads((run_dir / "endpoints.json").read_text()):
            with contextlib.suppress(ProcessLookupError, PermissionError, KeyError, TypeError):
                os.kill(int(entry["pid"]), 0)
                live.append(f"{entry['role']} pid {entry['pid']}")
    if live:
        what = f"a live run ({', '.join(live)})"
    elif (run_dir / "summary.json").exists():
        what = "a finished run (summary.json)"
    elif (run_dir / "config.json").exists():
        what = "a run that stopped before it finished (config.json, no summary.json)"
    else:
        what = "files"
    raise AlreadyExists(f"--out {run_dir} already holds {what}; a run never reuses another's directory: "
                        "give a new or empty --out (or remove that one)")


def undo_new_run(run_dir: Path, made: list[Path], mode: int) -> None:
    """Remove what a new run wrote before any of its processes started: the directories
    it ``made`` (deepest first: the topmost goes, with all in it); or, when the user gave
    an empty directory, what is in it, and its ``mode`` back."""
    if made:
        shutil.rmtree(made[-1], ignore_errors=True)
        return
    for entry in run_dir.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        os.chmod(run_dir, mode)


def lock(run_dir: Path):
    """Hold RUN_DIR/supervisor.lock for this run: a second supervisor (a resume while this
    one lives) is refused. The lock goes with the process, however it ends."""
    import fcntl

    handle = open(run_dir / "supervisor.lock", "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "?"
        handle.close()
        raise AlreadyExists(f"{run_dir} is in use by a live diloco local (pid {holder})") from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


def start_new_run(run_dir: Path, cfg: LocalConfig, learner_steps: int):
    """Make the new run's directory (private: it holds the run's secret) and write what
    every process reads: the secret, ``run.json`` and ``config.json``. Returns the held lock."""
    os.chmod(private_dir(run_dir), PRIVATE_DIR)  # also an empty directory given as --out
    held = lock(run_dir)
    private_dir(run_dir / "learners")
    atomic_write(run_dir / "secret", auth.new_secret())
    atomic_write(run_dir / "run.json", cfg.run.to_json())
    resolved = {**asdict(cfg), "out": str(run_dir), "run": json.loads(cfg.run.to_json()), "learner_steps": learner_steps}
    atomic_write(run_dir / "config.json", json.dumps(resolved, indent=1, default=str))
    return held


# What defines a run, kept from its config.json when it is resumed (the rest, such as the
# number of learners, the chaos and the snapshot schedule, may differ from one part to the next).
RUN_DEFINING = ("shards", "quorum", "grace", "steps", "tokens", "lr", "inner_optimizer", "outer_lr", "outer_momentum", "outer_optimizer", "merge", "scale_by",
                "downlink", "reply_codec", "reply_density", "delta_codec", "delta_density", "error_feedback", "block_size",
                "tls", "snapshot_dir")
# Kept from it unless given again.
RUN_ADJUSTABLE = ("learners", "learner_threads", "snapshot_every_s", "snapshot_keep", "fork_server")


def resume_config(run_dir: Path, given: LocalConfig, default: LocalConfig) -> LocalConfig:
    """The configuration that continues the stopped run in ``run_dir``: its stored run
    config and run-defining settings; whatever ``given`` sets away from ``default`` must
    agree with them (FailedPrecondition naming every key that does not)."""
    try:
        stored = json.loads((run_dir / "config.json").read_text())
        stored_run = RunConfig.from_json((run_dir / "run.json").read_text())
    except FileNotFoundError:
        raise NotFound(f"--resume {run_dir}: no run there (no config.json and run.json)") from None
    except (OSError, ValueError, DilocoError) as error:
        raise InvalidArgument(f"--resume {run_dir}: its config cannot be read: {error}") from None
    conflicts = []
    given_run, default_run, kept_run = (json.loads(r.to_json()) for r in (given.run, default.run, stored_run))
    for key, value in given_run.items():
        if value != default_run.get(key) and value != kept_run.get(key):
            conflicts.append(f"{key} {value!r} (the run has {kept_run.get(key)!r})")
    kept = {}
    for key in RUN_DEFINING:
        value, kept[key] = getattr(given, key), stored.get(key, getattr(default, key))
        if value != getattr(default, key) and value != kept[key]:
            conflicts.append(f"{key} {value!r} (the run has {kept[key]!r})")
    if conflicts:
        raise FailedPrecondition(f"--resume {run_dir} continues the run with its own config; these differ: "
                                 f"{'; '.join(conflicts)}. Start a new run (--out) to change them")
    for key in RUN_ADJUSTABLE:
        if getattr(given, key) == getattr(default, key) and key in stored:
            kept[key] = stored[key]
    return replace(given, run=stored_run, out=run_dir, resume=True, **kept)


def resumable(run_dir: Path, snapshot_dir: str) -> int:
    """The snapshot a stopped run resumes from (its newest complete one)."""
    summary = run_dir / "summary.json"
    if summary.exists() and not json.loads(summary.read_text()).get("interrupted", True):
        raise FailedPrecondition(f"--resume {run_dir}: that run finished (summary.json); nothing to continue")
    complete = [i for i, done in snapshot_ids(snapshot_dir).items() if done]
    if not complete:
        raise FailedPrecondition(f"--resume {run_dir}: no complete snapshot in {snapshot_dir} to resume from (a run "
                                 "takes one when stopped with Ctrl-C or SIGTERM; --snapshot-every-s S also covers crashes)")
    return max(complete)


def steps_left(run_dir: Path) -> list[int]:
    """The inner steps each learner of the stopped part had left, one entry per learner the
    stop interrupted (launched at the start, added by ``diloco admin add-learners``, a
    chaos replacement alike): its planned steps (``learners/<id>.json``'s
    ``planned_steps``) less those it trained. Empty when the part recorded neither (a run
    stopped before this was kept): the caller falls back to the run's plan."""
    try:
        learners = json.loads((run_dir / "summary.json").read_text()).get("learners", [])
    except (OSError, ValueError):
        return []
    left = []
    for learner in learners:
        if learner.get("state") != "interrupted":
            continue
        try:
            own = json.loads((run_dir / "learners" / f"{learner['id']}.json").read_text())
        except (OSError, ValueError, KeyError):
            return []
        if own.get("planned_steps") is None:
            return []
        left.append(max(int(own["planned_steps"]) - int(own["inner_steps"]), 0))
    return [n for n in left if n > 0]


def stored_learners(run_dir: Path) -> int | None:
    """The learner count the stopped run's config.json holds."""
    with contextlib.suppress(OSError, ValueError, KeyError):
        return int(json.loads((run_dir / "config.json").read_text())["learners"])
    return None


def most_steps_done(run_dir: Path) -> int:
    """Inner steps the stopped run's learners got to: the most any one reached (a run whose
    learners recorded no plan: ``steps_left``)."""
    learners = []
    with contextlib.suppress(OSError, ValueError):
        learners = json.loads((run_dir / "summary.json").read_text()).get("learners", [])
    return max((int(l.get("inner_steps", 0)) for l in learners), default=0)


def split_steps(left: list[int], learners: int) -> list[int]:
    """``left`` as ``learners`` learners would train it: each stopped learner's own steps
    when the count is the same, else the same total shared as evenly as whole steps go."""
    if len(left) == learners:
        return list(left)
    total = sum(left)
    return [total // learners + (1 if i < total % learners else 0) for i in range(learners)]
