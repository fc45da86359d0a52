"""The dtypes and element widths of the 16-bit tests (docs/protocol.md 5.6), shared by the C loop's
and the sparse loop's byte tests."""

from __future__ import annotations

import numpy as np
import pytest

# every (dtype, wire bits) but float32 at 32, which the files' older tests cover
WIRE16_CASES = [
    pytest.param(dtype, bits, id=f"{dtype}-{bits}")
    for dtype in ("float32", "bfloat16", "float16")
    for bits in (16, 32)
    if (dtype, bits) != ("float32", 32)
]


def as_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """x (float32) as `dtype` ("bfloat16": ml_dtypes'), within float16's range for float16."""
    if dtype == "float16":
        x = np.clip(x, -6e4, 6e4)
    if dtype == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        return x.astype(ml_dtypes.bfloat16)
    return x.astype(dtype)
