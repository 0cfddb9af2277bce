"""Closed forms of the simulator's model, from renewal theory.

They hold in the simulator's regime (many slices per island, long horizon) and serve
two purposes: a test oracle for the event engine, and the one-line explanation of why
decoupling wins (docs/simulate.md). The engine stays the reference: it also covers
quorum K > 1 overlaps, islands with few slices, speed variance and finite horizons.
"""

from __future__ import annotations

import math

from diloco.lab.simulate.engine import SimOptions, slice_layout


def stall_fraction(chips: float, hold_s: float, options: SimOptions) -> float:
    """Share of time an elastic island of ``chips`` chips is resizing.

    Each slice alternates up (mean mtbi / chips-per-slice) and down (mean recovery), so
    the island sees 2 * slices / (up + down) membership changes per second; with
    changes during a hold absorbed, every hold is followed by an exponential gap:
    stalled = rho / (1 + rho), rho = rate * hold.
    """
    n_slices, per_slice = slice_layout(chips, options.slice_chips)
    cycle_s = options.mtbi_s / per_slice + options.recovery.mean_s()
    rho = 2.0 * n_slices / cycle_s * hold_s
    return rho / (1.0 + rho)


def slice_up_fraction(chips: float, options: SimOptions) -> float:
    """Long-run share of an island's slices that are up."""
    _, per_slice = slice_layout(chips, options.slice_chips)
    up_s = options.mtbi_s / per_slice
    return up_s / (up_s + options.recovery.mean_s())


def elastic_dp(chips: float, options: SimOptions) -> tuple[float, float]:
    """(goodput, uptime) of elastic DP: running share times the share of chips up."""
    running = 1.0 - stall_fraction(chips, options.resize_s, options)
    return running * slice_up_fraction(chips, options), running


def decoupled(chips: float, learners: int, options: SimOptions) -> tuple[float, float]:
    """(goodput, uptime) of Decoupled DiLoCo for quorum 1.

    Goodput is one island of chips / learners with the longer hold (resize + catch-up):
    the "M learners behave like one elastic learner on M times fewer chips" rule. The
    global model stops only when every learner stalls at once: uptime = 1 - stalled^M.
    """
    stalled = stall_fraction(chips / learners, options.resize_s + options.catchup_s, options)
    goodput = (1.0 - stalled) * slice_up_fraction(chips / learners, options)
    return goodput, 1.0 - stalled**learners


def dp(chips: float, options: SimOptions) -> tuple[float, float]:
    """(goodput, uptime) of non-elastic DP.

    A run lasts Exp(1 / lambda), lambda = chips / mtbi, then a restart of R; of a run
    of length U, floor(U / tau) * tau is kept: kept share lambda*tau / (e^(lambda*tau) - 1).
    """
    lam = chips / options.mtbi_s
    uptime = 1.0 / (1.0 + lam * options.restart_s)
    tau = options.checkpoint_interval_s
    kept = 1.0 if tau == 0 else lam * tau / math.expm1(lam * tau)
    return kept * uptime, uptime
