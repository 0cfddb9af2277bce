"""``diloco simulate``: size a deployment before buying chips.

A discrete-event simulation of one training job under chip failures, for data-parallel
(with and without elasticity) and Decoupled DiLoCo with M learners; the defaults
reproduce the paper's goodput table (docs/simulate.md). ``engine`` is the pure
simulation, ``report`` the output formats; this module is the command's flags and glue.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

from diloco.config import RunConfig
from diloco.errors import InvalidArgument
from diloco.lab.simulate import report
from diloco.lab.simulate.engine import RECOVERY_KINDS, RecoveryDist, SimOptions, Table, simulate_table, validate_sweep

logger = logging.getLogger(__name__)

DEFAULT_CHIPS = "150000,300000,600000,1200000,2400000"
DEFAULT_LEARNERS = "2,4,8,16"
DEFAULT_CAPACITY_LEARNERS = "8,64,256"

_SUFFIX = {"k": 1_000, "m": 1_000_000, "g": 1_000_000_000}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``diloco simulate``; values are checked by ``run`` (InvalidArgument)."""
    d = SimOptions()
    r = d.recovery

    def flag(group, name: str, metavar: str, default: object, text: str) -> None:
        shown = f"{default:g}" if isinstance(default, float) else default
        group.add_argument(name, metavar=metavar, default=default, help=f"{text} (default {shown})")

    job = parser.add_argument_group("job")
    flag(job, "--chips", "LIST", DEFAULT_CHIPS, "comma-separated total chip counts of the job; k/M suffixes allowed")
    flag(job, "--learners", "LIST", DEFAULT_LEARNERS, "comma-separated learner counts M for Decoupled DiLoCo")
    flag(job, "--slice-chips", "N", d.slice_chips, "chips that one failure takes down, and that come back, together")
    flag(job, "--quorum", "K", d.quorum, "minimum running learners K for the global model to advance")
    fail = parser.add_argument_group("failures")
    flag(fail, "--mtbi-years", "YEARS", d.mtbi_years, "mean time between interruptions of one chip, years")
    flag(fail, "--recovery-dist", "KIND", r.kind,
         f"distribution of a failed slice's recovery time: {', '.join(RECOVERY_KINDS)}")
    flag(fail, "--recovery-scale-h", "HOURS", r.scale_h,
         "scale of the recovery time, hours: expweibull scale, exponential mean, fixed value")
    flag(fail, "--recovery-shape", "K", r.shape, "Weibull shape k of expweibull; k < 1 is heavy-tailed")
    flag(fail, "--recovery-exponent", "ALPHA", r.exponent,
         "exponent alpha of expweibull, whose CDF is (1 - exp(-(t/scale)^k))^alpha")
    flag(fail, "--speed-cv", "CV", d.speed_cv,
         "coefficient of variation of per-chip speed; a synchronous group runs at its slowest chip")
    cost = parser.add_argument_group("recovery costs")
    flag(cost, "--resize-s", "SECONDS", d.resize_s, "seconds an elastic island stalls after a slice fails or returns")
    flag(cost, "--catchup-s", "SECONDS", d.catchup_s,
         "extra seconds a decoupled learner stalls after a resize to fetch the global fragments it missed")
    flag(cost, "--restart-s", "SECONDS", d.restart_s,
         "seconds a non-elastic DP job needs to restart from its checkpoint")
    flag(cost, "--checkpoint-interval-s", "SECONDS", d.checkpoint_interval_s,
         "seconds of DP work between checkpoints; a failure loses the work since the last one; 0: every step")
    sim = parser.add_argument_group("simulation")
    flag(sim, "--horizon-days", "DAYS", d.horizon_days, "simulated wall-clock days per trial")
    flag(sim, "--trials", "N", d.trials, "independent trials averaged per cell")
    flag(sim, "--seed", "N", d.seed, "random seed; same seed, same output")
    cap = parser.add_argument_group(
        "capacity", "with --capacity: the shards a deployment needs and each one's RAM, cores and bandwidth, from "
                    "this implementation's measured costs (docs/results/scale/); --learners gives the learner counts "
                    f"to size for (default {DEFAULT_CAPACITY_LEARNERS})")
    cap.add_argument("--capacity", action="store_true", help="size the shards instead of simulating failures")
    flag(cap, "--params", "N", "1G", "the model's parameters; k/M/G suffixes allowed")
    flag(cap, "--sync-every", "H", RunConfig.sync_every_steps, "inner steps between two pushes of a fragment")
    flag(cap, "--step-s", "SECONDS", 1.0, "a learner's inner step time")
    flag(cap, "--link-mbit", "MBIT", 10000.0, "each shard's link, Mbit/s each way")
    flag(cap, "--utilization", "U", 0.5, "the share of a core and of a link each shard may use")
    cap.add_argument("--fit", metavar="JSONL", nargs="+",
                     help="size with costs fitted to these `diloco bench load --json` outputs (your machine's) "
                          "instead of the built-in ones, and print the fitted costs")
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true",
                     help="print one JSON object {goodput, uptime} (percent) and nothing else on stdout")
    out.add_argument("--out", metavar="DIR", default=None,
                     help="also write simulate.json, simulate.md and simulate.png into DIR")


