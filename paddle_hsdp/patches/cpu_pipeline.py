"""Let Paddle 3.3's pipeline schedule run on CPU ranks (gloo): ``PipelineLayer`` and
``fleet.distributed_model(...).train_batch``.

* ``ParallelEnv._device_id``: ``PipelineLayer`` reads ``ParallelEnv().device_id``, which
  only CUDA, XPU and custom-device builds set; a class default of 0 answers on a CPU
  build (the instance attribute of the other builds hides it).
* The schedule's p2p (``p2p_communication._batched_p2p_ops`` / ``_p2p_ops``): on a device
  they are queued on the calc stream and complete in any order; gloo has no calc stream
  (``ProcessGroupGloo`` refuses ``send`` with ``use_calc_stream``) and its send and recv
  each block until the peer makes the matching call. Over a gloo pipe group every
  message is sent and received synchronously, in an order that cannot deadlock: the
  messages towards the next stage first (send to next, receive from previous), then
  those towards the previous one; even stages send before they receive, odd stages
  receive first. Every link then has one side sending while the other receives, the
  ring of interleaved stages included. Under tensor parallelism the whole tensor is
  sent (not 1/mp of it and an mp all-gather): the same values.
* ``PipelineParallel._broadcast_final_loss``: the last stage broadcasts a flag that
  says float32 or not, and the other stages allocate float16 for "not": a float64 loss
  (8 bytes into 2) aborts gloo. Over a gloo pipe group the flag names the dtype
  (float32, float16, bfloat16 or float64), the element count and whether the loss is
  0-d, so every stage holds the last stage's loss in its dtype and shape.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import paddle
from paddle.distributed import parallel
from paddle.distributed.fleet.meta_parallel import pipeline_parallel
from paddle.distributed.fleet.meta_parallel.pp_utils import p2p_communication as p2p

from ..comm import collectives as comm
from .patching import replace

if TYPE_CHECKING:
    from paddle.distributed.communication.group import Group
    from paddle.distributed.fleet.base.topology import HybridCommunicateGroup

    # what a pipeline p2p call sends or receives in one direction
    Message = paddle.Tensor | tuple[paddle.Tensor, ...] | list[paddle.Tensor] | None

_installed = False
# Paddle's own functions the replacements call off gloo, by name (tests swap them here).
PADDLE: dict = {}
_LOSS_DTYPES = (paddle.float32, paddle.float16, paddle.bfloat16, paddle.float64)


def _tensors(message: Message) -> list[paddle.Tensor]:
    """A p2p message's tensors: None, one tensor, or a tuple/list of them."""
    if message is None:
        return []
    return list(message) if isinstance(message, (tuple, list)) else [message]


def gloo_p2p(send_prev: Message, recv_prev: Message, send_next: Message, recv_next: Message,
             hcg: HybridCommunicateGroup) -> list:
    """Every message of one schedule step, synchronously, in the deadlock-free order of
    the module docstring; returns no request (nothing is left to wait for)."""
    group = hcg.get_pipe_parallel_group()
    prev, nxt = hcg._get_p2p_prev_rank(), hcg._get_p2p_next_rank()
    sends_first = hcg.get_stage_id() % 2 == 0
    for send, dst, recv, src in ((send_next, nxt, recv_prev, prev),
                                 (send_prev, prev, recv_next, nxt)):
        steps = [(comm.send, send, dst), (comm.recv, recv, src)]
        for op, message, peer in (steps if sends_first else steps[::-1]):
            for tensor in _tensors(message):
                op(tensor, peer, group, tag="pipeline")
    return []


def _patch_p2p() -> None:
    for name in ("_batched_p2p_ops", "_p2p_ops"):
        PADDLE[name] = getattr(p2p, name)

        def ops(send_prev: Message, recv_prev: Message, send_next: Message,
                recv_next: Message, hcg: HybridCommunicateGroup, __name: str = name) -> Any:
            if comm.is_gloo(hcg.get_pipe_parallel_group()):
                return gloo_p2p(send_prev, recv_prev, send_next, recv_next, hcg)
            return PADDLE[__name](send_prev, recv_prev, send_next, recv_next, hcg)

        replace(p2p, name, ops,
                "gloo has no calc-stream p2p and blocks in send/recv: one synchronous, "
                "deadlock-free order over a gloo pipe group")


def _last_stage_losses(pp: pipeline_parallel.PipelineParallel,
                       per_micro_batch: bool) -> list[paddle.Tensor]:
    """What the last stage reports for each loss function: the sum of its micro-batch
    losses (divided by the step count when the scaling was delayed), or each of them."""
    out = []
    for micro_losses in pp.total_loss:
        detached = [loss.detach() for loss in micro_losses]
        if per_micro_batch:
            out.append(paddle.stack(detached))
            continue
        total = detached[0]
        for loss in detached[1:]:
            total = total + loss
        out.append(total / pp.accumulate_steps if pp._delay_scale_loss else total)
    return out


def broadcast_loss(loss: paddle.Tensor | None, src: int, group: Group) -> paddle.Tensor:
    """``loss`` (on rank ``src``; None elsewhere) on every rank of ``group``, in its own
    dtype and shape (a 0-d loss stays 0-d: a stage's loss of another shape or dtype
    than the last stage's would make the ranks' later collectives of it differ): a
    header ``[dtype index, element count, 0-d]`` first, then the values."""
    header = paddle.zeros([3], "int64")
    if loss is not None:  # (paddle.to_tensor would leak two Python blocks per step)
        paddle.assign(np.array([_LOSS_DTYPES.index(loss.dtype), math.prod(loss.shape),
                                len(loss.shape) == 0], "int64"), output=header)
    comm.broadcast(header, src, group, tag="pipeline_loss")
    if loss is None:
        # (numpy's tolist, as Paddle's is: Paddle types its result for any rank)
        dtype, count, scalar = header.numpy().tolist()
        loss = paddle.zeros([] if scalar else [count], _LOSS_DTYPES[dtype])
    comm.broadcast(loss, src, group, tag="pipeline_loss")
    return loss


def _patch_final_loss() -> None:
    cls = pipeline_parallel.PipelineParallel
    PADDLE["_broadcast_final_loss"] = cls._broadcast_final_loss

    def _broadcast_final_loss(self: pipeline_parallel.PipelineParallel,
                              return_micro_batch_loss: bool = False) -> Any:
        if not comm.is_gloo(self.pp_group):
            return PADDLE["_broadcast_final_loss"](self, return_micro_batch_loss)
        last = self._hcg.get_rank_from_stage(self.num_stages - 1)
        mine: Sequence[paddle.Tensor | None]  # None: another stage's, to receive
        if self.is_pipeline_last_stage(ignore_virtual=True):
            assert self.total_loss is not None, "train_batch's last stage has no loss"
            mine = _last_stage_losses(self, return_micro_batch_loss)
        else:
            mine = [None] * len(self._layers._loss_fn)
        losses = [broadcast_loss(loss, last, self.pp_group) for loss in mine]
        return losses[0] if len(losses) == 1 else losses

    replace(cls, "_broadcast_final_loss", _broadcast_final_loss,
            "over gloo, the loss in its own dtype: Paddle's flag allocates float16 for "
            "anything but float32, and a float64 loss aborts gloo")


def install() -> None:
    global _installed
    if _installed:
        return
    replace(parallel.ParallelEnv, "_device_id", 0,
            "PipelineLayer reads ParallelEnv().device_id, which a CPU build never sets")
    _patch_p2p()
    _patch_final_loss()
    _installed = True
