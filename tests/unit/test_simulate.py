"""The chaos simulator: exact tiny cases, the closed forms, the paper's table, the CLI contract."""

import argparse
import json
from dataclasses import replace

import numpy as np
import pytest

import diloco.lab.simulate as sim
from diloco.errors import InvalidArgument
from diloco.lab.simulate import analytic
from diloco.lab.simulate.engine import (
    JobResult,
    Outages,
    RecoveryDist,
    SimOptions,
    absorbed_starts,
    combine_learners,
    dp_job,
    island_timeline,
    sample_outages,
    simulate_decoupled,
    simulate_dp,
    simulate_elastic_dp,
    slowest_chip_speed,
)
from diloco.lab.simulate.report import PUBLISHED_GOODPUT_PCT

# One trial is enough: a cell's standard deviation across seeds is ~0.1 goodput points.
FAST = replace(SimOptions(), trials=1)
PAPER_CHIPS = [150_000, 300_000, 600_000, 1_200_000, 2_400_000]


def parse(argv):
    parser = argparse.ArgumentParser()
    sim.add_arguments(parser)
    return parser.parse_args(argv)


# ------------------------------------------------------------------ event engine, exact


def test_absorbed_starts_folds_events_inside_a_hold():
    t = np.array([0.0, 5.0, 10.0, 12.0, 30.0, 39.9, 40.0])
    # Holds of 10: [0,10) absorbs 5; 10 starts [10,20) absorbing 12; 30 starts [30,40); 40 starts again.
    assert absorbed_starts(t, 10.0).tolist() == [0, 2, 4, 6]
    assert absorbed_starts(t, 0.0).tolist() == list(range(7))
    assert absorbed_starts(np.zeros(0), 10.0).tolist() == []
    assert absorbed_starts(np.array([7.0, 7.0, 7.0]), 1.0).tolist() == [0]


def test_absorbed_starts_matches_a_plain_loop():
    rng = np.random.default_rng(1)
    t = np.sort(rng.uniform(0, 1000, 5000))
    expected, end = [], -np.inf
    for i, x in enumerate(t):
        if x >= end:
            expected.append(i)
            end = x + 0.7
    assert absorbed_starts(t, 0.7).tolist() == expected


def test_dp_one_chip_deterministic_failures():
    # Runs [0,100) and [130,500) end in failures; 105 falls in the restart [100,130).
    # Checkpoints every 40 s of running: lose 100 mod 40 = 20 and 370 mod 40 = 10.
    # The last run [530,1000) reaches the horizon and keeps its 470 s.
    result = dp_job(np.array([100.0, 105.0, 500.0]), restart_s=30, checkpoint_interval_s=40, horizon_s=1000)
    assert result.uptime == pytest.approx((100 + 370 + 470) / 1000)
    assert result.goodput == pytest.approx((80 + 360 + 470) / 1000)
    no_loss = dp_job(np.array([100.0, 105.0, 500.0]), restart_s=30, checkpoint_interval_s=0, horizon_s=1000)
    assert no_loss.goodput == no_loss.uptime == pytest.approx(0.94)


def test_dp_restart_past_the_horizon():
    result = dp_job(np.array([990.0]), restart_s=30, checkpoint_interval_s=0, horizon_s=1000)
    assert result.uptime == pytest.approx(0.99)


def test_elastic_one_chip_deterministic_outage():
    # The only slice is down on [100,300); resizes stall [100,110) and [300,310).
    tl = island_timeline(Outages.of([(100, 300)]), n_slices=1, chips_per_slice=1, hold_s=10, horizon_s=1000)
    assert tl.running_s() == pytest.approx(100 + 690)
    assert tl.useful_chip_s() == pytest.approx(100 + 690)


def test_elastic_island_keeps_running_on_fewer_chips():
    # 4 slices of 2 chips; one down on [100,400): stalls [100,110) and [400,410).
    tl = island_timeline(Outages.of([(100, 400)]), n_slices=4, chips_per_slice=2, hold_s=10, horizon_s=1000)
    assert tl.running_s() == pytest.approx(980)
    assert tl.useful_chip_s() == pytest.approx(8 * 1000 - 8 * 20 - 2 * 290)


