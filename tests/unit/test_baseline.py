"""The baselines' pure parts: fault plans, wire-byte counts, the metrics computed from a
recorded timeline, config validation and the CLI's answers to bad input."""

import math
import sys
from dataclasses import replace

import pytest
import torch

from diloco import command as cli
from diloco.lab.baseline import torchft_peer
from diloco.lab.baseline.common import (
    SUMMARY_KEYS, TASK_ERROR_PREFIX, KillPlan, advance_schedule, parse_slow_workers, ring_allreduce_bytes,
    skip_batches, summary, task_error, worker_task,
)
from diloco.lab.baseline.dp import Attempt, DPConfig, dp_metrics
from diloco.lab.baseline.torchft_peer import TorchftConfig, ft_metrics
from diloco.config import RunConfig
from diloco.errors import InvalidArgument
from diloco.task import TaskError
from diloco.learner.runner import inner_optimizer
from tests.checks import assert_same_tensors


def test_slow_workers_parse_repeated_and_comma_separated_specs():
    assert parse_slow_workers(["1:1.5", "2:2,0:1.2"]) == ((0, 1.2), (1, 1.5), (2, 2.0))
    assert parse_slow_workers(None) == ()
    for bad in ("1", "a:2", "1:0.5", "1:nan"):
        with pytest.raises(InvalidArgument, match="slow worker"):
            parse_slow_workers([bad])


