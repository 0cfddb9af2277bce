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
