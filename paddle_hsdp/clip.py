"""Global-norm clipping over HSDP shards: every distinct shard counted exactly once.

Inner ranks hold distinct blocks; outer replicas hold copies, marked
``is_firstly_shared=False`` on every outer rank but 0 (see ``ShardBuffer``). The
squared norm is summed locally with replicas contributing zero, then all-reduced over
the FSDP group. No rank returns early: a rank with nothing to count (an outer replica,
a shard that is all padding) adds zero and still joins the all-reduce, so no rank hangs.
"""

from __future__ import annotations

import paddle
from paddle.nn import ClipGradByGlobalNorm

from . import comm


class HSDPClipGradByGlobalNorm(ClipGradByGlobalNorm):
    """``ClipGradByGlobalNorm`` for HSDP shards; ``last_global_norm`` keeps the norm."""

    def __init__(self, clip_norm: float, group, group_name: str = "default_group",
                 auto_skip_clip: bool = False):
        super().__init__(clip_norm, group_name, auto_skip_clip)
        self.group = group
        self.last_global_norm: paddle.Tensor | None = None

    @paddle.no_grad()
    def _dygraph_clip(self, params_grads):
        sum_sq = paddle.zeros([1], dtype="float32")
        for p, g in params_grads:
            if g is None or getattr(p, "need_clip", True) is False:
                continue
            sq = paddle.sum(paddle.square(g.astype("float32"))).reshape([1])
            if getattr(p, "is_firstly_shared", True) is False:
                sq = sq * 0.0  # a replica: its twin on outer rank 0 counts it
            sum_sq = sum_sq + sq
        comm.all_reduce(sum_sq, self.group, tag="clip")
        norm = paddle.sqrt(sum_sq)
        self.last_global_norm = norm
        max_norm = paddle.full([1], self.clip_norm, dtype="float32")
        if self.auto_skip_clip and norm.item() <= self.clip_norm:
            return params_grads
        scale = max_norm / paddle.maximum(norm, max_norm)
        out = []
        for p, g in params_grads:
            if g is None or getattr(p, "need_clip", True) is False:
                out.append((p, g))
            else:
                out.append((p, g * scale.astype(g.dtype)))
        return out


def make_clip_hsdp_aware(optimizer, params) -> None:
    """Swap a plain ``ClipGradByGlobalNorm`` for the HSDP one (same settings); refuse
    clips that cannot be right on shards, before any update happens."""
    clip = optimizer._grad_clip
    if clip is None or isinstance(clip, HSDPClipGradByGlobalNorm):
        return
    if type(clip) is ClipGradByGlobalNorm:
        mesh = params[0]._hsdp_sharded_param.mesh
        optimizer._grad_clip = HSDPClipGradByGlobalNorm(
            clip.clip_norm, mesh.fsdp_group(False), clip.group_name, clip.auto_skip_clip)
        return
    if isinstance(clip, paddle.nn.ClipGradByNorm):
        raise NotImplementedError(
            "ClipGradByNorm clips each parameter by its own norm, which a shard cannot "
            "know; use paddle.nn.ClipGradByGlobalNorm (or ClipGradByValue) with paddle_hsdp.")


def last_global_norm(optimizer) -> float | None:
    """The global grad norm of the optimizer's last clipped step (for logging)."""
    clip = getattr(optimizer, "_inner_opt", optimizer)._grad_clip
    norm = getattr(clip, "last_global_norm", None)
    return None if norm is None else norm.item()
