"""Where a tensor this rank holds sits in the full model, on the axes that split a
model rather than its data: the tensor-parallel slice, the pipeline stage, the local
expert (checkpoints and the flex_checkpoint bridge read it).

* **Tensor parallel.** A parameter Paddle's mp layers mark ``is_distributed`` with a
  ``split_axis`` (``ColumnParallelLinear``: 1, ``RowParallelLinear`` and
  ``VocabParallelEmbedding``: 0; PaddleFormers' layers alike) is mp rank ``r``'s
  ``r``-th equal part of the full tensor along that axis: full shape = local shape with
  that axis times the mp degree (checkpoint/tp_merge.py refuses a model whose own merge
  is not that concatenation).
* **Pipeline.** Each stage holds its own names; the stage is recorded per tensor.
* **Experts.** Local experts without ``global_indices`` share names across EP ranks:
  their pieces carry the EP rank as a tag, so a save sees the collision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence, cast

from paddle.distributed.fleet.base import topology as fleet_topology

from .mesh import model_parallel_degrees

if TYPE_CHECKING:
    import paddle
    from paddle.distributed.fleet.base.topology import (EPHybridCommunicateGroup,
                                                        HybridCommunicateGroup)


@dataclass(frozen=True)
class Placement:
    """This rank's slice of one tensor: its shape here and the full tensor's, where the
    slice starts in it, how it was split (``{"axis", "degree"}`` or None) and the tag
    that tells its data from a same-named slice of another rank ('' for none)."""

    local_shape: list
    full_shape: list
    offset: list
    split: dict | None = None
    tag: str = ""

    def rows(self, start: int, count: int) -> tuple[list, list]:
        """``(offset, size)`` in the full tensor of rows ``[start, start + count)`` of
        this slice (a 0-d tensor is one element)."""
        offset = list(self.offset) or [0]
        offset[0] += start
        return offset, [count] + [int(d) for d in self.local_shape[1:]]


class ModelAxes:
    """This rank's coordinates on the model-splitting axes of fleet's HCG (all 1 / 0
    without one: a plain process, an explicit mesh)."""

    def __init__(self, hcg: HybridCommunicateGroup | None = None) -> None:
        hcg = fleet_topology._HYBRID_PARALLEL_GROUP if hcg is None else hcg
        degrees = model_parallel_degrees(hcg)
        self.mp_degree, self.pp_degree = degrees["mp_degree"], degrees["pp_degree"]
        self.mp_rank = hcg.get_model_parallel_rank() if self.mp_degree > 1 else 0
        self.stage = hcg.get_stage_id() if self.pp_degree > 1 else 0
        ep = getattr(hcg, "get_expert_parallel_world_size", None)
        self.ep_degree = (ep() or 1) if ep is not None else 1
        self.ep_rank = (cast("EPHybridCommunicateGroup", hcg).get_expert_parallel_rank()
                        if self.ep_degree > 1 else 0)  # an EP HCG
        self.hcg = hcg

    def place(self, tensor: paddle.Tensor, local_shape: Sequence[int],
              renamed_expert: bool = False) -> Placement:
        """``tensor``'s (a parameter or buffer, with Paddle's marks) slice of shape
        ``local_shape`` in the full model."""
        local = [int(d) for d in local_shape]
        offset = [0] * len(local)
        tag = ""
        if self.ep_degree > 1 and is_expert(tensor) and not renamed_expert:
            tag = f"ep{self.ep_rank}"
        axis = split_axis(tensor) if self.mp_degree > 1 else None
        if axis is None:
            return Placement(local, local, offset, None, tag)
        full = list(local)
        full[axis] *= self.mp_degree
        offset[axis] = self.mp_rank * local[axis]
        return Placement(local, full, offset, {"axis": axis, "degree": self.mp_degree}, tag)

    def layout(self) -> dict:
        """The saving job's degrees (what ``inspect`` shows)."""
        out = {"mp_degree": self.mp_degree, "pp_degree": self.pp_degree,
               "ep_degree": self.ep_degree}
        hcg = self.hcg
        for key, getter in (("sharding_degree", "get_sharding_parallel_world_size"),
                            ("fsdp_outer_degree", "get_fsdp_outer_degree"),
                            ("fsdp_outer_sharding", "get_fsdp_outer_sharding")):
            if hcg is not None and hasattr(hcg, getter):
                out[key] = getattr(hcg, getter)()
        return out


def split_axis(tensor: paddle.Tensor) -> int | None:
    """The axis Paddle's marks say ``tensor`` is split over mp, or None."""
    if not getattr(tensor, "is_distributed", False):
        return None
    axis = getattr(tensor, "split_axis", None)
    if axis is None:
        raise NotImplementedError(
            f"{tensor.name}: marked is_distributed (split over the tensor-parallel group) "
            "without a split_axis: which slice of the full tensor it holds is unknown, so it "
            "cannot be checkpointed across layouts. Give it split_axis (as Paddle's mp "
            "layers do).")
    return int(axis) % max(len(tensor.shape), 1)


def is_expert(tensor: paddle.Tensor) -> bool:
    """Whether ``tensor`` is an expert (MoE) parameter: the marks Paddle's engines and
    ``paddle_hsdp.mark_expert_params`` set."""
    return bool(getattr(tensor, "is_moe_param", False) or getattr(tensor, "expert", False))
