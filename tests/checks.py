"""Assertions shared by the tests, written so that they cannot pass on nothing."""

import numpy as np
import torch


def _array(value) -> np.ndarray:
    return value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)


def assert_same_tensors(actual, expected, what: str = "tensors") -> None:
    """Two non-empty sequences of tensors (torch or numpy) of the same length, equal bit
    for bit, one by one (``all(... zip(...))`` passes when either side is empty)."""
    actual, expected = [_array(a) for a in actual], [_array(b) for b in expected]
    assert actual and len(actual) == len(expected), f"{what}: {len(actual)} tensors against {len(expected)}"
    for i, (a, b) in enumerate(zip(actual, expected)):
        assert a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b), f"{what}: tensor {i} differs"


def assert_mirrored(anchor, mirror) -> None:
    """A learner's ``anchor`` (tensors of a fragment) is what the shard's ``mirror`` of it
    believes, to within the drift the shard accounts (``diloco.syncer.core.mirrors``): exactly when
    none; else the gap's squared norm within 4x the accounted one (a sum of independent
    roundings: its expectation)."""
    anchor = [_array(a).reshape(-1) for a in anchor]
    believed = mirror.believed()
    assert anchor and len(anchor) == len(believed), f"{len(anchor)} tensors against {len(believed)}"
    if mirror.drift_sq == 0:
        assert_same_tensors(anchor, believed, "anchor against its mirror")
        return
    gap = sum(float(np.sum((a.astype(np.float64) - b) ** 2)) for a, b in zip(anchor, believed))
    assert gap <= 4 * mirror.drift_sq, f"the anchor is {gap:.3g} off its mirror, the shard accounts {mirror.drift_sq:.3g}"