def test_recovery_after_the_horizon_and_events_in_a_stall():
    # A failure at 100 and another at 105 (absorbed into the stall [100,110)); neither recovers in time.
    tl = island_timeline(
        Outages.of([(100, 5000), (105, 6000)]), n_slices=3, chips_per_slice=1, hold_s=10, horizon_s=1000
    )
    assert tl.running_s() == pytest.approx(990)
    assert tl.useful_chip_s() == pytest.approx(3 * 100 + 0 * 10 + 1 * 890)


def two_learners():
    # Learner A (2 slices of 1 chip): a slice down [100,200) -> stalls [100,110), [200,210).
    # Learner B (2 slices of 1 chip): a slice down [105,150) -> stalls [105,115), [150,160).
    a = island_timeline(Outages.of([(100, 200)]), 2, 1, hold_s=10, horizon_s=1000)
    b = island_timeline(Outages.of([(105, 150)]), 2, 1, hold_s=10, horizon_s=1000)
    return a, b


def test_two_learners_known_outages_quorum_one():
    a, b = two_learners()
    result = combine_learners([a, b], allocated_chips=4, quorum=1)
    # Both stalled only on [105,110).
    assert result.uptime == pytest.approx(995 / 1000)
    useful_a = 2 * 1000 - 2 * 10 - 1 * 90 - 2 * 10
    useful_b = 2 * 1000 - 2 * 10 - 1 * 35 - 2 * 10
    assert result.goodput == pytest.approx((useful_a + useful_b) / 4000)


def test_two_learners_known_outages_quorum_two():
    a, b = two_learners()
    result = combine_learners([a, b], allocated_chips=4, quorum=2)
    # The global model stops on [100,115), [150,160), [200,210): 35 s.
    assert result.uptime == pytest.approx(965 / 1000)
    # Outside those, A runs on 1 chip on [115,150) and [160,200); B on [115,150).
    assert result.goodput == pytest.approx((2 * 965 - 75 + 2 * 965 - 35) / 4000)


def test_learner_with_all_slices_down_is_not_running():
    a = island_timeline(Outages.of([(0, 500)]), 1, 4, hold_s=0, horizon_s=1000)
    b = island_timeline(Outages.of([]), 1, 4, hold_s=0, horizon_s=1000)
    assert combine_learners([a, b], 8, quorum=1) == JobResult(goodput=pytest.approx(0.75), uptime=1.0)
    assert combine_learners([a, b], 8, quorum=2) == JobResult(goodput=pytest.approx(0.5), uptime=0.5)


# ------------------------------------------------------------------------- sampling


def test_exponentiated_weibull_sampling_and_mean():
    rng = np.random.default_rng(0)
    dist = RecoveryDist("expweibull", scale_h=0.7, shape=0.7, exponent=2.0)
    samples = dist.sample_s(rng, 400_000)
    assert samples.mean() == pytest.approx(dist.mean_s(), rel=0.01)
    # exponent 1, shape 1 is the exponential distribution.
    assert RecoveryDist("expweibull", 2.0, 1.0, 1.0).mean_s() == pytest.approx(7200, rel=1e-6)
    assert RecoveryDist("fixed", 0.5).sample_s(rng, 3).tolist() == [1800.0] * 3


def test_outage_sampling_is_a_per_slice_renewal():
    rng = np.random.default_rng(0)
    dist = RecoveryDist("fixed", scale_h=1.0)
    out = sample_outages(rng, n_slices=200, chips_per_slice=1000, mtbi_s=100 * 3600, recovery=dist,
                         horizon_s=2000 * 3600)
    assert np.all(out.recover_s - out.fail_s == pytest.approx(3600))
    # A slice's cycle: up 100 h / 1000 chips = 0.1 h on average, then down 1 h.
    assert len(out.fail_s) / 200 == pytest.approx(2000 / 1.1, rel=0.02)


