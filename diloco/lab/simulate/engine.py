"""The chaos simulator's engine: pure numpy, no I/O, no clock, no globals.

A job of N chips is cut into slices; a chip failure takes its whole slice down for a
sampled recovery time. Three systems run on the same failure model:

- ``dp``: data-parallel without elasticity. Any failure stops every chip; the job restarts
  (``restart_s``, spare slices swapped in) from its last checkpoint.
- ``elastic_dp``: one elastic island. Every membership change (a slice fails, a slice
  comes back) stalls the island for ``resize_s``; meanwhile the chips of down slices stay
  allocated but do no work.
- ``decoupled``: M elastic islands (learners) of N/M chips each. A learner additionally
  pays ``catchup_s`` after each resize to fetch the global fragments it missed. The
  global model advances while at least ``quorum`` learners are running.

The timeline of one island is computed exactly from its outage times (a sweep over
sorted breakpoints), so tiny cases have exact answers; at scale the same code runs
vectorised over hundreds of thousands of events. See docs/simulate.md for the
calibration against the paper's table.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from statistics import NormalDist

import numpy as np

from diloco.errors import InvalidArgument

SECONDS_PER_YEAR = 365.25 * 86400.0
SECONDS_PER_HOUR = 3600.0
SECONDS_PER_DAY = 86400.0

RECOVERY_KINDS = ("expweibull", "exponential", "fixed")

# Beyond this a cell's sweep arrays pass ~1 GB (about 200 bytes per event).
MAX_EVENTS_PER_CELL = 4_000_000

# Seed-stream tags, so that a cell's draws do not depend on which other cells run.
_DP, _ELASTIC, _DECOUPLED = 1, 2, 3


# --------------------------------------------------------------------------- options


@dataclass(frozen=True)
class RecoveryDist:
    """How long a failed slice stays down before it can rejoin.

    ``expweibull``: CDF ``(1 - exp(-(t/scale)^shape))^exponent`` (the family the paper
    used); ``exponential``: mean ``scale_h``; ``fixed``: always ``scale_h``.
    """

    kind: str = "expweibull"
    """One of RECOVERY_KINDS."""
    scale_h: float = 0.7
    """Scale of the distribution, hours (the mean for ``exponential``, the value for ``fixed``)."""
    shape: float = 0.7
    """Weibull shape k (``expweibull`` only); k < 1 gives a heavy tail."""
    exponent: float = 2.0
    """Exponentiation alpha (``expweibull`` only); alpha > 1 makes very short recoveries rare."""

    def __post_init__(self) -> None:
        if self.kind not in RECOVERY_KINDS:
            raise InvalidArgument(
                f"recovery distribution must be one of {', '.join(RECOVERY_KINDS)}, got {self.kind!r}"
            )
        _require(self.scale_h >= 0 and math.isfinite(self.scale_h), "--recovery-scale-h must be >= 0")
        _require(self.shape > 0 and math.isfinite(self.shape), "--recovery-shape must be > 0")
        _require(self.exponent > 0 and math.isfinite(self.exponent), "--recovery-exponent must be > 0")

    def sample_s(self, rng: np.random.Generator, size: int | tuple[int, ...]) -> np.ndarray:
        """Recovery times in seconds."""
        scale_s = self.scale_h * SECONDS_PER_HOUR
        if self.kind == "fixed":
            return np.full(size, scale_s)
        if self.kind == "exponential":
            return rng.exponential(scale_s, size)
        # Inverse CDF; log1p keeps the upper tail exact when u**(1/alpha) is close to 1.
        u = rng.random(size)
        return scale_s * (-np.log1p(-(u ** (1.0 / self.exponent)))) ** (1.0 / self.shape)

    def mean_s(self) -> float:
        """Mean recovery time in seconds."""
        scale_s = self.scale_h * SECONDS_PER_HOUR
        if self.kind in ("fixed", "exponential") or scale_s == 0:
            return scale_s
        return scale_s * _expweibull_unit_mean(self.shape, self.exponent)


@functools.lru_cache(maxsize=64)
def _expweibull_unit_mean(k: float, a: float) -> float:
    """Mean of the exponentiated Weibull with scale 1: the integral of its survival function."""
    # On a log grid: the integrand t * (1 - F(t)) is smooth in log t.
    log_x = np.linspace(-40.0, math.log(80.0 ** (1.0 / k)), 200_001)
    x = np.exp(log_x)
    y = np.maximum(x**k, 1e-300)
    # log F = a * log(1 - e^-y), each branch exact where the other loses digits.
    ln2 = math.log(2.0)
    log_cdf = a * np.where(
        y < ln2, np.log(-np.expm1(-np.minimum(y, ln2))), np.log1p(-np.exp(-np.maximum(y, ln2)))
    )
    survival = -np.expm1(log_cdf)
    return float(np.trapezoid(survival * x, log_x))


@dataclass(frozen=True)
class SimOptions:
    """Every knob of the simulation; defaults are the calibration of docs/simulate.md."""

    mtbi_years: float = 1.0
    """Mean time between interruptions of one chip, years (failures are Poisson per chip)."""
    slice_chips: int = 256
    """Chips that one failure takes down together (and that come back together)."""
    recovery: RecoveryDist = field(default_factory=RecoveryDist)
    """Time a failed slice stays down (elastic and decoupled; DP swaps in spares)."""
    resize_s: float = 9.0
    """Seconds an elastic island stalls to resize after a slice fails or comes back."""
    catchup_s: float = 1.6
    """Extra seconds a decoupled learner stalls after a resize to fetch the global fragments it missed."""
    restart_s: float = 66.0
    """Seconds a non-elastic DP job needs to restart from its checkpoint after a failure."""
    checkpoint_interval_s: float = 0.0
    """Seconds of DP work between checkpoints; a failure loses the work since the last one (0: every step)."""
    speed_cv: float = 0.0
    """Coefficient of variation of per-chip speed; a synchronous group runs at its slowest chip."""
    quorum: int = 1
    """Minimum number K of running learners for the global model to advance."""
    horizon_days: float = 30.0
    """Simulated wall-clock time per trial, days."""
    trials: int = 3
    """Independent trials averaged per cell."""
    seed: int = 0
    """Seed of the random streams; the output is a pure function of the options."""

    def __post_init__(self) -> None:
        _require(self.mtbi_years > 0 and math.isfinite(self.mtbi_years), "--mtbi-years must be > 0")
        _require(self.slice_chips >= 1, "--slice-chips must be >= 1")
        for name in ("resize_s", "catchup_s", "restart_s", "checkpoint_interval_s"):
            value = getattr(self, name)
            flag = "--" + name.replace("_", "-")
            _require(value >= 0 and math.isfinite(value), f"{flag} must be >= 0, got {value}")
        _require(0 <= self.speed_cv < 1, f"--speed-cv must be in [0, 1), got {self.speed_cv}")
        _require(self.quorum >= 1, f"--quorum must be >= 1, got {self.quorum}")
        _require(0 < self.horizon_days <= 3650, f"--horizon-days must be in (0, 3650], got {self.horizon_days}")
        _require(1 <= self.trials <= 1000, f"--trials must be in [1, 1000], got {self.trials}")
        _require(self.seed >= 0, f"--seed must be >= 0, got {self.seed}")

    def is_paper_setup(self) -> bool:
        """True when only seed, trials and horizon differ from the defaults (the paper's setup)."""
        return replace(self, seed=0, trials=1, horizon_days=1.0) == replace(
            SimOptions(), seed=0, trials=1, horizon_days=1.0
        )

    @property
    def mtbi_s(self) -> float:
        return self.mtbi_years * SECONDS_PER_YEAR

    @property
    def horizon_s(self) -> float:
        return self.horizon_days * SECONDS_PER_DAY


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidArgument(message)


# ------------------------------------------------------------------- event primitives


def absorbed_starts(event_s: np.ndarray, hold_s: float) -> np.ndarray:
    """Indices of the events that start a hold of ``hold_s``, in order.

    The first event starts a hold ``[t, t + hold_s)``; events inside it are absorbed
    (a resize or restart re-plans on the membership at its end, so changes during it
    cost nothing extra); the first event at or after its end starts the next hold.

    The chain ``next[i] = first event >= t_i + hold_s`` is followed from event 0 by
    pointer doubling: O(E log E) vectorised work instead of a Python loop per hold.
    """
    n = len(event_s)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if hold_s <= 0:
        return np.arange(n, dtype=np.int64)
    nxt = np.searchsorted(event_s, event_s + hold_s, side="left")
    nxt = np.maximum(nxt, np.arange(1, n + 1))  # t + hold == t in floating point
    jump = np.append(nxt, n)  # n is the sentinel "past the end", a fixed point
    path = np.zeros(1, dtype=np.int64)  # path[j] = the j-th hold start, j < 2**level
    while True:
        ahead = jump[path]
        ahead = ahead[ahead < n]
        if len(ahead) == 0:
            return path
        path = np.concatenate([path, ahead])
        jump = jump[jump]


@dataclass(frozen=True)
class Outages:
    """Slice outages of one island: slice ``i`` is down on ``[fail_s[i], recover_s[i])``."""

    fail_s: np.ndarray
    recover_s: np.ndarray

    @staticmethod
    def of(pairs: Iterable[tuple[float, float]]) -> Outages:
        """From explicit (fail, recover) pairs (tests, replays); sorted by failure time."""
        arr = np.asarray(sorted(pairs), dtype=float).reshape(-1, 2)
        return Outages(arr[:, 0].copy(), arr[:, 1].copy())


@dataclass(frozen=True)
class Timeline:
    """Step functions of one island, constant on ``[time_s[i], time_s[i+1])``.

    ``running``: the island computes (not resizing, at least one slice up);
    ``rate_chips``: chips doing useful work (0 while not running).
    """

    time_s: np.ndarray
    running: np.ndarray
    rate_chips: np.ndarray
    horizon_s: float

    def durations_s(self) -> np.ndarray:
        return np.diff(np.append(self.time_s, self.horizon_s))

    def useful_chip_s(self) -> float:
        return float(np.dot(self.rate_chips, self.durations_s()))

    def running_s(self) -> float:
        return float(np.dot(self.running, self.durations_s()))


def island_timeline(
    outages: Outages, n_slices: int, chips_per_slice: float, hold_s: float, horizon_s: float
) -> Timeline:
    """The exact timeline of one elastic island on ``[0, horizon_s)``.

    Every failure and every recovery before the horizon is a membership change; the
    island stalls ``hold_s`` for each one it is not already stalled for (see
    ``absorbed_starts``). Slices are all up at time 0.
    """
    fail = outages.fail_s[outages.fail_s < horizon_s]
    recover = outages.recover_s[outages.fail_s < horizon_s]
    recover = recover[recover < horizon_s]
    changes = np.sort(np.concatenate([fail, recover]))
    stall_start = changes[absorbed_starts(changes, hold_s)]
    stall_end = np.minimum(stall_start + hold_s, horizon_s)

    time = np.concatenate([[0.0], fail, recover, stall_start, stall_end])
    d_down = np.concatenate([[0], np.ones(len(fail)), -np.ones(len(recover)), np.zeros(2 * len(stall_start))])
    d_stall = np.concatenate(
        [[0], np.zeros(len(fail) + len(recover)), np.ones(len(stall_start)), -np.ones(len(stall_end))]
    )
    order = np.argsort(time, kind="stable")
    time = time[order]
    down = np.cumsum(d_down[order])
    stalled = np.cumsum(d_stall[order]) > 0
    running = ~stalled & (down < n_slices)
    rate = np.where(running, (n_slices - down) * chips_per_slice, 0.0)
    return Timeline(time, running.astype(float), rate, horizon_s)


@dataclass(frozen=True)
class JobResult:
    """Fractions in [0, 1]: goodput = useful chip-time / allocated chip-time;
    uptime = share of wall time in which the (global) model advances."""

    goodput: float
    uptime: float


def combine_learners(
    timelines: Sequence[Timeline], allocated_chips: float, quorum: int, speeds: Sequence[float] | None = None
) -> JobResult:
    """Goodput and uptime of learners that never wait for each other.

    The global model advances while at least ``quorum`` learners run; work done while
    fewer run is not counted (the round cannot close; a learner would run too far ahead).
    ``speeds`` scale each learner's useful rate (its slowest chip, see ``learner_speeds``).
    """
    if not timelines:
        raise InvalidArgument("no learners to combine")
    horizon_s = timelines[0].horizon_s
    speeds = [1.0] * len(timelines) if speeds is None else speeds
    times, d_run, d_rate = [], [], []
    for tl, speed in zip(timelines, speeds, strict=True):
        times.append(tl.time_s)
        d_run.append(np.diff(tl.running, prepend=0.0))
        d_rate.append(np.diff(tl.rate_chips * speed, prepend=0.0))
    time = np.concatenate(times)
    order = np.argsort(time, kind="stable")
    time = time[order]
    n_running = np.rint(np.cumsum(np.concatenate(d_run)[order]))
    rate = np.cumsum(np.concatenate(d_rate)[order])
    duration = np.diff(np.append(time, horizon_s))
    advancing = n_running >= quorum
    useful = float(np.dot(np.where(advancing, rate, 0.0), duration))
    return JobResult(
        goodput=useful / (allocated_chips * horizon_s),
        uptime=float(np.dot(advancing, duration)) / horizon_s,
    )


def dp_job(
    failure_s: np.ndarray, restart_s: float, checkpoint_interval_s: float, horizon_s: float, speed: float = 1.0
) -> JobResult:
    """Non-elastic data-parallel job, given the failure times of all its chips.

    A failure while running loses the work since the last checkpoint (checkpoints every
    ``checkpoint_interval_s`` of running time, counted from each restart) and starts a
    restart of ``restart_s``; failures during a restart are absorbed (its spares replace
    every failed slice). Work running at the horizon is counted.
    """
    failure_s = np.sort(failure_s[failure_s < horizon_s])
    stops = failure_s[absorbed_starts(failure_s, restart_s)]
    run_start = np.minimum(np.concatenate([[0.0], stops + restart_s]), horizon_s)
    run_end = np.concatenate([stops, [horizon_s]])
    run = np.maximum(run_end - run_start, 0.0)
    lost = np.zeros_like(run)
    if checkpoint_interval_s > 0:
        lost[:-1] = np.mod(run[:-1], checkpoint_interval_s)
    return JobResult(
        goodput=speed * float(np.sum(run - lost)) / horizon_s,
        uptime=float(np.sum(run)) / horizon_s,
    )


# ------------------------------------------------------------------------ sampling


def slice_layout(chips: float, slice_chips: int) -> tuple[int, float]:
    """(number of slices, chips per slice) of an island; slices never exceed ``slice_chips``."""
    n_slices = max(1, math.ceil(chips / slice_chips - 1e-9))
    return n_slices, chips / n_slices


def sample_outages(
    rng: np.random.Generator,
    n_slices: int,
    chips_per_slice: float,
    mtbi_s: float,
    recovery: RecoveryDist,
    horizon_s: float,
) -> Outages:
    """Each slice alternates up ~ Exp(mtbi / chips) and down ~ recovery, from all-up at 0.

    A chip of a slice that is already down cannot take it down again, so this is the
    exact per-slice renewal process, not a Poisson approximation.
    """
    mean_up_s = mtbi_s / chips_per_slice
    mean_cycle_s = mean_up_s + recovery.mean_s()
    expected = horizon_s / mean_cycle_s
    # Enough cycles that most slices pass the horizon in one pass; the rest loop.
    chunk = max(1, math.ceil(expected + 3.0 * math.sqrt(expected)))
    start = np.zeros(n_slices)
    fails, recovers = [], []
    while len(start):
        up = rng.exponential(mean_up_s, (len(start), chunk))
        down = recovery.sample_s(rng, (len(start), chunk))
        recover = start[:, None] + np.cumsum(up + down, axis=1)
        fail = recover - down
        inside = fail < horizon_s
        fails.append(fail[inside])
        recovers.append(recover[inside])
        start = recover[:, -1][inside[:, -1]]
    fail = np.concatenate(fails)
    order = np.argsort(fail, kind="stable")
    return Outages(fail[order], np.concatenate(recovers)[order])


def sample_failures(rng: np.random.Generator, chips: float, mtbi_s: float, horizon_s: float) -> np.ndarray:
    """Failure times of ``chips`` chips with Poisson failures (the DP job always has all chips)."""
    count = rng.poisson(chips * horizon_s / mtbi_s)
    return np.sort(rng.uniform(0.0, horizon_s, count))


def slowest_chip_speed(rng: np.random.Generator, chips: float, speed_cv: float) -> float:
    """Speed of the slowest of ``chips`` chips with speeds ~ Normal(1, cv), relative to the mean.

    Sampled from the minimum's own distribution, P(min <= x) = 1 - (1 - Phi(x))^n, so it
    costs O(1) whatever the chip count.
    """
    if speed_cv == 0:
        return 1.0
    u = rng.random()
    p = -math.expm1(math.log1p(-u) / max(chips, 1.0))
    p = min(max(p, 1e-300), 1 - 1e-16)
    return max(0.0, 1.0 + speed_cv * NormalDist().inv_cdf(p))


def learner_speeds(
    rng: np.random.Generator, chips_per_learner: float, learners: int, options: SimOptions
) -> list[float]:
    """Each learner runs at its slowest chip; none runs faster than the K-th fastest.

    A learner far ahead of the quorum would outrun the global model (its pushes join
    rounds that cannot close without the slower K-th learner), so it is throttled.
    """
    speeds = [slowest_chip_speed(rng, chips_per_learner, options.speed_cv) for _ in range(learners)]
    kth_fastest = sorted(speeds, reverse=True)[min(options.quorum, learners) - 1]
    return [min(s, kth_fastest) for s in speeds]


# --------------------------------------------------------------------------- systems


def _rng(options: SimOptions, system: int, chips: float, learners: int, trial: int) -> np.random.Generator:
    return np.random.default_rng([options.seed, system, int(round(chips)), learners, trial])


def _mean(results: list[JobResult]) -> JobResult:
    return JobResult(
        goodput=float(np.mean([r.goodput for r in results])),
        uptime=float(np.mean([r.uptime for r in results])),
    )


def simulate_dp(chips: float, options: SimOptions) -> JobResult:
    """Non-elastic data-parallel on ``chips`` chips, averaged over ``options.trials``."""
    results = []
    for trial in range(options.trials):
        rng = _rng(options, _DP, chips, 1, trial)
        speed = slowest_chip_speed(rng, chips, options.speed_cv)
        failures = sample_failures(rng, chips, options.mtbi_s, options.horizon_s)
        results.append(
            dp_job(failures, options.restart_s, options.checkpoint_interval_s, options.horizon_s, speed)
        )
    return _mean(results)


def _simulate_islands(
    chips: float, learners: int, hold_s: float, quorum: int, system: int, options: SimOptions
) -> JobResult:
    per_learner = chips / learners
    n_slices, chips_per_slice = slice_layout(per_learner, options.slice_chips)
    results = []
    for trial in range(options.trials):
        rng = _rng(options, system, chips, learners, trial)
        speeds = learner_speeds(rng, per_learner, learners, options)
        timelines = [
            island_timeline(
                sample_outages(rng, n_slices, chips_per_slice, options.mtbi_s, options.recovery, options.horizon_s),
                n_slices,
                chips_per_slice,
                hold_s,
                options.horizon_s,
            )
            for _ in range(learners)
        ]
        results.append(combine_learners(timelines, chips, quorum, speeds))
    return _mean(results)


def simulate_elastic_dp(chips: float, options: SimOptions) -> JobResult:
    """Elastic data-parallel: one island of ``chips`` chips that resizes around failures."""
    return _simulate_islands(chips, 1, options.resize_s, 1, _ELASTIC, options)


def simulate_decoupled(chips: float, learners: int, options: SimOptions) -> JobResult:
    """Decoupled DiLoCo: ``learners`` elastic islands of ``chips / learners`` chips each."""
    if options.quorum > learners:
        raise InvalidArgument(f"--quorum {options.quorum} is larger than the number of learners {learners}")
    return _simulate_islands(
        chips, learners, options.resize_s + options.catchup_s, options.quorum, _DECOUPLED, options
    )


# ----------------------------------------------------------------------------- table


@dataclass(frozen=True)
class Table:
    """Goodput and uptime per system and chip count, fractions in [0, 1]."""

    chips: tuple[int, ...]
    learners: tuple[int, ...]
    dp: dict[int, JobResult]
    elastic_dp: dict[int, JobResult]
    decoupled: dict[int, dict[int, JobResult]]


def expected_events(chips: float, options: SimOptions) -> float:
    """Expected failures plus recoveries of one trial of one cell (memory and time scale with it)."""
    return 2.0 * chips * options.horizon_s / options.mtbi_s


def validate_sweep(chips: Sequence[int], learners: Sequence[int], options: SimOptions) -> None:
    """Raise InvalidArgument for a sweep the simulator cannot run."""
    _require(len(chips) > 0, "--chips needs at least one chip count")
    _require(len(learners) > 0, "--learners needs at least one learner count")
    for n in chips:
        _require(1 <= n <= 10**9, f"--chips values must be in [1, 1e9], got {n}")
        events = expected_events(n, options)
        _require(
            events <= MAX_EVENTS_PER_CELL,
            f"{n} chips over {options.horizon_days:g} days with --mtbi-years {options.mtbi_years:g} means "
            f"~{events:.2g} events per trial (limit {MAX_EVENTS_PER_CELL:.0e}); lower --horizon-days",
        )
    for m in learners:
        _require(1 <= m <= 4096, f"--learners values must be in [1, 4096], got {m}")
        _require(
            options.quorum <= m,
            f"--quorum {options.quorum} is larger than {m} learners; lower --quorum or drop {m} from --learners",
        )
        for n in chips:
            _require(m <= n, f"{m} learners need at least {m} chips, got --chips {n}")


def simulate_table(
    chips: Sequence[int],
    learners: Sequence[int],
    options: SimOptions,
    on_cell: Callable[[str], None] | None = None,
) -> Table:
    """Every system at every chip count (and every learner count for decoupled)."""
    validate_sweep(chips, learners, options)
    say = on_cell or (lambda _: None)
    dp, elastic = {}, {}
    decoupled: dict[int, dict[int, JobResult]] = {m: {} for m in learners}
    for n in chips:
        say(f"dp {n}")
        dp[n] = simulate_dp(n, options)
        say(f"elastic_dp {n}")
        elastic[n] = simulate_elastic_dp(n, options)
        for m in learners:
            say(f"decoupled M={m} {n}")
            decoupled[m][n] = simulate_decoupled(n, m, options)
    return Table(tuple(chips), tuple(learners), dp, elastic, decoupled)
