"""What one optimizer step costs, in bytes: per group and op on the wire, and per rank
in memory. One set of formulas for everyone: the ``plan`` command, ``apply_config``'s
plan, the benchmark's "theoretical" column and the tests that hold the communication
counter to them.

The unit of description is a :class:`BufferShape`, the sizes of one fused buffer (what
travels in one collective); a live :class:`~paddle_hsdp.engine.buffer.ShardBuffer` gives its
own (``buffer.shape()``), and :mod:`paddle_hsdp.config.plan` derives the same from parameter
shapes alone, without processes or memory.

Per buffer with shard ``S`` elements (its share of the full buffer, padding included:
engine/layout.py), inner size ``I``, outer size ``O`` and ``k`` micro-steps per optimizer
step, the counter's ring accounting:

* inner all-gather: payload ``I * S * gather bytes``, wire ``(I - 1) / I`` of it,
  ``2k`` times when the unit reshards after forward (ZeRO-3), ``k`` times otherwise
  (ZeRO-2), once at ZeRO-1 (params stay gathered through the micro-steps); beside each,
  the check's own all-gather of ``I * TAG`` elements (op ``all_gather_tags``);
* inner reduce-scatter (trainable buffers): payload ``I * S * reduce bytes``, wire
  ``(I - 1) / I``, ``k`` times (once at ZeRO-1);
* outer all-reduce (trainable): payload ``S * reduce bytes``, wire ``2 (O - 1) / O``, once
  (the grad shard travels in ``reduce_dtype``: the cross-machine bytes);
* with outer sub-shards (``fsdp_outer_sharding="optim"``, HFSDP), instead of it: an
  outer reduce-scatter (payload ``S * reduce bytes``, wire ``(O - 1) / O``) and, after
  the update, an outer all-gather (payload ``S * master bytes``, the parameters' own
  dtype, wire ``(O - 1) / O``), once each: the all-reduce's bytes when ``reduce_dtype``
  is the parameters' dtype. The optimizer state per rank is ``1 / O`` of HSDP's;
* with ``outer_compress="int8"`` (or ``"fp8"``: the same bytes, op ``all_reduce_fp8``)
  in blocks of ``B`` (engine/buffer/outer_compress.py),
  instead of the all-reduce or reduce-scatter: one outer all-gather of every rank's
  message, ``S`` rounded up to whole blocks ``S'`` of int8 codes plus ``4 S' / B`` bytes
  of float32 scales (op ``all_reduce_int8``: payload ``O (S' + 4 S' / B)``, wire
  ``(O - 1) / O`` of it, i.e. ``(O - 1) (S' + 4 S' / B)`` per rank); HFSDP's all-gather
  after the update as above.

``TAG`` is the all-gather check's few elements per rank (:mod:`paddle_hsdp.comm.gather_tags`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..comm.gather_tags import TAG_NUMEL

OPS = ("all_gather", "reduce_scatter", "all_reduce")


@dataclass(frozen=True)
class BufferShape:
    """Sizes of one fused buffer on one rank."""

    shard_numel: int  # this rank's shard, padding rows included
    logical_numel: int  # the parameters' own elements (no padding)
    inner: int
    outer: int
    master_bytes: int  # per element of the shard, its grad and the optimizer's view
    gather_bytes: int  # per element on the all-gather (MixedPrecisionPolicy.param_dtype)
    reduce_bytes: int  # per element on the reduce-scatter (reduce_dtype)
    compute_bytes: int  # per element of the gathered parameters the forward uses
    trainable: bool
    inner_label: str = "inner"  # the counter's labels of the groups it talks to
    outer_label: str = "outer"
    outer_parts: int = 1  # the optimizer sees 1/outer_parts of the shard (HFSDP: O)
    outer_compress_block: int = 0  # values per scale of the int8 / fp8 outer sync; 0: none
    outer_compress: str = "int8"  # its codes (with outer_compress_block)


@dataclass(frozen=True)
class UnitShape:
    """One ``fully_shard`` unit: its path, buffers and resharding after forward."""

    path: str
    buffers: tuple[BufferShape, ...]
    reshard_after_forward: bool
    params: int  # parameter elements it owns

    @property
    def gathered_bytes(self) -> int:
        """Bytes of its parameters while gathered (compute dtype, padding included)."""
        return sum(b.inner * b.shard_numel * b.compute_bytes for b in self.buffers)


def step_comm(units: list[UnitShape], micro_steps: int = 1,
              zero_stage: int | None = None) -> dict[tuple[str, str], float]:
    """Wire bytes per rank of one optimizer step, ``{(group label, op): bytes}``."""
    out: dict[tuple[str, str], float] = {}

    def add(label: str, op: str, payload: float, factor: float) -> None:
        out[(label, op)] = out.get((label, op), 0.0) + payload * factor

    for unit in units:
        if zero_stage == 1:
            gathers, reduces = 1, 1
        else:
            gathers = micro_steps * (2 if unit.reshard_after_forward else 1)
            reduces = micro_steps
        for b in unit.buffers:
            ring = (b.inner - 1) / b.inner
            add(b.inner_label, "all_gather",
                gathers * b.inner * b.shard_numel * b.gather_bytes, ring)
            add(b.inner_label, "all_gather_tags", gathers * b.inner * TAG_NUMEL * b.gather_bytes,
                ring)
            if b.trainable:
                add(b.inner_label, "reduce_scatter",
                    reduces * b.inner * b.shard_numel * b.reduce_bytes, ring)
                add_outer(add, b)
    return out


def add_outer(add: Callable[[str, str, float, float], None], b: BufferShape) -> None:
    """The step's outer traffic of a trainable buffer: one all-reduce, or with outer
    sub-shards one reduce-scatter and one all-gather (the same bytes, see above)."""
    ring = (b.outer - 1) / b.outer
    if b.outer_compress_block and b.outer > 1:
        block = b.outer_compress_block
        padded = -(-b.shard_numel // block) * block
        add(b.outer_label, f"all_reduce_{b.outer_compress}",
            b.outer * (padded + 4 * padded // block), ring)
        if b.outer_parts > 1:
            add(b.outer_label, "all_gather", b.shard_numel * b.master_bytes, ring)
    elif b.outer_parts > 1:
        add(b.outer_label, "reduce_scatter", b.shard_numel * b.reduce_bytes, ring)
        add(b.outer_label, "all_gather", b.shard_numel * b.master_bytes, ring)
    else:
        add(b.outer_label, "all_reduce", b.shard_numel * _outer_bytes(b), 2 * ring)


def _outer_bytes(b: BufferShape) -> int:
    """Bytes per element of the outer all-reduce: ``reduce_dtype`` when there is an
    outer group (a one-rank group moves nothing and keeps the master dtype)."""
    return b.reduce_bytes if b.outer > 1 else b.master_bytes


def adamw_state_bytes(b: BufferShape) -> int:
    """AdamW's two moments of what the optimizer sees of a trainable shard (float32, as
    Paddle keeps them for float32 masters; with outer sub-shards 1/O of the shard);
    beta powers are two scalars per parameter, left out."""
    return 2 * (b.shard_numel // b.outer_parts) * 4 if b.trainable else 0


def memory_per_rank(units: list[UnitShape], forward_prefetch: int = 1) -> dict[str, int]:
    """Bytes one rank holds: shards, their grads and AdamW state (persistent), and the
    peak of gathered parameters: the root's (never resharded after forward) plus the
    largest run of ``1 + forward_prefetch`` consecutive other units."""
    params = sum(b.shard_numel * b.master_bytes for u in units for b in u.buffers)
    grads = sum(b.shard_numel * b.master_bytes for u in units for b in u.buffers
                if b.trainable)
    optim = sum(adamw_state_bytes(b) for u in units for b in u.buffers)
    kept = sum(u.gathered_bytes for u in units if not u.reshard_after_forward)
    moving = [u.gathered_bytes for u in units if u.reshard_after_forward]
    window = 1 + max(int(forward_prefetch), 0)
    peak_moving = max((sum(moving[i:i + window]) for i in range(len(moving))), default=0)
    return {"params": params, "grads": grads, "optimizer": optim,
            "peak_gathered": kept + peak_moving}