def test_kill_plan_is_fixed_by_its_seed_and_has_the_requested_mean():
    def plan(seed):
        kills = KillPlan(30.0, seed)
        kills.start(100.0)
        out = []
        while len(out) < 2000:
            t = kills.next_at
            out.append((t, kills.fire(3)))
        return out

    a, b = plan(7), plan(7)
    assert a == b and a != plan(8)
    assert a[0][0] > 100.0
    gaps = [t1 - t0 for (t0, _), (t1, _) in zip(a, a[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(30.0, rel=0.1)
    assert {v for _, v in a} == {0, 1, 2}
    idle = KillPlan(0.0, 1)
    idle.start(0.0)
    assert not idle.enabled and not idle.due(1e9)


def test_ring_allreduce_sends_two_buffers_per_extra_member():
    assert ring_allreduce_bytes(1000, 1) == 0
    assert ring_allreduce_bytes(1000, 2) == 2000
    assert ring_allreduce_bytes(1000, 3) == 4000  # each of 3 sends 2*(2/3) buffers


def test_summary_has_exactly_the_compare_keys():
    values = {**dict.fromkeys(SUMMARY_KEYS, 1.0), "eval_unit": "bits/byte"}
    assert list(summary(**values)) == list(SUMMARY_KEYS)
    assert summary(**values)["eval_unit"] == "bits/byte"
    with pytest.raises(ValueError):
        summary(**{**values, "extra": 1})


def _attempt(number, ready, start_step, steps, t_first, dt=1.0):
    a = Attempt(number)
    a.add({"kind": "ready", "t": ready, "step": start_step})
    for i in range(steps):
        t0 = t_first + i * dt
        a.add({"kind": "step", "step": start_step + i + 1, "t0": t0, "t1": t0 + dt})
    return a


def test_dp_metrics_without_faults():
    m = dp_metrics([_attempt(0, 0.0, 0, 10, 0.0)], workers=3, buffer_bytes=400, tokens_per_step=3 * 16 * 32)
    assert m["goodput"] == pytest.approx(1.0)
    assert (m["uptime"], m["global_stall_s"], m["steps_lost"]) == (1.0, 0.0, 0)
    # 2(M-1) buffers per step over M*B*T tokens per step.
    assert m["bytes_per_1k_tokens"] == pytest.approx(1000 * 2 * 2 * 400 / (3 * 16 * 32), abs=0.005)  # 2 digits


def test_dp_metrics_roll_back_steps_after_the_checkpoint_and_count_the_restart_as_stall():
    # Attempt 0 does steps 1..7 (t 0..7), is killed; attempt 1 is ready at t=17 from the
    # checkpoint at step 5 and does steps 6..10 (t 17..22).
    first = _attempt(0, 0.0, 0, 7, 0.0)
    second = _attempt(1, 17.0, 5, 5, 17.0)
    m = dp_metrics([first, second], workers=2, buffer_bytes=100, tokens_per_step=10)
    assert m["steps_computed"] == 12 and m["steps_lost"] == 2
    assert m["window_s"] == pytest.approx(22.0)
    assert m["goodput"] == pytest.approx(10 / 22, abs=5e-5)  # ten surviving 1 s steps in 22 s (4 digits)
    assert m["period_s"] == pytest.approx(4.0)
    assert m["global_stall_s"] == pytest.approx(11.0 - 4.0)  # advances at 7 and 18: 11 s, 4 s expected
    assert m["uptime"] == pytest.approx(1 - 7 / 22, abs=1e-4)  # uptime() rounds to 4 digits
    assert m["bytes_per_1k_tokens"] == pytest.approx(1000 * 2 * 100 / 10)


def test_dp_metrics_need_a_finished_step():
    with pytest.raises(ValueError):
        dp_metrics([Attempt(0)], workers=2, buffer_bytes=1, tokens_per_step=1)


def test_ft_metrics_count_only_work_that_a_committed_sync_carried():
    def steps(first, n):
        return [{"kind": "step", "step": first + i, "t0": first + i - 1.0, "t1": first + i} for i in range(n)]

    # P = 2 fragments, H = 4: fragment 0 prepared after step 1, synced after step 2 (committed);
    # fragment 1 prepared after step 3, synced after step 4 (failed); then a heal.
    records = [{"kind": "ready", "t": 0.0, "step": 0}]
    records += steps(1, 1) + [{"kind": "prepare", "t": 1.0, "fragment": 0}]
    records += steps(2, 1) + [{"kind": "sync", "t": 2.0, "fragment": 0, "committed": True, "bytes": 10}]
    records += steps(3, 1) + [{"kind": "prepare", "t": 3.0, "fragment": 1}]
    records += steps(4, 1) + [{"kind": "sync", "t": 4.0, "fragment": 1, "committed": False, "bytes": 10}]
    records += [{"kind": "heal", "t": 4.5, "bytes": 100}]
    m = ft_metrics([records], fragments=2, sync_every_steps=4, tokens_per_step=50)
    # Fragment 0 carried step 1's work (1 s, half the model): 0.5 worker-seconds.
    assert m["useful_worker_s"] == pytest.approx(0.5)
    assert m["useful_worker_s_with_overlap"] == pytest.approx(1.0)
    assert (m["commits"], m["failed_commits"], m["heals"]) == (1, 1, 1)
    assert m["bytes_total"] == 120 and m["tokens_computed"] == 200
    assert m["period_s"] == pytest.approx(4 / 2 * 1.0 * 4)


def test_configs_reject_bad_values_and_round_trip_through_json(tmp_path):
    for bad in (dict(workers=0), dict(steps=0), dict(kill_every_s=-1.0), dict(kill_every_s=math.inf),
                dict(slow_workers=((3, 2.0),)), dict(workers=1, kill_every_s=5.0), dict(kill_at_steps=(150,))):
        with pytest.raises(InvalidArgument):
            DPConfig(**bad)
    cfg = DPConfig(workers=2, steps=20, slow_workers=((1, 1.5),), kill_at_steps=(5,), out=tmp_path)
    assert DPConfig.from_json(cfg.to_json()) == cfg
    assert cfg.inner().steps == 20 and cfg.inner().lr == 3e-3 and cfg.slow_factor(1) == 1.5
    with pytest.raises(InvalidArgument, match="multiple of the fragments"):
        TorchftConfig(run=RunConfig(fragments=4, sync_every_steps=6))
    ft = TorchftConfig(workers=2, outer_momentum=0.9)
    assert TorchftConfig.from_json(ft.to_json()) == ft


@pytest.mark.parametrize("argv, message", [
    (["baseline", "dp", "--workers", "0"], "workers must be >= 1"),
    (["baseline", "dp", "--slow-worker", "7:2"], "slow worker 7 does not exist"),
    (["baseline", "dp", "--slow-worker", "fast"], "ID:FACTOR"),
    (["baseline", "dp", "--kill-every", "-3"], "kill every"),
    (["baseline", "dp", "--checkpoint-every", "0"], "checkpoint every steps must be >= 1"),
    (["baseline", "torchft", "--sync-every", "6"], "multiple of the fragments"),
])
def test_bad_flags_are_clear_errors_without_traceback(argv, message, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


PEERS = 'install the peers extra: pip install -c constraints.txt -e ".[peers]"'


def test_torchft_missing_says_how_to_install(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "torchft", None)  # `import torchft` fails, as where it is not installed
    assert cli.main(["baseline", "torchft", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("diloco: error: torchft cannot be imported here (") and err.endswith(f"): {PEERS}\n"), err
    assert not (tmp_path / "run").exists()


def test_compare_with_torchft_that_cannot_be_imported_refuses_before_anything_runs(monkeypatch, capsys, tmp_path):
    """It ran every other system's runs (108 s by default) and then reported torchft "not
    run"; now one line names the extra and the --systems that leaves torchft out."""
    from diloco.lab import compare

    def ran(*args, **kwargs):
        raise AssertionError("a run started")

    monkeypatch.setattr(compare, "run_scenario", ran)
    monkeypatch.setattr(compare, "_decoupled", ran)
    monkeypatch.setitem(sys.modules, "torchft", None)
    for systems, leave_out in (([], ", or leave it out: --systems decoupled,dp"),
                               (["--systems", "torchft,decoupled"], ", or leave it out: --systems decoupled"),
                               (["--systems", "torchft"], "")):
        assert cli.main(["compare", "--scenario", "nofault", *systems, "--out", str(tmp_path / "c")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("diloco: error: --systems includes torchft, which cannot be imported here ("), err
        assert err.endswith(f"): {PEERS}{leave_out}\n") and err.count("\n") == 1, err
    assert not (tmp_path / "c").exists()
    monkeypatch.delitem(sys.modules, "torchft")
    compare.check_systems(compare.CompareConfig())  # where it imports (the dev venv has it), nothing to say


def test_ft_metrics_count_a_replacement_only_once_it_has_healed_onto_the_run_model():
    def cycle(t, committed=True):
        return [{"kind": "step", "step": t, "t0": t - 1.0, "t1": float(t)},
                {"kind": "prepare", "t": float(t), "fragment": 0},
                {"kind": "sync", "t": float(t), "fragment": 0, "committed": committed, "bytes": 0}]

    alone = [{"kind": "ready", "t": 0.0, "step": 0, "attempt": 1}] + cycle(1) + cycle(2)
    healed = [{"kind": "ready", "t": 0.0, "step": 0, "attempt": 1}] + cycle(1)
    healed += [{"kind": "heal", "t": 1.5, "bytes": 0}] + cycle(2) + cycle(3)
    m = ft_metrics([alone], fragments=1, sync_every_steps=1, tokens_per_step=1)
    assert (m["useful_worker_s"], m["commits"], m["off_model_commits"]) == (0.0, 0, 2)
    m = ft_metrics([healed], fragments=1, sync_every_steps=1, tokens_per_step=1)
    assert (m["useful_worker_s"], m["commits"], m["off_model_commits"]) == (2.0, 2, 1)


TINY_GPT = {"width": "16", "depth": "1", "heads": "2", "context": "16", "batch_size": "4", "eval_batches": "1"}


def test_a_worker_builds_the_task_as_the_learner_of_its_index_would():
    from diloco.tasks import byte_gpt

    run = RunConfig(task_options=TINY_GPT, seed=5)
    cfg = DPConfig(run=run, workers=3, steps=10)
    task = cfg.task(2)
    assert isinstance(task.model, byte_gpt.GPT) and task.model.cfg.seed == 5 and task.eval_unit == "bits/byte"
    # Every worker starts from the run's seeded model and reads its own share of the data.
    assert_same_tensors(task.model.state_dict().values(), cfg.task(0).model.state_dict().values())
    x2, _ = next(iter(task.batches))
    x0, _ = next(iter(cfg.task(0).batches))
    assert x2.shape == (4, 16) and not torch.equal(x0, x2)
    assert torch.equal(next(iter(worker_task(run, 2, 3).batches))[0], x2)


def test_a_restarted_worker_resumes_the_batches_and_the_schedule_where_it_was():
    run = RunConfig(task_options=TINY_GPT)
    cfg = DPConfig(run=run, workers=2, steps=40)
    task = cfg.task(1)
    straight = iter(task.batches)
    for _ in range(7):
        next(straight)
    resumed = skip_batches(run.task, cfg.task(1).batches, 7)
    assert_same_tensors(next(straight), next(resumed))
    with pytest.raises(TaskError, match="ended after 2 batches"):
        skip_batches(run.task, [1, 2], 3)

    optimizer, schedule = inner_optimizer(task, cfg.inner())
    for _ in range(25):
        optimizer.step()  # no gradients: nothing moves but the schedule
        schedule.step()
    _, jumped = inner_optimizer(cfg.task(1), cfg.inner())
    advance_schedule(jumped, 25)
    assert jumped.get_last_lr() == schedule.get_last_lr() and jumped.last_epoch == 25


def test_a_task_error_a_worker_logged_becomes_the_supervisors_message(tmp_path):
    log = tmp_path / "worker1.log"
    log.write_text(f"2025 INFO x: training\n2025 ERROR diloco.lab.baseline.dp_worker: {TASK_ERROR_PREFIX}task 'a.py:b': "
                   "the loss is nan at step 3\n")
    assert task_error(log) == f"task 'a.py:b': the loss is nan at step 3 (see {log})"
    assert "see" in task_error(tmp_path / "missing.log")


def test_compare_counts_the_tasks_tokens_and_unit():
    from diloco.lab.compare import CompareConfig

    cfg = CompareConfig(run=RunConfig(task_options=TINY_GPT), workers=2, steps=10)
    assert (cfg.tokens_per_step, cfg.eval_unit, cfg.tokens) == (4 * 16, "bits/byte", 2 * 10 * 4 * 16)


def test_a_broken_task_is_a_clear_error_before_any_run_directory(tmp_path, capsys):
    task = tmp_path / "broken.py"
    task.write_text("def build(ctx):\n    return 42\n")
    out = tmp_path / "run"
    assert cli.main(["baseline", "dp", "--task", f"{task}:build", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "returned int, not diloco.Task" in err and "Traceback" not in err
    assert not out.exists()


def test_a_cell_over_seeds_is_the_mean_with_its_spread_and_its_runs():
    from diloco.lab.compare import over_seeds

    runs = [{"eval_loss_final": 3.0, "goodput": 0.9, "eval_unit": "bits/byte", "run_dir": "a", "restarts": None},
            {"eval_loss_final": 3.2, "goodput": 0.7, "eval_unit": "bits/byte", "run_dir": "b", "restarts": None},
            {"eval_loss_final": 3.4, "goodput": 0.8, "eval_unit": "bits/byte", "run_dir": "c", "restarts": None}]
    cell = over_seeds(runs)
    assert cell["eval_loss_final"] == 3.2 and cell["goodput"] == 0.8
    assert cell["spread"] == {"eval_loss_final": 0.2, "goodput": 0.1}  # sample standard deviations
    assert cell["eval_unit"] == "bits/byte" and cell["restarts"] is None and "run_dir" not in cell  # runs differ there
    assert cell["seeds"] == runs
    assert over_seeds(runs[:1])["spread"] == {"eval_loss_final": 0.0, "goodput": 0.0}
    assert over_seeds([{"skipped": "torchft is not installed"}]) == {"skipped": "torchft is not installed"}
    # A run whose final model could not be evaluated makes its cell's figure nan, not a crash.
    failed = over_seeds([{"eval_loss_final": 3.5}, {"eval_loss_final": math.nan}])
    assert math.isnan(failed["eval_loss_final"]) and math.isnan(failed["spread"]["eval_loss_final"])


def test_compare_runs_each_cell_with_its_own_seeds():
    from diloco.lab.compare import CompareConfig

    cfg = CompareConfig(seed=3, seeds=3)
    assert [(cfg.seeded(i).run.seed, cfg.seeded(i).seed) for i in range(3)] == [(0, 3), (1, 4), (2, 5)]
    with pytest.raises(InvalidArgument, match="--seeds must be >= 1"):
        CompareConfig(seeds=0)


def test_compare_judges_each_target_from_the_cells_it_names():
    from diloco.lab.compare import targets

    def cell(**values):
        return {**values, "eval_unit": "bits/byte"}

    results = [
        {"scenario": "nofault", "systems": {
            "decoupled": cell(eval_loss_final=3.40, bytes_per_1k_tokens=20_000, start_s=6.0),
            "dp": cell(eval_loss_final=3.31, bytes_per_1k_tokens=1_400_000, start_s=4.0),
            "torchft": cell(eval_loss_final=3.35, bytes_per_1k_tokens=90_000, start_s=5.5)}},
        {"scenario": "mtbf30", "systems": {
            "decoupled": cell(uptime=1.0, goodput=0.95), "dp": cell(uptime=0.7, goodput=0.6),
            "torchft": cell(uptime=0.8, goodput=0.96)}},
        {"scenario": "hetero", "systems": {"decoupled": cell(goodput=0.93, eval_loss_final=3.45)}},
    ]
    met = {name: ok for name, ok, _ in targets(results, None)}
    assert met == {
        "mtbf30: Decoupled uptime >= 0.99 and goodput >= 0.9, above torchft's; DP uptime below Decoupled's": False,
        "nofault: Decoupled eval loss within 3 % of DP's": True,  # 3.40 <= 3.31 x 1.03 = 3.409
        "nofault: bytes on the wire per token >= 50x lower than dp's": True,  # 70x
        "nofault: bytes on the wire per token >= 5x lower than torchft's": False,  # 4.5x
        "nofault: launch to every worker's first step no slower than torchft's": False,
        "hetero: Decoupled goodput >= 0.9, eval within 3 % of its nofault value": True,  # 3.45 <= 3.502
    }
    results[1]["systems"]["torchft"]["goodput"] = 0.94
    assert all(ok for name, ok, _ in targets(results, None) if name.startswith("mtbf30"))
    assert targets([], None) == []  # nothing run, nothing judged


def test_ablations_run_the_chosen_variants_and_reuse_the_scenario_for_the_default(tmp_path, monkeypatch):
    """``compare --ablation H=8`` runs H=8 (its run config's H) for every seed; the default
    variant is the scenario's own Decoupled cell, not run again."""
    from diloco.lab import compare
    from diloco.cli.local import run as local_run

    launched = []

    def fake_run_local(local):
        launched.append(local)
        return {"tokens": 1000, "bytes_up": 10, "bytes_down": 30, "eval_unit": "bits/byte", "eval_loss_start": 8.0, "curve": [],
                "eval_loss_final": 3.0 + local.run.seed / 10, "goodput": 0.9, "step_goodput": 0.95,
                "learners_killed": 0, "run_dir": str(local.out), "wall_s": 1.0, "uptime": 1.0,
                "global_stall_s": 0.0, "start_s": 2.0}

    monkeypatch.setattr(local_run, "run_local", fake_run_local)
    cfg = compare.CompareConfig(seeds=2, out=tmp_path)
    scenario_cell = {"eval_loss_final": 3.5, "seeds": [{}, {}]}
    found = compare.run_ablations(cfg, ("nofault",), ("H=8",),
                                  [{"scenario": "nofault", "systems": {"decoupled": scenario_cell}}])
    assert list(found["nofault"]) == [compare.DEFAULT_VARIANT, "H=8"]
    assert found["nofault"][compare.DEFAULT_VARIANT] is scenario_cell
    assert [(l.run.sync_every_steps, l.run.seed) for l in launched] == [(8, cfg.run.seed), (8, cfg.run.seed + 1)]
    assert found["nofault"]["H=8"]["eval_loss_final"] == round(3.0 + (2 * cfg.run.seed + 1) / 20, 4)


def test_an_ablation_of_mtbf30_runs_the_scenarios_faults_with_the_changed_setting(tmp_path, monkeypatch):
    """An ablation runs its scenario exactly as the scenario's own Decoupled cell does
    (mtbf30: the same kill schedule per seed), with one setting changed."""
    from diloco.lab import compare
    from diloco.cli.local import run as local_run

    launched = []

    def fake_run_local(local):
        launched.append(local)
        return {"tokens": 1000, "bytes_up": 10, "bytes_down": 30, "eval_unit": "bits/byte", "eval_loss_start": 8.0, "curve": [],
                "eval_loss_final": 3.0, "goodput": 0.9, "step_goodput": 0.95, "learners_killed": 1,
                "run_dir": str(local.out), "wall_s": 1.0, "uptime": 1.0, "global_stall_s": 0.0, "start_s": 2.0}

    monkeypatch.setattr(local_run, "run_local", fake_run_local)
    cfg = compare.CompareConfig(seeds=2, out=tmp_path)
    scenario = compare.run_scenario(replace(cfg, systems=("decoupled",)), "mtbf30")
    own = list(launched)
    launched.clear()
    compare.run_ablations(cfg, ("mtbf30",), ("chain replies",), [scenario])
    assert [l.downlink for l in launched] == ["chain", "chain"] and {l.downlink for l in own} == {"condensed"}
    assert [l.chaos for l in launched] == [l.chaos for l in own]
    assert [l.chaos.kill_every_s for l in own] == [cfg.mtbf_s] * 2 and own[0].chaos.seed != own[1].chaos.seed


def test_a_cell_s_curve_is_the_mean_of_its_runs_point_by_point_with_their_range(tmp_path):
    from diloco.lab import compare

    runs = [{"curve": [[0, 8.0], [1000, 4.0], [2010, 3.0]]}, {"curve": [[0, 8.2], [1000, 5.0], [1990, 2.0]]}]
    assert compare.mean_curve({"seeds": runs}) == [(0, 8.1, 8.0, 8.2), (1000, 4.5, 4.0, 5.0), (2000, 2.5, 2.0, 3.0)]
    # A run without a curve, or with fewer points, leaves the cell without one (and out of the plot).
    assert compare.mean_curve({"seeds": [runs[0], {"curve": []}]}) is None
    assert compare.mean_curve({"seeds": [runs[0], {"curve": runs[1]["curve"][:2]}]}) is None
    results = [{"scenario": "nofault", "systems": {"dp": {"seeds": runs}, "decoupled": {"seeds": [{"curve": []}]}}}]
    assert compare.plot_curves(results, tmp_path / "curves.png", "bits/byte")
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    assert not compare.plot_curves([{"scenario": "nofault", "systems": {"dp": {"skipped": "why"}}}], tmp_path / "none.png", "x")
    assert not (tmp_path / "none.png").exists()


def test_a_workload_names_the_steps_and_the_lr_is_checked_before_any_run(tmp_path):
    from diloco.lab import compare

    assert compare.WORKLOADS == {"standard": 120, "long": 480, "longer": 960}
    assert compare.CompareConfig().steps == compare.WORKLOADS["standard"]
    with pytest.raises(InvalidArgument, match="lr must be a positive number"):
        compare.CompareConfig(lr=0.0)
    with pytest.raises(InvalidArgument, match="curve points must be >= 0"):
        compare.CompareConfig(curve_points=-1)
