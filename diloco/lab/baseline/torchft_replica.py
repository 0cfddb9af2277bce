"""One torchft replica, or the torchft Lighthouse, as a process (started by
``diloco.lab.baseline.torchft_peer``). Needs the optional extra ``diloco[peers]``.

A replica is one replica group of one process: its own TCPStore, a torchft ``Manager``
(gloo, CPU) that asks the Lighthouse for a quorum, and torchft's Streaming DiLoCo
(``torchft.local_sgd.DiLoCo``) wrapped around the learners' inner loop: the run's task
built as learner L<id> of ``diloco local`` builds it (model, share of the data, loss) with
the same inner optimizer, schedule and clipping. The model is cut into P fragments of
whole tensors (torchft syncs ``nn.Module`` fragments); one
fragment is all-reduced every H/P inner steps, so each is synced every H steps, with
``fragment_sync_delay`` = tau steps of overlap (capped below H/P, as torchft requires).

Usage:
``python -m diloco.lab.baseline.torchft_replica lighthouse --run-dir DIR``
``python -m diloco.lab.baseline.torchft_replica replica --run-dir DIR --replica I --attempt A
--lighthouse ADDR --store-port P --start-step S``
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn

from diloco.lab.baseline.common import (
    JsonlWriter, advance_schedule, ring_allreduce_bytes, run_worker, save_torch, skip_batches, worker_steps,
)
from diloco.lab.baseline.torchft_peer import TorchftConfig
from diloco.files import atomic_write, atomic_write_json
from diloco.task import TaskError, checked_tokens
from diloco.cli.metrics import curve_marks, curve_path
from diloco.learner.runner import inner_optimizer, inner_step


def lighthouse(run_dir: Path, host: str) -> None:
    """Serve the Lighthouse on ``host`` (127.0.0.1, or the emulated sites' hub) until
    killed; its address goes to a file."""
    from torchft.coordination import LighthouseServer

    cfg = TorchftConfig.read(run_dir)
    server = LighthouseServer(bind=f"{host}:0", min_replicas=1, join_timeout_ms=cfg.join_timeout_ms,
                              quorum_tick_ms=100, heartbeat_timeout_ms=cfg.heartbeat_timeout_ms)
    # (it names itself by the host name, which a replica on an emulated site cannot resolve)
    port = server.address().rsplit(":", 1)[1]
    atomic_write(run_dir / "lighthouse", f"http://{host}:{port}".encode())
    while True:
        time.sleep(3600)


def fragment_modules(model: nn.Module, fragments: int) -> list[nn.Module]:
    """Whole tensors into ``fragments`` modules, largest first into the lightest (LPT, as
    diloco's plan does, without splitting tensors). The modules hold the model's own
    Parameter objects, so torchft's in-place updates are the model's."""
    bins: list[tuple[int, nn.Module]] = [(0, nn.Module()) for _ in range(fragments)]
    for name, param in sorted(model.named_parameters(), key=lambda np: (-np[1].numel(), np[0])):
        i = min(range(fragments), key=lambda j: (bins[j][0], j))
        load, module = bins[i]
        module.register_parameter(name.replace(".", "__"), param)
        bins[i] = (load + param.numel(), module)
    return [module for _, module in bins]


def _tensor_bytes(value: object) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def replica(run_dir: Path, index: int, attempt: int, lighthouse_addr: str, store: tuple[str, int], address: str,
            start_step: int) -> None:
    from torch.distributed import TCPStore
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    cfg, task = TorchftConfig.for_worker(run_dir, index)
    inner = cfg.inner()
    spec = cfg.run.task
    model = task.model
    optimizer, schedule = inner_optimizer(task, inner)
    advance_schedule(schedule, start_step)  # a replacement continues the dead one's budget
    batches = skip_batches(spec, task.batches, start_step)
    fragments = fragment_modules(model, cfg.fragments)
    outer = [
        torch.optim.SGD(f.parameters(), lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=cfg.outer_momentum > 0)
        for f in fragments
    ]
    timeline = JsonlWriter(run_dir / "timeline" / f"replica{index}-attempt{attempt}.jsonl")
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    def load_state_dict(state: dict) -> None:
        # A heal: this replica adopts a peer's model and AdamW state (its own steps since
        # its last sync are dropped). Received besides: the fragments' global copies and
        # outer-optimizer state (momentum buffers when momentum > 0).
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        received = _tensor_bytes(state) + model_bytes * (2 if cfg.outer_momentum > 0 else 1)
        timeline.write(kind="heal", t=time.time(), bytes=received)

    timeout = timedelta(seconds=cfg.timeout_s)
    # Its own store and its advertised name: where the other replicas reach it (heals, the
    # cross-replica group), 127.0.0.1 or its emulated site's address.
    own_store = TCPStore(address, 0, None, True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load_state_dict, state_dict=state_dict,
        min_replica_size=1, use_async_quorum=False, store_addr=address, store_port=own_store.port,
        rank=0, world_size=1, lighthouse_addr=lighthouse_addr, replica_id=f"replica{index}", hostname=address,
        timeout=timeout, quorum_timeout=timedelta(seconds=cfg.quorum_timeout_s), connect_timeout=timeout,
        init_sync=False,  # every replica starts from the same seeded model
    )
    fragment_delay = min(cfg.run.overlap_steps, cfg.run.sync_every_steps // cfg.fragments - 1)
    diloco = DiLoCo(manager, fragments, optimizer, outer, sync_every=cfg.run.sync_every_steps,
                    backup_device=torch.device("cpu"), pin_memory=False, fragment_sync_delay=fragment_delay,
                    fragment_update_alpha=cfg.run.merge_alpha)
    fragment_bytes = [sum(p.numel() * p.element_size() for p in f.parameters()) for f in fragments]
    for p, frag in enumerate(diloco._fragments):  # noqa: SLF001 - observe each sync and its outcome
        frag.prepare_sync = _observed_prepare(frag.prepare_sync, p, timeline)
        frag.perform_sync = _observed(frag.perform_sync, p, manager, fragment_bytes[p], timeline)

    if attempt == 0:
        # The first launch starts together (as diloco local's learners and the DP workers
        # do); a replacement joins whenever it is up.
        supervisor = TCPStore(store[0], store[1], None, False, timeout=timedelta(seconds=cfg.startup_timeout_s))
        supervisor.add("ready", 1)
        supervisor.wait(["go"])
    timeline.write(kind="ready", t=time.time(), step=start_step, attempt=attempt, fragment_delay=fragment_delay)
    slow = cfg.slow_factor(index)
    names = {id(param): name for name, param in model.named_parameters()}

    def global_state() -> dict[str, torch.Tensor]:
        """The model with every fragment's global copy (what the syncs agreed on)."""
        state = model.state_dict()
        for frag_module, frag in zip(fragments, diloco._fragments):  # noqa: SLF001 - the global copies
            for local_name, param in frag_module.named_parameters():
                state[names[id(param)]] = frag.original_parameters[local_name].clone()
        return state

    # Replica 0 saves the global model as the run passes each share of its steps.
    curve_steps = set(curve_marks(cfg.steps, cfg.curve_points)) if index == 0 else set()
    with diloco:
        for step, t0, batch in worker_steps(cfg, f"replica {index}", batches, start_step):
            def checked(loss: torch.Tensor) -> None:
                if not math.isfinite(loss.item()):
                    raise TaskError(f"task {spec!r}: the loss is {loss.item()} at inner step {step}")
                if slow > 1.0:
                    time.sleep((slow - 1.0) * (time.time() - t0))  # a simulated slower accelerator

            # torchft's hooks on the optimizer's step prepare / perform the due fragment sync.
            value = inner_step(spec, task, batch, optimizer, schedule, inner.grad_clip, before_update=checked).item()
            tokens = checked_tokens(spec, task.tokens(batch))
            timeline.write(kind="step", step=step + 1, t0=t0, t1=time.time(), loss=round(value, 5), tokens=tokens)
            if step + 1 in curve_steps:
                save_torch(curve_path(run_dir, (step + 1) * cfg.workers * tokens, ".pt"), global_state())
    save_torch(run_dir / f"global-replica{index}.pt", global_state())
    atomic_write_json(run_dir / f"global-replica{index}.json", {"manager_step": manager.current_step()})
    timeline.write(kind="done", t=time.time(), manager_step=manager.current_step())
    timeline.close()
    manager.shutdown(wait=False)



def _observed_prepare(prepare_sync, fragment: int, timeline: JsonlWriter):
    def prepare() -> None:
        prepare_sync()  # the pseudo-gradient is taken here; later steps on it are overwritten
        timeline.write(kind="prepare", t=time.time(), fragment=fragment)

    return prepare


def _observed(perform_sync, fragment: int, manager, fragment_bytes: int, timeline: JsonlWriter):
    def perform() -> bool:
        committed = perform_sync()
        members = manager.num_participants()
        sent = ring_allreduce_bytes(fragment_bytes, members) // max(members, 1)
        timeline.write(kind="sync", t=time.time(), fragment=fragment, committed=bool(committed),
                       participants=members, bytes=sent, manager_step=manager.current_step())
        return committed

    return perform


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diloco.lab.baseline.torchft_replica")
    roles = parser.add_subparsers(dest="role", required=True)
    lh = roles.add_parser("lighthouse")
    lh.add_argument("--run-dir", type=Path, required=True)
    lh.add_argument("--host", default="127.0.0.1")
    rp = roles.add_parser("replica")
    rp.add_argument("--run-dir", type=Path, required=True)
    rp.add_argument("--replica", type=int, required=True)
    rp.add_argument("--attempt", type=int, required=True)
    rp.add_argument("--lighthouse", required=True)
    rp.add_argument("--store-host", default="127.0.0.1")
    rp.add_argument("--store-port", type=int, required=True)
    rp.add_argument("--address", default="127.0.0.1", help="the address this replica binds and gives its peers")
    rp.add_argument("--start-step", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.role == "lighthouse":
        lighthouse(args.run_dir, args.host)
        return 0
    return run_worker(replica, args.run_dir, args.replica, args.attempt, args.lighthouse,
                      (args.store_host, args.store_port), args.address, args.start_step)


if __name__ == "__main__":
    sys.exit(main())
