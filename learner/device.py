"""Where the model trains: cpu, cuda or xla. torch_xla is imported only when chosen, so
CPU and GPU installs never need it; parameters are copied to host memory for syncing."""

from __future__ import annotations

import importlib

import torch

from diloco.errors import FailedPrecondition


class Device:
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._xm = None
        if kind == "cuda":
            if not torch.cuda.is_available():
                raise FailedPrecondition("device cuda requested, but torch sees no CUDA device (torch.cuda.is_available() is False)")
            self.torch = torch.device("cuda")
        elif kind == "xla":
            try:
                self._xm = importlib.import_module("torch_xla.core.xla_model")
            except ImportError:
                raise FailedPrecondition(
                    "device xla requested, but torch_xla is not installed (pip install 'diloco[tpu]' on a TPU host)"
                ) from None
            self.torch = self._xm.xla_device()
        else:
            self.torch = torch.device("cpu")

    def step_done(self) -> None:
        """End of an inner step: XLA executes the traced graph here (a host sync point)."""
        if self._xm is not None:
            self._xm.mark_step()

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().to("cpu", torch.float32)
