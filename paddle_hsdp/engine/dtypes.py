"""The dtypes a buffer moves and computes in, from its parameters' dtype and a
``MixedPrecisionPolicy``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import overload

import paddle


@overload
def as_dtype(d: None) -> None: ...
@overload
def as_dtype(d: paddle.dtype | str) -> paddle.dtype: ...
def as_dtype(d: paddle.dtype | str | None) -> paddle.dtype | None:
    """A dtype given as a string or a paddle dtype (a policy's), as a paddle dtype."""
    if d is None:
        return None
    if isinstance(d, str):
        # (Paddle's stubs give the static-graph VarType or DataType; in dynamic mode it
        # is a paddle.dtype)
        return paddle.base.framework.convert_np_dtype_to_dtype_(d)  # type: ignore[return-value]
    return d


def dtypes_of(dtype: paddle.dtype, mp_policy: object | None,
              ) -> tuple[paddle.dtype, paddle.dtype, paddle.dtype]:
    """``(gather, reduce, compute)`` dtypes of a buffer of ``dtype`` params under
    ``mp_policy`` (a ``MixedPrecisionPolicy`` or None); integer buffers ignore it."""
    floating = dtype in (paddle.float32, paddle.float64, paddle.float16, paddle.bfloat16)
    policy = mp_policy if floating else None
    gather = as_dtype(getattr(policy, "param_dtype", None)) or dtype
    reduce = as_dtype(getattr(policy, "reduce_dtype", None)) or gather
    return gather, reduce, compute_dtype_of(gather)


def element_size(dtype: paddle.dtype) -> int:
    return paddle.zeros([1], dtype=dtype).element_size()


def compute_dtype_of(param_dtype: paddle.dtype | str) -> paddle.dtype:
    """Paddle's CPU kernels have no bfloat16/float16 matmul: on CPU, parameters gathered
    in those dtypes are computed in float32 (keeping their rounding)."""
    param_dtype = as_dtype(param_dtype)
    low = param_dtype in (paddle.bfloat16, paddle.float16)
    return paddle.float32 if low and paddle.get_device().startswith("cpu") else param_dtype


@dataclass(frozen=True)
class BufferDtypes:
    """The dtypes one buffer keeps, moves and computes in (see :func:`dtypes_of`), and
    the element sizes every unshard and reshard reads for the memory report."""

    master: paddle.dtype  # the shards, their grads and the optimizer's state
    gather: paddle.dtype  # the all-gather
    reduce: paddle.dtype  # the reduce-scatter and the outer sync (not main grads')
    compute: paddle.dtype  # the gathered parameters the forward reads
    policy_reduce: paddle.dtype | None  # the policy's own reduce_dtype, if it names one
    master_size: int
    compute_size: int

    @classmethod
    def of(cls, dtype: paddle.dtype, mp_policy: object | None) -> BufferDtypes:
        gather, reduce, compute = dtypes_of(dtype, mp_policy)
        return cls(dtype, gather, reduce, compute,
                   as_dtype(getattr(mp_policy, "reduce_dtype", None)),
                   element_size(dtype), element_size(compute))
