"""The public API around a user's own training loop (``diloco.Learner``) against real
in-process shards: a model the project has never seen (tied weights, BatchNorm, an int
buffer, bf16 parameters), learners that start from different initial models, and tasks
that misbehave: each fails that learner with one TaskError line, the shards lose nothing."""

import asyncio
import contextlib
import dataclasses
import io
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import diloco
from diloco import auth
from diloco.config import RunConfig
from diloco.errors import FailedPrecondition, InvalidArgument
from diloco.task import TaskError
from diloco.learner.membership import Membership
from diloco.learner.runner import run_task
from diloco.syncer.config import RoundConfig, SyncerConfig
from diloco.syncer.server import ShardServer, ShardServerConfig
from tests.grpc.conftest import SECRET, run

FAULTY = str(Path(__file__).resolve().parents[1] / "tasks" / "faulty.py") + ":build"


class Net(nn.Module):
    """Tied embedding/head, BatchNorm (float running stats + an int64 counter)."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.embed = nn.Embedding(16, 8, dtype=dtype)
        self.norm = nn.BatchNorm1d(8, dtype=dtype)
        self.head = nn.Linear(8, 16, bias=False, dtype=dtype)
        self.head.weight = self.embed.weight

    def forward(self, x):
        return self.head(torch.relu(self.norm(self.embed(x))))


@contextlib.asynccontextmanager
async def shards(tmp_path, count, learners, fragments=3):
    run_cfg = RunConfig(fragments=fragments, sync_every_steps=6, overlap_steps=2)
    servers = []
    for m in range(count):
        cfg = SyncerConfig(shard_id=m, num_shards=count, rounds=RoundConfig(quorum=1, grace_mode="off"))
        server = ShardServer(run_cfg, cfg, ShardServerConfig(secret=SECRET, data_dir=tmp_path / f"s{m}", static_learners=learners))
        servers.append((server, f"127.0.0.1:{await server.start()}"))
    try:
        yield run_cfg, servers
    finally:
        for server, _ in servers:
            await server.stop()


def own_loop(run_cfg, addresses, name, model, steps=30, seed=0):
    """What a user writes: their model, optimizer and loss; one ``step`` per optimizer step."""
    member = Membership(name, auth.Credential(name, secret=SECRET), run_cfg, dict(enumerate(addresses)), 0.0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    losses = []
    with diloco.Learner(model, member, diloco.LearnerConfig(), optimizer=optimizer) as learner:
        for _ in range(steps):
            x = torch.randint(0, 16, (32,), generator=g)
            loss = nn.functional.cross_entropy(model(x).float(), (x + 1) % 16)  # learn the successor
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            learner.step(tokens=x.numel())
            losses.append(float(loss.detach()))
    return learner, losses


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_own_loop_with_tied_weights_buffers_and_bf16(tmp_path, dtype):
    async def scenario():
        async with shards(tmp_path, 2, ("L0", "L1")) as (run_cfg, servers):
            addresses = [a for _, a in servers]
            torch.manual_seed(0)
            first = Net(dtype)
            torch.manual_seed(1)  # a different initial model: it must start from the shards' values
            second = Net(dtype)
            (a, losses_a), (b, losses_b) = await asyncio.gather(
                asyncio.to_thread(own_loop, run_cfg, addresses, "L0", first, 40, 0),
                asyncio.to_thread(own_loop, run_cfg, addresses, "L1", second, 40, 1),
            )
            for learner, losses in ((a, losses_a), (b, losses_b)):
                assert learner.summary.replies_applied > 0 and learner.summary.pushes_dropped == 0
                assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.3
            assert {first.embed.weight.dtype, second.head.weight.dtype} == {dtype}
            assert first.head.weight is first.embed.weight  # still tied
            plan = a.plan
            names = {p.tensor for f in plan.fragments for p in f.pieces}
            assert "embed.weight" in names and "head.weight" not in names and "norm.num_batches_tracked" not in names
            buffers = {p.tensor for f in plan.fragments for p in f.pieces if p.buffer}
            assert buffers == {"norm.running_mean", "norm.running_var"}
            # Each fragment was initialised by one learner; both bootstrapped from the shards.
            assert sorted(a.summary.initialized_fragments + b.summary.initialized_fragments) == [0, 1, 2]
            # The running statistics were merged: the shards' values moved off BatchNorm's init.
            for server, _ in servers:
                core = server.runtime.core
                for fragment_id, state in core.fragments.items():
                    assert state.version >= 3
                    for piece, value in zip(state.fragment.pieces, state.params):
                        assert value.dtype == np.float32  # deltas merged in fp32
                        if piece.tensor == "norm.running_var":
                            assert not np.allclose(value, 1.0)

    run(scenario())


def test_a_learner_whose_model_differs_is_refused_naming_the_tensor(tmp_path):
    async def scenario():
        async with shards(tmp_path, 1, ("L0", "L1")) as (run_cfg, servers):
            addresses = [a for _, a in servers]
            await asyncio.to_thread(own_loop, run_cfg, addresses, "L0", Net(), 6)
            other = nn.Sequential(nn.Linear(3, 3))
            member = Membership("L1", auth.Credential("L1", secret=SECRET), run_cfg, dict(enumerate(addresses)), 0.0)
            with pytest.raises(FailedPrecondition, match="shard 0 holds another model"):
                await asyncio.to_thread(diloco.Learner, other, member)

    run(scenario())


@pytest.mark.parametrize("mode, message", [
    ("raise", "raised RuntimeError: cannot open the dataset"),
    ("type", "returned dict, not diloco.Task"),
    ("frozen", "no trainable parameters"),
    ("nan", "the loss is nan at inner step 3"),
    ("short", "its batches ended after 5 batches"),
    ("scalar", "not a scalar"),
    ("tokens", "not a non-negative int"),
])
def test_a_misbehaving_task_fails_its_learner_and_the_shards_lose_nothing(tmp_path, mode, message):
    async def scenario():
        async with shards(tmp_path, 1, ("L0", "L1"), fragments=2) as (run_cfg, servers):
            run_cfg = dataclasses.replace(run_cfg, task=FAULTY, task_options={"fail": mode})
            addresses = [a for _, a in servers]
            cfg = diloco.LearnerConfig(steps=24, eval_every_steps=12, warmup_steps=2)

            def learn(name):
                member = Membership(name, auth.Credential(name, secret=SECRET), run_cfg, dict(enumerate(addresses)), 0.0)
                return run_task(member, cfg)

            good = await asyncio.to_thread(learn, "L0")
            core = servers[0][0].runtime.core
            before = {f: (s.version, [p.copy() for p in s.params]) for f, s in core.fragments.items()}
            with pytest.raises(TaskError) as error:
                await asyncio.to_thread(learn, "L1")
            assert FAULTY in str(error.value) and message in str(error.value) and "\n" not in str(error.value)
            # Whatever the failing learner pushed before it failed was finite and merged as
            # any push; the shard still serves, and a learner trains on.
            for f, s in core.fragments.items():
                assert all(np.isfinite(p).all() for p in s.params)
            if mode in ("raise", "type", "frozen", "scalar", "tokens"):  # failed before its first push
                assert all(core.fragments[f].version == v for f, (v, _) in before.items())
            again = await asyncio.to_thread(learn, "L0")
            assert again.summary.inner_steps == 24 and again.summary.eval_loss_final < good.summary.eval_loss_start
            assert good.summary.eval_unit == "mse"

    run(scenario())


def test_join_a_coordinator_train_leave_and_a_different_model_is_refused(tmp_path):
    """``diloco.Learner.join``, as the README shows it: the coordinator fixes the run's model
    from the first learner; a learner with another model is refused before it trains."""
    from tests.grpc.coordinator_fixtures import admin_stub, running_coordinator
    from diloco.v1 import common_pb2, coordinator_pb2

    async def scenario():
        async with shards(tmp_path, 1, (), fragments=2) as (run_cfg, servers):  # the coordinator's P
            shard, address = servers[0]
            async with running_coordinator(tmp_path, shards=(address,)) as coordinator:
                shard.follow(coordinator.address)
                model = Net()
                optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

                def own_loop_joined():
                    learner = diloco.Learner.join(model, coordinator=coordinator.address, insecure=True,
                                                  join_token=auth.join_credential(SECRET, "test", 64), optimizer=optimizer)
                    with learner:
                        for step in range(24):
                            x = torch.randint(0, 16, (32,))
                            loss = nn.functional.cross_entropy(model(x), (x + 1) % 16)
                            loss.backward()
                            optimizer.step()
                            optimizer.zero_grad()
                            learner.step(tokens=x.numel())
                        # Its losses, for the status page: they ride the heartbeats.
                        learner.report_loss(train=1.25, eval=1.5, unit="nats")
                        with pytest.raises(InvalidArgument, match="report_loss: train must be a finite number"):
                            learner.report_loss(train=float("nan"))
                        deadline = time.monotonic() + 10
                        while coordinator.runtime.membership.learner(learner.learner_id).train_loss is None:
                            assert time.monotonic() < deadline, "no heartbeat carried the loss"
                            time.sleep(0.05)
                    return learner

                learner = await asyncio.to_thread(own_loop_joined)
                assert learner.learner_id == "L0" and learner.summary.replies_applied > 0
                reported = coordinator.runtime.membership.learner("L0")
                assert (reported.train_loss, reported.eval_loss, reported.loss_unit) == (1.25, 1.5, "nats")
                assert (learner.summary.train_loss, learner.summary.eval_loss_final) == (1.25, 1.5)
                assert coordinator.runtime.curves.to_json()["L0"][-1][1] == 1.25
                assert coordinator.runtime.run.plan_hash == learner.plan.plan_hash
                with pytest.raises(FailedPrecondition, match="model differs from the run's: .*embed.weight"):
                    await asyncio.to_thread(diloco.Learner.join, nn.Embedding(3, 3), coordinator.address,
                                            auth.join_credential(SECRET, "test", 64), insecure=True)
                async with admin_stub(coordinator.address) as (stub, md):
                    gone = await stub.ListLearners(coordinator_pb2.ListLearnersRequest(include_gone=True), metadata=md)
                    assert {l.learner_id: l.state for l in gone.learners} == {  # L1 cannot train this run
                        "L0": common_pb2.LEARNER_STATE_LEFT, "L1": common_pb2.LEARNER_STATE_FAILED}

    run(scenario())


def test_a_learner_of_a_seeding_coordinator_sends_and_fetches_none_of_the_model(tmp_path):
    """On a scarce link a learner's start was its upload of the fp32 initial values of each
    fragment it found empty. The pinning coordinator seeds the shards itself, and a
    learner that finds a shard empty waits for the seed: here the shard starts only after
    the learner has joined, and the learner sends none of the model, and downloads none
    (the shard is at the values it built)."""
    from diloco import rpc
    from diloco.syncer.config import ShardServerConfig, SyncerConfig
    from diloco.syncer.server import ShardServer
    from tests.grpc.conftest import TINY
    from tests.grpc.coordinator_fixtures import running_coordinator, wait_for
    from tests.seeded import task_model

    [port] = rpc.free_ports("127.0.0.1", 1)
    address = f"127.0.0.1:{port}"

    async def scenario():
        async with running_coordinator(tmp_path, shards=(address,), pin_model=True) as coordinator:
            joining = asyncio.ensure_future(asyncio.to_thread(
                diloco.Learner.join, task_model(TINY, learner_index=3), coordinator.address,
                auth.join_credential(SECRET, "test", 64), insecure=True))
            await wait_for(lambda: coordinator.runtime.membership.learners, "the learner's join")
            shard = ShardServer(TINY, SyncerConfig(), ShardServerConfig(secret=SECRET, data_dir=tmp_path / "shard",
                                                                        port=port, coordinator=coordinator.address))
            await shard.start()
            try:
                learner = await joining
                try:
                    stats = learner.streamer.stats
                    assert (stats.bytes_initialize, learner.summary.initialized_fragments) == (0, [])
                    assert stats.bytes_down == 0
                    assert {f: s.base_version for f, s in learner.book.fragments.items()} == {0: 0, 1: 0}
                    assert coordinator.seeded == {0: [0, 1]}
                finally:
                    await asyncio.to_thread(learner.close, "done")
            finally:
                await shard.stop()

    run(scenario())


def test_a_learner_records_snapshots_through_fsspec_and_survives_a_failed_write(tmp_path):
    """A marker's directory may be any fsspec URL (memory:// here: this process's store).
    A write that fails is logged and leaves the snapshot unreported (it fails at the
    coordinator); the learner keeps training."""
    import fsspec

    from diloco import snapshots

    async def scenario():
        async with shards(tmp_path, 1, ("L0",)) as (run_cfg, servers):
            member = Membership("L0", auth.Credential("L0", secret=SECRET), run_cfg, {0: servers[0][1]}, 0.0)
            model = Net()
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
            reports = []

            def train():
                with diloco.Learner(model, member, diloco.LearnerConfig(), optimizer=optimizer) as learner:
                    learner.on_recorded = lambda snapshot_id, clock, files: reports.append((snapshot_id, files))
                    blocker = tmp_path / "not-a-directory"
                    blocker.write_text("")
                    learner.markers.put((1, str(blocker / "000001")))  # cannot be written
                    learner.markers.put((2, "memory://snapshots/000002"))
                    for _ in range(12):
                        x = torch.randint(0, 16, (32,))
                        loss = nn.functional.cross_entropy(model(x), (x + 1) % 16)
                        loss.backward()
                        optimizer.step()
                        optimizer.zero_grad()
                        learner.step(tokens=x.numel())
                    return learner

            learner = await asyncio.to_thread(train)
            assert learner.summary.inner_steps == 12
            assert [r[0] for r in reports] == [2] and learner.snapshot_epoch == 2
            [(name, size, sha256)] = reports[0][1]
            data = snapshots.read_file(f"memory://snapshots/000002/{name}")
            assert name == "L0.pt" and len(data) == size
            state = torch.load(io.BytesIO(data), weights_only=True)
            assert state["learner_id"] == "L0" and set(state["model"]) == set(model.state_dict())
            fsspec.filesystem("memory").rm("/snapshots", recursive=True)

    run(scenario())


def test_a_learner_that_starts_while_a_shard_is_down_waits_for_it(tmp_path):
    """A shard restarting when a learner starts: the learner retries (with backoff) until
    the shard answers, then initialises, bootstraps and trains, instead of failing with
    UNAVAILABLE."""
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        late_port = s.getsockname()[1]

    async def scenario():
        run_cfg = RunConfig(fragments=2, sync_every_steps=6, overlap_steps=2)
        cfg = SyncerConfig(shard_id=0, num_shards=1, rounds=RoundConfig(quorum=1, grace_mode="off"))
        late = ShardServer(run_cfg, cfg, ShardServerConfig(secret=SECRET, port=late_port, data_dir=tmp_path / "s0",
                                                           static_learners=("L0",)))
        training = asyncio.ensure_future(asyncio.to_thread(own_loop, run_cfg, [f"127.0.0.1:{late_port}"], "L0", Net(), 12))
        await asyncio.sleep(1.5)  # the learner is retrying meanwhile
        assert not training.done()
        started = time.monotonic()
        await late.start()
        try:
            learner, _ = await asyncio.wait_for(training, 60)
            assert learner.summary.inner_steps == 12 and learner.summary.replies_applied > 0
            assert time.monotonic() - started < 30
        finally:
            await late.stop()

    run(scenario())


@pytest.mark.parametrize("skip_start_eval", [False, True])
def test_a_learner_joining_a_trained_model_takes_its_first_step_without_evaluating_first(tmp_path, skip_start_eval):
    """The first learner evaluates the seed model at step 0 (unless told not to); the next
    one bootstraps a model already trained and starts at once (its first evaluation is its
    first periodic one)."""
    async def scenario():
        async with shards(tmp_path, 1, ("L0", "L1"), fragments=2) as (run_cfg, servers):
            run_cfg = dataclasses.replace(run_cfg, task=FAULTY)
            addresses = [a for _, a in servers]
            cfg = diloco.LearnerConfig(steps=12, eval_every_steps=6, warmup_steps=2, skip_start_eval=skip_start_eval)

            def learn(name):
                member = Membership(name, auth.Credential(name, secret=SECRET), run_cfg, dict(enumerate(addresses)), 0.0)
                return run_task(member, cfg)

            first = await asyncio.to_thread(learn, "L0")
            second = await asyncio.to_thread(learn, "L1")
            assert not first.joined_in_progress and second.joined_in_progress
            assert [step for step, _, _ in first.summary.eval_history] == [6, 12] if skip_start_eval else [0, 6, 12]
            assert [step for step, _, _ in second.summary.eval_history] == [6, 12]

    run(scenario())