def test_slowest_chip_speed_matches_brute_force():
    rng = np.random.default_rng(3)
    cv, n = 0.02, 200
    fast = np.mean([slowest_chip_speed(rng, n, cv) for _ in range(3000)])
    brute = np.mean(1 + cv * rng.standard_normal((3000, n)).min(axis=1))
    assert fast == pytest.approx(brute, abs=5e-4)
    assert slowest_chip_speed(rng, 10**6, 0.0) == 1.0


# -------------------------------------------------------------- model at the paper's scale


@pytest.mark.parametrize("chips", [150_000, 1_200_000, 2_400_000])
def test_engine_agrees_with_closed_forms(chips):
    opts = replace(FAST, horizon_days=10)
    checks = [
        (simulate_dp(chips, opts), analytic.dp(chips, opts)),
        (simulate_elastic_dp(chips, opts), analytic.elastic_dp(chips, opts)),
        (simulate_decoupled(chips, 2, opts), analytic.decoupled(chips, 2, opts)),
        (simulate_decoupled(chips, 8, opts), analytic.decoupled(chips, 8, opts)),
    ]
    for result, (goodput, uptime) in checks:
        assert result.goodput == pytest.approx(goodput, abs=0.01)
        assert result.uptime == pytest.approx(uptime, abs=0.01)


def published_cells():
    for system in ("dp", "elastic_dp"):
        for chips, pct in PUBLISHED_GOODPUT_PCT[system].items():
            yield system, None, chips, pct
    for m, cells in PUBLISHED_GOODPUT_PCT["decoupled"].items():
        for chips, pct in cells.items():
            yield "decoupled", m, chips, pct


@pytest.mark.parametrize("system,learners,chips,published", list(published_cells()))
def test_defaults_reproduce_published_cell(system, learners, chips, published):
    if system == "dp":
        result = simulate_dp(chips, FAST)
    elif system == "elastic_dp":
        result = simulate_elastic_dp(chips, FAST)
    else:
        result = simulate_decoupled(chips, learners, FAST)
    assert 100 * result.goodput == pytest.approx(published, abs=3.0)


@pytest.mark.parametrize("learners,chips", [(2, 1_200_000), (2, 2_400_000), (4, 1_200_000), (8, 2_400_000),
                                            (16, 2_400_000)])
def test_m_learners_behave_like_one_elastic_learner_on_m_times_fewer_chips(learners, chips):
    opts = replace(FAST, horizon_days=10)
    elastic = simulate_elastic_dp(chips // learners, opts).goodput
    decoupled = simulate_decoupled(chips, learners, opts).goodput
    # The catch-up after each resize keeps decoupled a little below (the paper: 54 vs 58).
    assert elastic - 0.045 <= decoupled <= elastic + 0.005
    # Without it the rule is exact: each learner is an elastic island of chips / M.
    exact = simulate_decoupled(chips, learners, replace(opts, catchup_s=0.0)).goodput
    assert exact == pytest.approx(elastic, abs=0.005)


@pytest.mark.parametrize("chips", PAPER_CHIPS)
def test_uptime_is_about_100_percent_for_four_or_more_learners(chips):
    opts = replace(FAST, horizon_days=10)
    for learners in (4, 8, 16):
        assert simulate_decoupled(chips, learners, opts).uptime >= 0.99


def test_decoupling_wins_at_every_scale():
    opts = replace(FAST, horizon_days=5)
    for chips in (150_000, 2_400_000):
        dp = simulate_dp(chips, opts).goodput
        elastic = simulate_elastic_dp(chips, opts).goodput
        decoupled = [simulate_decoupled(chips, m, opts).goodput for m in (2, 4, 8, 16)]
        assert dp < elastic < decoupled[0] < decoupled[1] < decoupled[2] < decoupled[3]


def test_quorum_all_learners_lowers_uptime_and_goodput():
    opts = replace(FAST, horizon_days=5)
    k1 = simulate_decoupled(1_200_000, 8, opts)
    k8 = simulate_decoupled(1_200_000, 8, replace(opts, quorum=8))
    assert k8.uptime < k1.uptime and k8.goodput < k1.goodput


# ---------------------------------------------------------------------------- CLI


def test_json_has_the_documented_shape(capsys):
    assert sim.run(parse(["--json", "--chips", "150k,300k", "--learners", "2,4", "--horizon-days", "1"])) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)  # nothing but the object on stdout
    assert set(doc) == {"goodput", "uptime"}
    for metric in doc.values():
        assert set(metric) == {"dp", "elastic_dp", "decoupled"}
        assert set(metric["dp"]) == set(metric["elastic_dp"]) == {"150000", "300000"}
        assert set(metric["decoupled"]) == {"2", "4"}
        assert all(set(row) == {"150000", "300000"} for row in metric["decoupled"].values())
        values = [*metric["dp"].values(), *metric["elastic_dp"].values()]
        values += [v for row in metric["decoupled"].values() for v in row.values()]
        assert all(0.0 <= v <= 100.0 for v in values)


