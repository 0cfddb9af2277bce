"""Decoupled DiLoCo over gRPC: the shared kernel (codec, fragment plan, clocks, CLI)."""

__version__ = "0.1.0"
