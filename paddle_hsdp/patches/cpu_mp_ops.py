"""CPU definitions of the tensor-parallel ops Paddle 3.3 has no (right) CPU kernel for.

Each is the op's definition written with ops that have CPU kernels and collectives
through :mod:`paddle_hsdp.comm` (gloo); :mod:`.cpu_compat` routes CPU tensors here and
leaves every other place with Paddle's kernels.

* ``c_concat``: the all-gather of every mp rank's piece along the last axis
  (``tensor_parallel_output=False`` logits). Backward: this rank's piece of the output
  grad, as Paddle's ``c_concat`` grad (the output, and so its grad, is the same on every
  mp rank).
* ``c_softmax_with_cross_entropy``: cross entropy over logits split along the vocabulary
  (``ParallelCrossEntropy``, ``tensor_parallel_output=True``): the max and the sum of
  exponentials over the whole vocabulary and the label's logit (on the rank that holds
  it) are all-reduced, so every rank gets the full-vocabulary loss. Backward: softmax
  minus the label's one-hot on this rank's columns, times the loss grad; 0 for
  ``ignore_index`` labels.
* ``c_embedding``: the vocabulary-parallel lookup (rows of ``[start, start + rows)``,
  zeros elsewhere) as an ordinary embedding of the shifted ids times an in-range mask:
  the CPU kernel's float64 grad is garbage (values up to 1e306 measured here).
* ``reduce_scatter`` (``paddle.distributed.stream``) over a gloo group: sequence
  parallel's reduce-scatter, gloo having none; :func:`paddle_hsdp.comm.reduce_scatter`'s
  fallback.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import paddle
import paddle.nn.functional as F
from paddle import Tensor
from paddle.autograd import PyLayer
from paddle.distributed import collective
from paddle.distributed.communication.group import Group

from ..comm import collectives as comm

if TYPE_CHECKING:
    from paddle.autograd import PyLayerContext


def group_of(ring_id: int) -> Group:
    """The process group Paddle's ops name by ``ring_id`` (the group's id)."""
    group = collective._get_group_map().get(ring_id)
    if group is None:
        raise ValueError(f"no process group with id {ring_id} (ring_id of a "
                         "tensor-parallel op): was fleet.init called?")
    return group


class _Concat(PyLayer):
    """``c_concat`` on CPU: every rank's ``x`` side by side along the last axis."""

    @staticmethod
    def forward(ctx: PyLayerContext, x: Tensor, group: Group) -> Tensor:
        # (a PyLayerContext takes any attribute for backward, as Paddle's docs show; its
        # stub declares none)
        ctx.rank, ctx.nranks = group.rank, group.nranks  # type: ignore[attr-defined]
        gathered = paddle.empty([group.nranks] + list(x.shape), dtype=x.dtype)
        comm.all_gather_into(gathered, x.contiguous(), group, tag="mp_concat")
        return paddle.concat(paddle.unbind(gathered, axis=0), axis=-1)

    @staticmethod
    def backward(ctx: PyLayerContext, dy: Tensor) -> Tensor:
        rank, nranks = ctx.rank, ctx.nranks  # type: ignore[attr-defined]  # set in forward
        return paddle.split(dy, nranks, axis=-1)[rank].contiguous()


def concat(x: Tensor, group: Group) -> Tensor:
    return _Concat.apply(x, group)


class _VocabParallelCrossEntropy(PyLayer):
    """``c_softmax_with_cross_entropy`` on CPU; returns ``(softmax, loss)`` as the op."""

    @staticmethod
    def forward(ctx: PyLayerContext, logits: Tensor, label: Tensor, group: Group,
                ignore_index: int) -> tuple[Tensor, Tensor]:
        part = logits.shape[-1]
        start = group.rank * part
        row_max = paddle.max(logits, axis=-1, keepdim=True)
        comm.all_reduce(row_max, group, op="max", tag="mp_cross_entropy")
        shifted = logits - row_max
        exps = paddle.exp(shifted)
        sum_exps = paddle.sum(exps, axis=-1, keepdim=True)
        comm.all_reduce(sum_exps, group, tag="mp_cross_entropy")
        mine = (label >= start) & (label < start + part)  # the label's column is here
        local = paddle.where(mine, label - start, paddle.zeros_like(label))
        picked = paddle.take_along_axis(shifted, local, axis=-1) * mine.astype(logits.dtype)
        comm.all_reduce(picked, group, tag="mp_cross_entropy")
        ignored = label == ignore_index
        loss = paddle.where(ignored, paddle.zeros_like(picked), paddle.log(sum_exps) - picked)
        softmax = exps / sum_exps
        ctx.save_for_backward(softmax, local, mine, ignored)
        ctx.mark_non_differentiable(softmax)
        return softmax, loss

    # (Paddle's stub types backward's result as tensors only; None is the grad of an
    # input that needs none, here the label)
    @staticmethod
    def backward(ctx: PyLayerContext, d_softmax: Tensor,  # type: ignore[override]
                 d_loss: Tensor) -> tuple[Tensor, None]:
        softmax, local, mine, ignored = ctx.saved_tensor()
        one_hot = F.one_hot(local.squeeze(-1), softmax.shape[-1]).astype(softmax.dtype)
        grad = softmax - one_hot * mine.astype(softmax.dtype)
        keep = paddle.logical_not(ignored).astype(softmax.dtype)
        return grad * (d_loss * keep), None


def cross_entropy(logits: Tensor, label: Tensor, group: Group,
                  ignore_index: int) -> tuple[Tensor, Tensor]:
    return _VocabParallelCrossEntropy.apply(logits, label, group, ignore_index)


def embedding(table: Tensor, index: Tensor, start_index: int) -> Tensor:
    """``c_embedding``: row ``index - start_index`` of ``table`` where it exists, else
    zeros; its grad comes from ``F.embedding``'s and the mask's CPU kernels."""
    rows = table.shape[0]
    mine = (index >= start_index) & (index < start_index + rows)
    local = paddle.where(mine, index - start_index, paddle.zeros_like(index))
    return F.embedding(local, table) * mine.unsqueeze(-1).astype(table.dtype)


def reduce_scatter(tensor: Tensor, tensor_or_tensor_list: Tensor | Sequence[Tensor],
                   group: Group) -> None:
    """Sum the input over ``group`` and leave slice ``group.rank`` in ``tensor``
    (``dist.stream.reduce_scatter``'s contract: the input is left as it was)."""
    source = tensor_or_tensor_list
    if not isinstance(source, paddle.Tensor):  # a list or tuple of tensors
        source = paddle.concat([t.reshape([-1]) for t in source])
    # comm's gloo fallback writes into the other ranks' slices of its input
    comm.reduce_scatter(tensor, source.reshape([-1]).clone(), group, tag="mp_reduce_scatter")
