"""Let Paddle 3.3's tensor-parallel layers run on CPU (gloo), for tests and CPU users.

``ColumnParallelLinear`` / ``RowParallelLinear`` / ``VocabParallelEmbedding`` call two
things that have no CPU implementation: ``ProcessGroupGloo.all_reduce_on_calc_stream``
(gloo inherits a stub that raises) and the ``c_identity`` op (no CPU kernel). On CPU a
synchronous all-reduce is what "on the calc stream" means, and ``c_identity``'s forward
is a copy (its backward all-reduce lives in the mp layers' own PyLayers). Device
tensors and other backends keep Paddle's implementations untouched.
"""

from __future__ import annotations

import paddle
from paddle.base import core

from .patching import replace

_installed = False


def install() -> None:
    global _installed
    if _installed:
        return
    # The inherited method only raises "Unimplemented" for gloo.
    replace(core.ProcessGroupGloo, "all_reduce_on_calc_stream",
            lambda self, tensor, op: self.all_reduce(tensor, op, True).wait(),
            "gloo inherits a stub that raises; on CPU a synchronous all-reduce is it")

    original_identity = paddle._C_ops.c_identity

    def c_identity(tensor, *args, **kwargs):
        if tensor.place.is_cpu_place():
            return paddle.assign(tensor)
        return original_identity(tensor, *args, **kwargs)

    replace(paddle._C_ops, "c_identity", c_identity,
            "no CPU kernel; on CPU its forward is a copy (tensor-parallel layers)")
    _installed = True
