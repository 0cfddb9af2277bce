"""A learner that is a multi-host slice (``diloco.learner.slice``): two host processes, a leader
that syncs with a real shard process and a follower that repeats the leader's writes over
the slice link. On the CPU each host holds the whole model (on a TPU slice the hosts
share one SPMD mesh), so the test can check what the protocol promises: the follower
ends with the leader's model bit for bit and on the leader's step, however the leader
stops; a follower whose leader dies fails instead of waiting forever."""

import multiprocessing
import signal
import socket
import subprocess
import sys
import threading

import pytest
import torch

from tests.checks import assert_same_tensors
from tests.polling import poll

pytestmark = pytest.mark.cluster

TINY = ["--width", "32", "--depth", "1", "--heads", "2", "--context", "32", "--fragments", "2", "--sync-every", "4",
        "--batch-size", "4"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _host(index: int, leader: str, shard: str, secret: str, out: str, steps: int, stop_after_s: float | None,
          device: str) -> None:
    """One host of the slice, as `diloco learner --slice-*` runs it, saving its final model."""
    from diloco.cli.common import build_run_config
    from diloco.command import build_parser
    from diloco.learner.config import LearnerConfig
    from diloco.learner.runner import follow_slice, run_task
    from diloco.learner.server import static_membership
    from diloco.learner.slice import SliceLink

    torch.set_num_threads(1)
    cfg = LearnerConfig(device=device, steps=steps, eval_every_steps=25, slice_timeout_s=60)
    link = SliceLink(2, index, leader, cfg.slice_timeout_s)
    if index == 0:
        run = build_run_config(build_parser().parse_args(["learner", *TINY]))
        stop = threading.Event()
        if stop_after_s is not None:
            threading.Timer(stop_after_s, stop.set).start()
        trained = run_task(static_membership(run, "L0", secret, [shard]), cfg, stop=stop, slice_link=link)
    else:
        trained = follow_slice(cfg, link)
    model = {k: v.detach().cpu() for k, v in trained.model.state_dict().items()}
    torch.save({"model": model, "summary": trained.summary.__dict__}, f"{out}/host{index}.pt")


@pytest.fixture
def shard(tmp_path):
    """A real shard process for learner L0, with the TINY model's run config."""
    (tmp_path / "secret").write_text("s")
    proc = subprocess.Popen(
        [sys.executable, "-m", "diloco", "--insecure", "syncer", "--learners", "L0", "--data-dir", str(tmp_path),
         "--port-file", str(tmp_path / "port"), "--secret-file", str(tmp_path / "secret"), *TINY],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        poll(lambda: (tmp_path / "port").exists(), "the shard", timeout_s=60, procs=[("shard", proc)])
        yield (tmp_path / "port").read_text().strip()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def run_slice(tmp_path, shard: str, steps: int, stop_after_s: float | None = None, device: str = "cpu") -> dict[int, dict]:
    """Two hosts of a slice, each a process, to the end; their final models and summaries."""
    spawn = multiprocessing.get_context("spawn")
    leader = f"127.0.0.1:{_free_port()}"
    hosts = [spawn.Process(target=_host, args=(i, leader, shard, "s", str(tmp_path), steps, stop_after_s, device))
             for i in (0, 1)]
    for host in hosts:
        host.start()
    for host in hosts:
        host.join(timeout=240)
    assert [host.exitcode for host in hosts] == [0, 0]
    return {i: torch.load(tmp_path / f"host{i}.pt", weights_only=False) for i in (0, 1)}


def test_the_follower_ends_with_the_leaders_model_on_the_leaders_step(tmp_path, shard):
    hosts = run_slice(tmp_path, shard, steps=60)
    leader, follower = hosts[0]["summary"], hosts[1]["summary"]
    # The leader synced: replies were written into its model (and so into the follower's).
    assert leader["pushes_acked"] > 0 and leader["replies_applied"] > 0, leader
    assert leader["inner_steps"] == follower["inner_steps"] == 60 and leader["tokens"] == follower["tokens"]
    assert follower["learner_id"] == "L0/host1" and follower["pushes_sent"] == 0
    models = [hosts[i]["model"] for i in (0, 1)]
    assert list(models[0]) == list(models[1])
    assert_same_tensors(list(models[1].values()), list(models[0].values()), "the follower's model")


def test_a_stop_ends_every_host_on_the_same_step_with_the_same_model(tmp_path, shard):
    """The leader is asked to stop mid-run (a drain or SIGTERM sets the same event): the
    stop it decides at a step boundary is the follower's too, and its last writes (the
    replies it applied while draining) reach the follower."""
    hosts = run_slice(tmp_path, shard, steps=100_000, stop_after_s=6.0)
    leader, follower = hosts[0]["summary"], hosts[1]["summary"]
    assert 0 < leader["inner_steps"] == follower["inner_steps"] < 100_000, (leader, follower)
    assert leader["replies_applied"] > 0
    assert_same_tensors(list(hosts[1]["model"].values()), list(hosts[0]["model"].values()), "the follower's model")


def test_a_follower_whose_leader_dies_fails(tmp_path, shard):
    """The slice is all or nothing: a follower left alone exits non-zero (its JobSet then
    restarts the slice), long before its link timeout."""
    leader = f"127.0.0.1:{_free_port()}"
    common = [sys.executable, "-m", "diloco", "--insecure", "--log-level", "INFO", "learner", "--shards", shard, "--learner-id", "L0",
              "--secret-file", str(tmp_path / "secret"), "--steps", "100000", "--slice-hosts", "2",
              "--slice-leader", leader, "--slice-timeout-s", "120", *TINY]
    procs = [subprocess.Popen([*common, "--slice-index", str(i), "--summary", str(tmp_path / f"s{i}.json")],
                              stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"host{i}.log", "w")) for i in (0, 1)]
    try:
        poll(lambda: "bootstrapped" in (tmp_path / "host0.log").read_text()
             and "follows the slice's leader" in (tmp_path / "host1.log").read_text(), "the slice to train", timeout_s=90,
             procs=[("leader", procs[0]), ("follower", procs[1])])
        procs[0].send_signal(signal.SIGKILL)
        assert procs[1].wait(timeout=60) != 0  # well inside its 120 s link timeout
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_slice_flags_are_checked_before_anything_starts(tmp_path):
    for flags, why in ((["--slice-hosts", "2"], "needs --slice-leader HOST:PORT"),
                       (["--slice-hosts", "2", "--slice-index", "2", "--slice-leader", "127.0.0.1:1"], "host indices 0..1"),
                       (["--slice-hosts", "2", "--slice-leader", "nowhere"], "--slice-leader takes HOST:PORT")):
        proc = subprocess.run([sys.executable, "-m", "diloco", "--insecure", "learner", "--learner-id", "L0",
                               "--shards", "x:1",
                               *flags], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and why in proc.stderr and "Traceback" not in proc.stderr, (flags, proc.stderr)
