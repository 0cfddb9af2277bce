"""A learner that is a whole multi-host slice: one process per host, one learner toward
the shards.

On a multi-host TPU slice every host runs the same SPMD program over one mesh of all the
slice's chips, so every host must issue the same device operations in the same order.
Host 0, the **leader**, is the learner: it joins the coordinator, heartbeats, bootstraps,
pushes and receives replies. The other hosts, the **followers**, never talk to the
coordinator or the shards. They build the same task from the leader's run config, train
the same steps, read the same fragments to host memory at the same steps (the sends'
reads follow the fixed send schedule; the leader discards nothing, they discard all),
and write into the model exactly what the leader writes: at the end of every inner step
the leader broadcasts over the slice link (torch.distributed, gloo, on the slice port) the
global fragments it wrote at that step, how many snapshot reads it made, and whether the
learner stops. A follower applies them before its next step, so the slice stays one
model, and stops on the same step. The link's timeout bounds every wait: a follower whose
leader died fails, and the slice (a JobSet restarts it whole) comes back as a new learner.

Messages, in order: the run (config, learner id, planned learners), then one per inner
step, then the last writes at close.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from diloco.config import RunConfig
from diloco.errors import FailedPrecondition, InvalidArgument
from diloco.manifest import manifest_of, synced_tensors
from diloco.learner.config import LearnerConfig
from diloco.learner.core.schedule import fragments_due, send_offsets
from diloco.learner.core.sync import Write, write_into
from diloco.learner.device import Device
from diloco.learner.summary import LossReports, Summary
from diloco.learner.telemetry import LearnerTelemetry

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SliceStep:
    """What the leader did to the model at one step boundary, for the followers to repeat."""

    writes: list[Write] = field(default_factory=list)
    state_reads: int = 0
    """Times the whole learner state was read to host memory (snapshot markers recorded)."""
    stop: bool = False
    """The learner stops here: the loop ends before the next step."""


class SliceLink:
    """The slice's hosts, host 0 the leader: ``share`` broadcasts the leader's message."""

    def __init__(self, hosts: int, index: int, leader: str, timeout_s: float) -> None:
        if hosts < 2 or not 0 <= index < hosts:
            raise InvalidArgument(f"a slice of {hosts} hosts has host indices 0..{hosts - 1}, got {index}")
        host, _, port = leader.rpartition(":")
        if not host or not port.isdigit():
            raise InvalidArgument(f"--slice-leader takes HOST:PORT (host 0's address on the slice port), got {leader!r}")
        import torch.distributed as dist

        self.hosts, self.index, self._dist = hosts, index, dist
        logger.info("slice host %d of %d: connecting to the leader at %s", index, hosts, leader)
        dist.init_process_group("gloo", init_method=f"tcp://{leader}", world_size=hosts, rank=index,
                                timeout=timedelta(seconds=timeout_s))

    @property
    def leader(self) -> bool:
        return self.index == 0

    def share(self, message=None):
        """The leader's ``message``, on every host (the leader passes it, followers get it)."""
        box = [message if self.leader else None]
        self._dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        if self._dist.is_initialized():
            self._dist.destroy_process_group()


def host_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict | None]:
    """The model's and optimizer's state in host memory (a snapshot's learner state)."""
    model_state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if optimizer is None:
        return model_state, None
    on_host = torch.utils._pytree.tree_map(
        lambda value: value.detach().cpu() if isinstance(value, torch.Tensor) else value, optimizer.state_dict())
    return model_state, on_host


class SliceFollower(LossReports):
    """A follower host: the ``Learner`` interface the task runner drives, repeating the
    leader's writes instead of syncing."""

    def __init__(self, model: torch.nn.Module, run: RunConfig, learner_id: str, cfg: LearnerConfig, link: SliceLink,
                 device: Device, optimizer: torch.optim.Optimizer | None) -> None:
        self.model, self.run, self.cfg, self.link, self.device, self.optimizer = model, run, cfg, link, device, optimizer
        self.learner_id = f"{learner_id}/host{link.index}"
        self.summary = Summary(self.learner_id)
        self.telemetry = LearnerTelemetry(self.learner_id)
        self.stop = threading.Event()
        self.joined_in_progress = False  # a slice evaluates at step 0 on every host, as its leader does
        self.manifest = manifest_of(model)
        self.plan = self.manifest.plan(run.fragments)
        self.tensors = synced_tensors(model, self.manifest)
        self.offsets = send_offsets(self.plan.num_fragments, run.sync_every_steps)
        self._step = 0
        self._closed = False
        for fragment in range(self.plan.num_fragments):  # the leader's reads of its initial values
            self._read(fragment)
        self._repeat(link.share())  # the bootstrap's writes

    @property
    def should_stop(self) -> bool:
        return self.stop.is_set()

    def event(self, kind: str, **fields) -> None:
        """Followers keep no event tape (the leader's is the learner's)."""

    def begin_training(self) -> None:
        """The leader records it."""

    def step(self, tokens: int) -> None:
        self.summary.inner_steps += 1
        self.summary.tokens += tokens
        for fragment in fragments_due(self._step, self.offsets, self.run.sync_every_steps):
            self._read(fragment)
        self._step += 1
        self._repeat(self.link.share())

    def close(self, reason: str = "finished", *, failed: bool = False):
        if not self._closed:
            self._closed = True
            if not failed:
                self._repeat(self.link.share())  # the leader's last writes, as it drained
            self.stop.set()
            self.link.close()
        return self.summary

    def _read(self, fragment: int) -> None:
        """What the leader reads to host memory to send ``fragment`` (a collective on a
        multi-host mesh): read, and dropped."""
        self.device.fragment_to_host(self.plan, fragment, self.tensors)

    def _repeat(self, message: SliceStep) -> None:
        if not isinstance(message, SliceStep):
            raise FailedPrecondition(f"{self.learner_id}: the slice leader sent {type(message).__name__}, not a step")
        for _ in range(message.state_reads):
            host_state(self.model, self.optimizer)
        for write in message.writes:
            write_into(self.plan.gather(write.fragment, self.tensors), write)
        if message.writes:
            self.device.reshard()
        if message.stop:
            self.stop.set()