def run(args: argparse.Namespace) -> int:
    """Simulate the table, print it (rich, or JSON with --json), write files with --out."""
    if args.capacity:
        return _capacity(args)
    chips = parse_counts(args.chips, "--chips")
    learners = parse_counts(args.learners, "--learners")
    options = options_from_args(args)
    validate_sweep(chips, learners, options)
    out_dir = _out_dir(args.out)

    from rich.console import Console

    err = Console(stderr=True)
    cells = len(chips) * (2 + len(learners))
    done = 0
    started = time.perf_counter()
    with err.status("simulating") as status:
        def on_cell(name: str) -> None:
            nonlocal done
            done += 1
            status.update(f"simulating {name} ({done}/{cells})")

        table = simulate_table(chips, learners, options, on_cell)
    elapsed_s = time.perf_counter() - started
    logger.info("simulated %d cells in %.1f s", cells, elapsed_s)

    if args.json:
        sys.stdout.write(json.dumps(report.to_json(table)) + "\n")
    else:
        console = Console()
        for t in report.rich_tables(table):
            console.print(t)
        for e in report.published_errors(table) if options.is_paper_setup() else []:
            name = e["system"] if e["learners"] is None else f"decoupled M={e['learners']}"
            console.print(f"paper {name} {report.chips_label(e['chips'])}: {e['published']}%, "
                          f"simulated {e['simulated']:.1f}% ({e['error']:+.1f})")
    err.print(f"simulated {cells} cells in {elapsed_s:.1f} s")
    if out_dir is not None:
        write_outputs(out_dir, table, options, elapsed_s)
        err.print(f"wrote {out_dir / 'simulate.json'}, simulate.md, simulate.png")
    return 0


def _capacity(args: argparse.Namespace) -> int:
    from diloco.lab.simulate import capacity

    learners = parse_counts(DEFAULT_CAPACITY_LEARNERS if args.learners == DEFAULT_LEARNERS else args.learners,
                            "--learners")
    params = parse_counts(args.params, "--params")
    if len(params) != 1:
        raise InvalidArgument(f"--params: one parameter count, got {args.params!r}")
    params = params[0]
    costs = capacity.COSTS if not args.fit else capacity.fit(capacity.fit_rows(_bench_rows(args.fit)))
    rows = [capacity.plan(params, n, _integer(args.sync_every, "--sync-every"), _number(args.step_s, "--step-s"),
                          _number(args.link_mbit, "--link-mbit"), _number(args.utilization, "--utilization"), costs)
            for n in learners]
    if args.json:
        sys.stdout.write(json.dumps(rows) + "\n")
        return 0
    from rich.console import Console

    console = Console()
    console.print(report.capacity_table(rows))
    if args.fit:
        console.print("costs fitted to " + ", ".join(args.fit) + ": " + json.dumps(asdict(costs)))
    return 0


