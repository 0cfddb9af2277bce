"""Where the model trains: cpu, cuda or xla. torch_xla is imported only when chosen, so
CPU and GPU installs never need it; parameters are copied to host memory for syncing.

On XLA a learner uses every device of its host (every TPU chip; on PJRT's CPU client,
``CPU_NUM_DEVICES`` of them) through torch-xla SPMD: one mesh axis, ``fsdp``, over all
devices. Each parameter is split along its largest dimension that the device count
divides (replicated when none does), so the optimizer state that follows it is split the
same way (FSDP / ZeRO-3 on GSPMD); each batch is split along its first dimension (data
parallel). XLA inserts the all-gathers and reduce-scatters. Syncing reads a fragment's
values to host memory one fragment at a time (``to_host``): no device ever holds the
whole model, and the host holds the anchors (one fp32 copy of the model) plus one
fragment's values and delta. A reply written into a parameter (``copy_``) leaves it
replicated; ``reshard`` splits it again.

``precision`` bf16 runs the forward pass and the loss under autocast in bfloat16; the
parameters, their optimizer state and the deltas sent stay fp32.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Mapping

import torch

from diloco.errors import FailedPrecondition, InvalidArgument
from diloco.fragments import FragmentPlan
from diloco.learner.config import PRECISIONS

MESH_AXIS = "fsdp"


class Device:
    def __init__(self, kind: str, precision: str = "fp32") -> None:
        if precision not in PRECISIONS:
            raise InvalidArgument(f"precision must be one of {PRECISIONS}, got {precision!r}")
        self.kind, self.precision = kind, precision
        self.num_devices = 1
        self._xla = self._xm = self._spmd = self._mesh = None
        self._sharded: list[tuple[torch.Tensor, tuple, str]] = []
        """(parameter, its partition spec, XLA's sharding string once split)."""
        self._parameters = 0
        self._addressable = 1
        if kind == "cuda":
            if not torch.cuda.is_available():
                raise FailedPrecondition("device cuda requested, but torch sees no CUDA device (torch.cuda.is_available() is False)")
            self.torch = torch.device("cuda")
        elif kind == "xla":
            try:
                self._xla = importlib.import_module("torch_xla")
                self._xm = importlib.import_module("torch_xla.core.xla_model")
                self._spmd = importlib.import_module("torch_xla.distributed.spmd")
                runtime = importlib.import_module("torch_xla.runtime")
            except ImportError:
                raise FailedPrecondition(
                    "device xla requested, but torch_xla is not installed (pip install 'diloco[tpu]' on a TPU host, "
                    "or -c constraints-xla.txt -e '.[xla]' for PJRT's CPU client)"
                ) from None
            if not runtime.is_spmd():
                runtime.use_spmd()  # before any tensor is on the device
            self.num_devices = runtime.global_runtime_device_count()
            self._addressable = runtime.addressable_runtime_device_count()
            self._mesh = self._spmd.Mesh(list(range(self.num_devices)), (self.num_devices,), (MESH_AXIS,))
            self.torch = self._xla.device()
        else:
            self.torch = torch.device("cpu")

    def place_model(self, model: torch.nn.Module) -> None:
        """Move the model here; on XLA, split its parameters over the devices."""
        model.to(self.torch)
        if self._mesh is None:
            return
        self._sharded = []
        self._parameters = sum(p.numel() for p in model.parameters())
        for parameter in model.parameters():
            dims = [d for d, size in enumerate(parameter.shape) if size % self.num_devices == 0]
            if not dims:
                continue  # too small to split (a bias of odd length): replicated
            split = max(dims, key=lambda d: parameter.shape[d])
            spec = tuple(MESH_AXIS if d == split else None for d in range(parameter.dim()))
            self._spmd.mark_sharding(parameter, self._mesh, spec)
            self._sharded.append((parameter, spec, self.sharding(parameter)))

    def layout(self) -> dict:
        """Where the model trains, for the learner's log and events: the device kind, how
        many devices, the precision, and on XLA the share of parameter values split."""
        layout = {"device": self.kind, "devices": self.num_devices, "precision": self.precision}
        if self._mesh is not None:
            split = sum(p.numel() for p, _, _ in self._sharded)
            layout["split_parameters"] = len(self._sharded)
            layout["split_share"] = round(split / self._parameters, 4) if self._parameters else 0.0
        return layout

    def place_batch(self, batch):
        """The batch (tensors, or tuples/lists/dicts of them) for a training step; on XLA,
        moved to the devices split along the first dimension, which the device count must
        divide."""
        if self._mesh is None:
            return batch
        for tensor in torch.utils._pytree.tree_leaves(batch):
            if isinstance(tensor, torch.Tensor) and (tensor.dim() == 0 or tensor.shape[0] % self.num_devices):
                rows = tensor.shape[0] if tensor.dim() else "a scalar"
                raise InvalidArgument(
                    f"a batch tensor of shape {tuple(tensor.shape)} cannot be split over {self.num_devices} XLA devices "
                    f"(its first dimension, {rows}, must be a multiple of {self.num_devices}): make the task's batch "
                    f"size a multiple of {self.num_devices}, or set CPU_NUM_DEVICES / the slice to a divisor of it"
                )

        def spec(tensor: torch.Tensor):
            return self._spmd.ShardingSpec(self._mesh, (MESH_AXIS,) + (None,) * (tensor.dim() - 1))

        return torch.utils._pytree.tree_map(
            lambda t: self._xm.send_cpu_data_to_device(t, self.torch, input_sharding=spec(t))[0]
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" else t,
            batch,
        )

    def autocast(self):
        """The context of a training forward pass and loss."""
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.torch.type, dtype=torch.bfloat16)

    def reshard(self) -> None:
        """Split again the parameters that writes from host memory left replicated."""
        for parameter, spec, split in self._sharded:
            if self.sharding(parameter) != split:
                self._spmd.mark_sharding(parameter, self._mesh, spec)

    def sharding(self, tensor: torch.Tensor) -> str:
        """XLA's sharding of ``tensor`` (``{devices=[4,1]0,1,2,3}``), or '' off XLA."""
        return self._xla._XLAC._get_xla_sharding_spec(tensor) if self._xla is not None else ""

    def compiles(self) -> tuple[int, float]:
        """XLA graphs compiled so far and the seconds spent compiling them ((0, 0.0) off XLA).
        A learner compiles a handful (the step, the evaluation, the reads and writes of a
        sync); more means a graph changes from step to step."""
        if self._xla is None:
            return 0, 0.0
        metrics = importlib.import_module("torch_xla.debug.metrics")
        data = metrics.metric_data("CompileTime")
        return (data[0], data[1] / 1e9) if data else (0, 0.0)

    def step_done(self) -> None:
        """End of an inner step: XLA executes the traced graph here (a host sync point)."""
        if self._xla is not None:
            self._xla.sync()

    def fragment_to_host(self, plan: FragmentPlan, fragment_id: int, tensors: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """The fragment's values in host memory, fp32: each tensor it has a piece of is read
        whole, then sliced on the host (on the CPU, views of the model's own fp32 tensors)."""
        whole = {piece.tensor: self.to_host(tensors[piece.tensor]) for piece in plan.fragments[fragment_id].pieces}
        return plan.gather(fragment_id, whole)

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` in host memory, fp32. On XLA, a tensor whose every shard this host
        holds is put together from the shards (reading a split tensor through ``.cpu()``
        compiles a new XLA graph each time: scripts/xla_reads.py); a multi-host
        tensor takes ``.cpu()``, which every host of the mesh must call."""
        if self._xla is not None and tensor.device.type == "xla" and self._addressable == self.num_devices:
            self._xm.wait_device_ops()  # the step that wrote it may still run
            shards = self._spmd.XLAShardedTensor(tensor.detach()).local_shards
            if len(shards) == self.num_devices:
                host = torch.empty(tuple(tensor.shape), dtype=torch.float32)
                for shard in shards:  # even splits (place_model): no padding to drop
                    host[shard.indices if shard.indices is Ellipsis else tuple(shard.indices)] = shard.data
                return host
        return tensor.detach().to("cpu", torch.float32)
