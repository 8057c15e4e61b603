"""The dtypes a buffer moves and computes in, from its parameters' dtype and a
``MixedPrecisionPolicy``."""

from __future__ import annotations

import paddle


def as_dtype(d):
    if d is None:
        return None
    return paddle.base.framework.convert_np_dtype_to_dtype_(d) if isinstance(d, str) else d


def dtypes_of(dtype, mp_policy) -> tuple:
    """``(gather, reduce, compute)`` dtypes of a buffer of ``dtype`` params under
    ``mp_policy`` (a ``MixedPrecisionPolicy`` or None); integer buffers ignore it."""
    floating = dtype in (paddle.float32, paddle.float64, paddle.float16, paddle.bfloat16)
    policy = mp_policy if floating else None
    gather = as_dtype(getattr(policy, "param_dtype", None)) or dtype
    reduce = as_dtype(getattr(policy, "reduce_dtype", None)) or gather
    return gather, reduce, compute_dtype_of(gather)


def element_size(dtype) -> int:
    return paddle.zeros([1], dtype=dtype).element_size()


def compute_dtype_of(param_dtype):
    """Paddle's CPU kernels have no bfloat16/float16 matmul: on CPU, parameters gathered
    in those dtypes are computed in float32 (keeping their rounding)."""
    param_dtype = as_dtype(param_dtype)
    low = param_dtype in (paddle.bfloat16, paddle.float16)
    return paddle.float32 if low and paddle.get_device().startswith("cpu") else param_dtype
