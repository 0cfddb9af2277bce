"""The XLA learner on PJRT's CPU client with 4 devices: parameters, optimizer state and
batches really split over the devices, replies written back keep them split, bf16
compute trains with fp32 master values, and what it sends is bit for bit what a CPU
learner sends for the same values."""

import math

import pytest
import torch

from diloco.codec import encode
from diloco.errors import InvalidArgument
from diloco.manifest import manifest_of, synced_tensors
from diloco.task import TaskContext, build_task
from diloco.learner.core.sync import delta, merge_into
from diloco.learner.device import Device
from tests.checks import assert_same_tensors

from tests.xla.conftest import DEVICES

TASK = "diloco.tasks.byte_gpt:build"
OPTIONS = {"width": "64", "depth": "2", "heads": "4", "context": "32", "batch_size": "8"}


@pytest.fixture(scope="module")
def xla() -> Device:
    return Device("xla")  # one SPMD runtime per process: every test here shares it


def _task(device: Device, **options):
    task = build_task(TASK, TaskContext(0, 1, 0, device.torch, {**OPTIONS, **options}), None)
    device.place_model(task.model)
    return task


def _local_shards(tensor: torch.Tensor) -> list[tuple[int, ...]]:
    """The shapes of the pieces each device holds."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    xm.wait_device_ops()  # the step's execution may still be in flight
    (shards,) = torch_xla._XLAC._get_local_shards([tensor])
    return [tuple(shard.shape) for shard, _ in shards]


def _train(task, device: Device, steps: int) -> tuple[torch.optim.Optimizer, list[float]]:
    optimizer = torch.optim.AdamW(task.model.parameters(), lr=3e-3)
    batches, losses = iter(task.batches), []
    for _ in range(steps):
        with device.autocast():
            loss = task.loss(task.model, device.place_batch(next(batches)))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        device.step_done()
        losses.append(float(loss.detach()))
    return optimizer, losses


def test_parameters_optimizer_state_and_batches_are_split_over_every_device(xla):
    assert xla.num_devices == DEVICES == 4
    task = _task(xla)
    parameters = dict(task.model.named_parameters())
    # The head (256 x 64) splits along its 256 rows: each device holds 64 of them.
    assert _local_shards(parameters["head.weight"]) == [(64, 64)] * 4
    # down (64 x 256) along its larger dimension, the 256 columns.
    assert _local_shards(parameters["blocks.0.down.weight"]) == [(64, 64)] * 4
    # Every parameter of this model has a dimension 4 divides: all are split, none is whole anywhere.
    layout = xla.layout()
    assert layout == {"device": "xla", "devices": 4, "precision": "fp32", "split_parameters": len(parameters),
                      "split_share": 1.0}
    for name, parameter in parameters.items():
        shards = _local_shards(parameter)
        assert len(shards) == 4 and sum(map(math.prod, shards)) == parameter.numel() and shards[0] != tuple(parameter.shape), name
    optimizer, losses = _train(task, xla, 3)
    assert losses[-1] < losses[0]
    # AdamW's moments follow their parameter's split.
    state = optimizer.state[parameters["head.weight"]]
    assert _local_shards(state["exp_avg"]) == _local_shards(state["exp_avg_sq"]) == [(64, 64)] * 4
    # A batch of 8 rows: 2 per device.
    x, y = xla.place_batch(next(iter(task.batches)))
    assert _local_shards(x) == _local_shards(y) == [(2, 32)] * 4


def test_a_reply_written_into_the_model_is_split_again_with_its_values(xla):
    task = _task(xla)
    manifest = manifest_of(task.model)
    tensors, plan = synced_tensors(task.model, manifest), manifest.plan(4)
    head = dict(task.model.named_parameters())["head.weight"]
    split = xla.sharding(head)
    fragment = next(f.id for f in plan.fragments if any(p.tensor == "head.weight" for p in f.pieces))
    views = plan.gather(fragment, tensors)
    values = [torch.full(tuple(v.shape), 0.25) for v in views]
    merge_into(views, values, 0.0)
    assert xla.sharding(head) != split  # a write from host memory leaves it replicated ...
    xla.reshard()
    xla.step_done()
    assert xla.sharding(head) == split  # ... and reshard splits it again
    assert _local_shards(head) == [(64, 64)] * 4
    for view in plan.gather(fragment, tensors):
        assert torch.equal(xla.to_host(view), torch.full(tuple(view.shape), 0.25))


def test_reading_a_fragment_to_host_memory_compiles_nothing_and_reads_every_value(xla):
    """Reads put the host's shards together: no XLA graph, where ``.cpu()`` of a split
    tensor compiles one each time (scripts/xla_reads.py)."""
    task = _task(xla)
    manifest = manifest_of(task.model)
    plan, tensors = manifest.plan(4), synced_tensors(task.model, manifest)
    _train(task, xla, 1)
    before = xla.compiles()[0]
    host = [xla.fragment_to_host(plan, f, tensors) for f in range(plan.num_fragments) for _ in range(2)]
    assert xla.compiles()[0] == before > 0
    for i, values in enumerate(host):
        expected = [view.detach().cpu() for view in plan.gather(i // 2, tensors)]  # XLA's own read
        assert_same_tensors(values, expected, f"fragment {i // 2}")


def test_a_push_from_xla_is_byte_for_byte_a_push_from_the_cpu(xla):
    """The same values on either device give the same fragment deltas and the same int4
    (and fp32) payloads: an XLA learner and a CPU learner speak the same wire."""
    cpu = Device("cpu")
    on_cpu, on_xla = _task(cpu), _task(xla)
    _train(on_xla, xla, 2)  # trained values, not the init
    with torch.no_grad():
        for (name, p), q in zip(on_cpu.model.named_parameters(), on_xla.model.parameters()):
            p.copy_(xla.to_host(q))
    manifest = manifest_of(on_cpu.model)
    plan = manifest.plan(4)
    anchors = {f.id: [torch.randn(tuple(p.shape), generator=torch.Generator().manual_seed(f.id)) for p in f.pieces]
               for f in plan.fragments}
    sent = 0
    for f in plan.fragments:
        host = {name: [d.to_host(v) for v in plan.gather(f.id, synced_tensors(t.model, manifest))]
                for name, d, t in (("cpu", cpu, on_cpu), ("xla", xla, on_xla))}
        for codec in ("int4", "fp32"):
            payloads = {
                name: [encode(p.name, d, encoding=codec, block_size=64).payload
                       for p, d in zip(f.pieces, delta(anchors[f.id], values))]
                for name, values in host.items()
            }
            assert payloads["cpu"] and payloads["cpu"] == payloads["xla"], (f.id, codec)
            sent += len(payloads["cpu"])
    assert sent == 2 * sum(len(f.pieces) for f in plan.fragments)


def test_bf16_compute_trains_with_fp32_master_values():
    bf16 = Device("xla", precision="bf16")
    task = _task(bf16)
    _, losses = _train(task, bf16, 4)
    assert losses[-1] < losses[0]
    assert {p.dtype for p in task.model.parameters()} == {torch.float32}
    with bf16.autocast():
        logits, _ = task.model(bf16.place_batch(next(iter(task.batches)))[0])
    assert logits.dtype == torch.bfloat16


def test_a_batch_the_devices_cannot_split_is_refused_by_name(xla):
    task = _task(xla, batch_size="6")
    with pytest.raises(InvalidArgument, match=r"shape \(6, 32\) cannot be split over 4 XLA devices.*multiple of 4"):
        xla.place_batch(next(iter(task.batches)))


def test_a_snapshot_of_an_xla_learner_holds_host_tensors_only(xla):
    """What a learner records on a snapshot marker: a CPU learner restores it (a state
    that kept XLA tensors in its optimizer state would not load off XLA)."""
    from diloco.learner.slice import host_state

    task = _task(xla)
    optimizer, _ = _train(task, xla, 1)
    model_state, optimizer_state = host_state(task.model, optimizer)
    tensors = [*model_state.values(), *(t for s in optimizer_state["state"].values() for t in s.values())]
    assert len(tensors) > len(model_state) and {t.device.type for t in tensors} == {"cpu"}
    moments = [s["exp_avg"] for s in optimizer_state["state"].values()]
    assert_same_tensors(moments, [optimizer.state[p]["exp_avg"].cpu() for p in task.model.parameters()], "exp_avg")


def test_adamw_pooled_steps_on_xla_as_on_the_cpu(xla):
    """adamw-pooled's half-batch step on 4 devices (each half split over them again): the
    values and the noise statistics after a few steps are the CPU learner's."""
    from diloco.learner.config import LearnerConfig
    from diloco.learner.core.pooled import PooledAdamW
    from diloco.learner.runner import inner_optimizer, inner_step

    cpu = Device("cpu")
    tasks = {"cpu": _task(cpu), "xla": _task(xla)}
    cfg = LearnerConfig(inner_optimizer="adamw-pooled", warmup_steps=0, steps=10)
    for name, task in tasks.items():
        device = xla if name == "xla" else cpu
        optimizer, schedule = inner_optimizer(task, cfg, 4)
        assert isinstance(optimizer, PooledAdamW)
        batches = iter(task.batches)
        for _ in range(3):
            inner_step(TASK, task, next(batches), optimizer, schedule, cfg.grad_clip, device=device)
        task.optimizer_state = {n: {k: v.cpu() for k, v in optimizer.state[p].items()}
                                for n, p in task.model.named_parameters()}
    cpu_values = {n: p.detach() for n, p in tasks["cpu"].model.named_parameters()}
    for n, p in tasks["xla"].model.named_parameters():
        # (the devices sum in another order: a few 1e-6 after three steps of 3e-3)
        torch.testing.assert_close(p.detach().cpu(), cpu_values[n], rtol=1e-3, atol=1e-4, msg=n)
        noise = tasks["xla"].optimizer_state[n]["noise_sq"]
        torch.testing.assert_close(noise, tasks["cpu"].optimizer_state[n]["noise_sq"], rtol=1e-2, atol=1e-9, msg=n)
    assert any(float(s["noise_sq"].sum()) > 0 for s in tasks["xla"].optimizer_state.values())
