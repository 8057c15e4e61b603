"""Let Paddle 3.3's tensor-parallel layers and sequence parallel run on CPU (gloo).

``ColumnParallelLinear`` / ``RowParallelLinear`` / ``VocabParallelEmbedding``,
``ParallelCrossEntropy``, PaddleFormers' ``parallel_matmul`` and sequence parallel's
``ReduceScatterOp`` call things that have no CPU implementation, or a wrong one:

* ``ProcessGroupGloo.all_reduce_on_calc_stream``: gloo inherits a stub that raises; on
  CPU a synchronous all-reduce is what "on the calc stream" means;
* the ``c_identity`` op (no CPU kernel): its forward is a copy (its backward all-reduce
  lives in the mp layers' own PyLayers);
* ``c_concat`` (no CPU kernel; ``tensor_parallel_output=False`` logits),
  ``c_softmax_with_cross_entropy`` (no CPU kernel; ``tensor_parallel_output=True``) and
  ``c_embedding`` (its float64 CPU grad is garbage): their definitions in
  :mod:`.cpu_mp_ops`, built from ops with CPU kernels and paddle_hsdp's collectives;
* ``paddle.distributed.stream.reduce_scatter`` over a gloo group (gloo has none; sequence
  parallel's reduce-scatter): :func:`paddle_hsdp.comm.reduce_scatter`'s fallback;
* ``broadcast_input_data`` (fleet's ``TensorParallel`` wrapper broadcasts each forward's
  inputs over the mp group): it asserts a GPU, XPU or custom device; on CPU the same
  broadcasts, in place, without the copy to a device.

Each replacement takes the CPU path only for CPU tensors (the collective for gloo
groups) and calls Paddle's original everywhere else, so device tensors and NCCL keep
Paddle's kernels untouched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import paddle
from paddle.base import core
from paddle.distributed.communication import stream

from ..comm import collectives as comm
from . import cpu_mp_ops
from .patching import replace

if TYPE_CHECKING:
    from paddle.distributed.communication.group import Group
    from paddle.distributed.fleet.base.topology import HybridCommunicateGroup

_installed = False
# Paddle's own functions the replacements call off CPU, by name (tests swap them here).
PADDLE: dict = {}


def _on_cpu(tensor: object) -> bool:
    """A dygraph tensor on the CPU (a static graph's values keep Paddle's ops)."""
    return isinstance(tensor, paddle.Tensor) and tensor.place.is_cpu_place()


def _patch_c_identity() -> None:
    PADDLE["c_identity"] = paddle._C_ops.c_identity

    def c_identity(tensor: paddle.Tensor, *args: Any, **kwargs: Any) -> paddle.Tensor:
        if _on_cpu(tensor):
            return paddle.assign(tensor)
        return PADDLE["c_identity"](tensor, *args, **kwargs)

    replace(paddle._C_ops, "c_identity", c_identity,
            "no CPU kernel; on CPU its forward is a copy (tensor-parallel layers)")


def _patch_c_concat() -> None:
    PADDLE["c_concat"] = paddle._C_ops.c_concat

    def c_concat(x: paddle.Tensor, rank: int, nranks: int, ring_id: int, *args: Any,
                 **kwargs: Any) -> paddle.Tensor:
        if _on_cpu(x):
            return cpu_mp_ops.concat(x, cpu_mp_ops.group_of(ring_id))
        return PADDLE["c_concat"](x, rank, nranks, ring_id, *args, **kwargs)

    replace(paddle._C_ops, "c_concat", c_concat,
            "no CPU kernel; on CPU an all-gather along the last axis (its grad: this "
            "rank's piece)")


def _patch_c_softmax_with_cross_entropy() -> None:
    PADDLE["c_softmax_with_cross_entropy"] = paddle._C_ops.c_softmax_with_cross_entropy

    def c_softmax_with_cross_entropy(logits: paddle.Tensor, label: paddle.Tensor,
                                     ignore_index: int, ring_id: int, rank: int, nranks: int,
                                     *args: Any,
                                     **kwargs: Any) -> tuple[paddle.Tensor, paddle.Tensor]:
        if _on_cpu(logits):
            return cpu_mp_ops.cross_entropy(logits, label, cpu_mp_ops.group_of(ring_id),
                                            ignore_index)
        return PADDLE["c_softmax_with_cross_entropy"](logits, label, ignore_index, ring_id,
                                                      rank, nranks, *args, **kwargs)

    replace(paddle._C_ops, "c_softmax_with_cross_entropy", c_softmax_with_cross_entropy,
            "no CPU kernel; on CPU the vocabulary-parallel cross entropy from CPU ops and "
            "three all-reduces")


def _patch_c_embedding() -> None:
    PADDLE["c_embedding"] = paddle._C_ops.c_embedding

    def c_embedding(table: paddle.Tensor, index: paddle.Tensor, start_index: int = 0,
                    vocab_size: int = -1, *args: Any, **kwargs: Any) -> paddle.Tensor:
        if _on_cpu(table):
            return cpu_mp_ops.embedding(table, index, start_index)
        return PADDLE["c_embedding"](table, index, start_index, vocab_size, *args, **kwargs)

    replace(paddle._C_ops, "c_embedding", c_embedding,
            "the CPU kernel's float64 grad is garbage; on CPU an embedding of the shifted "
            "ids times an in-range mask")


def _patch_stream_reduce_scatter() -> None:
    PADDLE["reduce_scatter"] = stream.reduce_scatter

    def reduce_scatter(tensor: paddle.Tensor,
                       tensor_or_tensor_list: paddle.Tensor | Sequence[paddle.Tensor],
                       op: int = paddle.distributed.ReduceOp.SUM, group: Group | None = None,
                       sync_op: bool = True, use_calc_stream: bool = False) -> Any:
        if group is None:
            group = paddle.distributed.collective._get_global_group()
        if not comm.is_gloo(group):
            return PADDLE["reduce_scatter"](tensor, tensor_or_tensor_list, op, group, sync_op,
                                            use_calc_stream)
        if op != paddle.distributed.ReduceOp.SUM:
            raise NotImplementedError(
                f"reduce_scatter(op={op}) over a gloo group: paddle_hsdp's gloo fallback "
                "sums only (op=paddle.distributed.ReduceOp.SUM)")
        cpu_mp_ops.reduce_scatter(tensor, tensor_or_tensor_list, group)
        return None if sync_op else comm.Handle.completed()  # done: gloo blocks

    replace(stream, "reduce_scatter", reduce_scatter,
            "gloo has no reduce-scatter (sequence parallel's): paddle_hsdp's fallback")


def _patch_broadcast_input_data() -> None:
    from paddle.distributed.fleet.meta_parallel import tensor_parallel
    from paddle.distributed.fleet.utils import hybrid_parallel_util as util

    PADDLE["broadcast_input_data"] = util.broadcast_input_data

    def broadcast_input_data(hcg: HybridCommunicateGroup, *inputs: Any, **kwargs: Any) -> Any:
        if paddle.get_device().split(":")[0] != "cpu":
            return PADDLE["broadcast_input_data"](hcg, *inputs, **kwargs)
        for data in (inputs, kwargs):  # Paddle's own per-element broadcasts, on CPU
            if data:
                util._broadcast_nested_data(hcg, "cpu", paddle.CPUPlace(), data)
        return inputs, kwargs

    why = "asserts a GPU/XPU/custom device; on CPU the same broadcasts, without the copy"
    replace(util, "broadcast_input_data", broadcast_input_data, why)
    replace(tensor_parallel, "broadcast_input_data", broadcast_input_data, why)


def install() -> None:
    global _installed
    if _installed:
        return
    # The inherited method only raises "Unimplemented" for gloo.
    replace(core.ProcessGroupGloo, "all_reduce_on_calc_stream",
            lambda self, tensor, op: self.all_reduce(tensor, op, True).wait(),
            "gloo inherits a stub that raises; on CPU a synchronous all-reduce is it")
    _patch_c_identity()
    _patch_c_concat()
    _patch_c_softmax_with_cross_entropy()
    _patch_c_embedding()
    _patch_stream_reduce_scatter()
    _patch_broadcast_input_data()
    _installed = True