def test_defaults_sweep_the_papers_grid():
    args = parse([])
    assert sim.parse_counts(args.chips, "--chips") == PAPER_CHIPS
    assert sim.parse_counts(args.learners, "--learners") == [2, 4, 8, 16]
    assert sim.options_from_args(args) == SimOptions()
    assert sim.parse_counts("150k, 1.2M,2400000", "--chips") == [150_000, 1_200_000, 2_400_000]


def test_same_seed_same_output_other_seed_other_output(capsys):
    argv = ["--json", "--chips", "300000", "--learners", "2", "--horizon-days", "1", "--trials", "2"]
    outputs = []
    for seed in ("7", "7", "8"):
        sim.run(parse([*argv, "--seed", seed]))
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] != outputs[2]


def test_out_writes_table_json_and_plot(tmp_path, capsys):
    out = tmp_path / "sim"
    assert sim.run(parse(["--chips", "1.2M", "--learners", "2,8", "--horizon-days", "1", "--out", str(out)])) == 0
    assert "Decoupled M=8" in capsys.readouterr().out
    doc = json.loads((out / "simulate.json").read_text())
    assert doc["options"]["resize_s"] == SimOptions().resize_s
    assert {row["chips"] for row in doc["published"]} == {1_200_000}
    assert "| Decoupled M=2 |" in (out / "simulate.md").read_text()
    assert (out / "simulate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--chips", "0"], "--chips"),
        (["--chips", "12x"], "not a number"),
        (["--chips", "1.5"], "whole number"),
        (["--chips", ""], "empty"),
        (["--chips", "100,100"], "duplicate"),
        (["--learners", "0"], "--learners"),
        (["--learners", "2", "--chips", "1"], "at least 2 chips"),
        (["--mtbi-years", "0"], "--mtbi-years"),
        (["--mtbi-years", "abc"], "not a number"),
        (["--mtbi-years", "nan"], "finite"),
        (["--slice-chips", "0"], "--slice-chips"),
        (["--slice-chips", "2.5"], "whole number"),
        (["--recovery-dist", "gamma"], "expweibull"),
        (["--recovery-scale-h", "-1"], "--recovery-scale-h"),
        (["--recovery-shape", "0"], "--recovery-shape"),
        (["--recovery-exponent", "-2"], "--recovery-exponent"),
        (["--resize-s", "-1"], "--resize-s"),
        (["--catchup-s", "-1"], "--catchup-s"),
        (["--restart-s", "-5"], "--restart-s"),
        (["--checkpoint-interval-s", "-1"], "--checkpoint-interval-s"),
        (["--speed-cv", "1.5"], "--speed-cv"),
        (["--quorum", "0"], "--quorum"),
        (["--quorum", "3", "--learners", "2,4"], "larger than 2 learners"),
        (["--horizon-days", "0"], "--horizon-days"),
        (["--trials", "0"], "--trials"),
        (["--seed", "-1"], "--seed"),
        (["--chips", "2400000", "--mtbi-years", "0.001"], "events per trial"),
    ],
)
def test_bad_flag_values_raise_invalid_argument(argv, message):
    with pytest.raises(InvalidArgument, match=message):
        sim.run(parse(argv))


def test_out_must_be_a_directory(tmp_path):
    file = tmp_path / "file"
    file.write_text("")
    with pytest.raises(InvalidArgument, match="not a directory"):
        sim.run(parse(["--chips", "1000", "--learners", "2", "--out", str(file)]))