def _bench_rows(paths: list[str]) -> list[dict]:
    """The configurations in ``diloco bench load --json`` outputs (one JSON object a line)."""
    rows = []
    for path in paths:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as error:
            raise InvalidArgument(f"--fit {path}: {error.strerror}") from None
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                raise InvalidArgument(f"--fit {path}:{number}: not a JSON object (expected bench load --json output)") from None
            if not isinstance(row, dict) or not {"learners", "params", "shards", "rss_bytes"} <= row.keys():
                raise InvalidArgument(f"--fit {path}:{number}: not a bench load configuration")
            rows.append(row)
    return rows


def write_outputs(out_dir: Path, table: Table, options: SimOptions, elapsed_s: float) -> None:
    """simulate.json (table, options, published errors), simulate.md, simulate.png."""
    out_dir.mkdir(parents=True, exist_ok=True)
    options_dict = asdict(options)
    payload = {
        **report.to_json(table),
        "options": options_dict,
        "chips": list(table.chips),
        "learners": list(table.learners),
        "published": report.published_errors(table) if options.is_paper_setup() else [],
        "elapsed_s": round(elapsed_s, 2),
    }
    (out_dir / "simulate.json").write_text(json.dumps(payload, indent=2) + "\n")
    paper = options.is_paper_setup()
    (out_dir / "simulate.md").write_text(report.markdown(table, json.dumps(options_dict, indent=2), paper))
    report.plot(table, out_dir / "simulate.png", paper)


def parse_counts(text: object, flag: str) -> list[int]:
    """``"150k,1.2M,2400000"`` -> ``[150000, 1200000, 2400000]``; InvalidArgument otherwise."""
    values = []
    for item in str(text).split(","):
        item = item.strip()
        if not item:
            raise InvalidArgument(f"{flag}: empty value in {text!r}")
        scale = _SUFFIX.get(item[-1].lower(), 1)
        number = item[:-1] if scale != 1 else item
        try:
            value = float(number) * scale
        except ValueError:
            raise InvalidArgument(f"{flag}: {item!r} is not a number (e.g. 150000, 150k, 1.2M)") from None
        if not math.isfinite(value) or value != int(value) or value < 1:
            raise InvalidArgument(f"{flag}: {item!r} must be a positive whole number")
        values.append(int(value))
    if len(set(values)) != len(values):
        raise InvalidArgument(f"{flag}: duplicate values in {text!r}")
    return values


def options_from_args(args: argparse.Namespace) -> SimOptions:
    """SimOptions from the parsed flags; InvalidArgument for anything malformed."""
    recovery = RecoveryDist(
        kind=str(args.recovery_dist),
        scale_h=_number(args.recovery_scale_h, "--recovery-scale-h"),
        shape=_number(args.recovery_shape, "--recovery-shape"),
        exponent=_number(args.recovery_exponent, "--recovery-exponent"),
    )
    return SimOptions(
        mtbi_years=_number(args.mtbi_years, "--mtbi-years"),
        slice_chips=_integer(args.slice_chips, "--slice-chips"),
        recovery=recovery,
        resize_s=_number(args.resize_s, "--resize-s"),
        catchup_s=_number(args.catchup_s, "--catchup-s"),
        restart_s=_number(args.restart_s, "--restart-s"),
        checkpoint_interval_s=_number(args.checkpoint_interval_s, "--checkpoint-interval-s"),
        speed_cv=_number(args.speed_cv, "--speed-cv"),
        quorum=_integer(args.quorum, "--quorum"),
        horizon_days=_number(args.horizon_days, "--horizon-days"),
        trials=_integer(args.trials, "--trials"),
        seed=_integer(args.seed, "--seed"),
    )


def _number(value: object, flag: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise InvalidArgument(f"{flag}: {value!r} is not a number") from None
    if not math.isfinite(number):
        raise InvalidArgument(f"{flag}: {value!r} is not a finite number")
    return number


def _integer(value: object, flag: str) -> int:
    number = _number(value, flag)
    if number != int(number):
        raise InvalidArgument(f"{flag}: {value!r} is not a whole number")
    return int(number)


def _out_dir(value: object) -> Path | None:
    if value is None:
        return None
    path = Path(str(value))
    if path.exists() and not path.is_dir():
        raise InvalidArgument(f"--out: {path} exists and is not a directory")
    return path
