"""Per-parameter state: one original parameter, its local shard, and where they live.

Where the shard comes from is the buffer's (see [Note: the segment layout] in
:mod:`~paddle_hsdp.engine.layout`): every inner rank holds a box of whole rows of each
parameter of its buffer (possibly none), its ``inner block``; with outer sub-shards
(``fsdp_outer_sharding="optim"``, HFSDP) each outer part ``q`` of the rank holds a
sub-box of it, the rows its optimizer sees. The shard is a real ``EagerParamBase`` with
the original parameter's name and attributes and shape ``[rows held] + trailing dims``,
so everything Paddle keys per parameter behaves as in single-process training:
``apply_decay_param_fun`` (called with ``param.name``), ``optimize_attr["learning_rate"]``,
``need_clip``, ``regularizer``, frozen parameters (``stop_gradient``),
``is_distributed``; element-wise optimizers give bit-identical updates on any split. A
rank that holds no row of a parameter has a 0-row shard (Paddle's optimizers and clip
take those: nothing to update), so every rank's optimizer sees the same parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import paddle
from paddle.base.framework import EagerParamBase

from .layout import row_split
from .policies import POLICY_HINT
from .registry import registry

if TYPE_CHECKING:
    from ..topology.mesh import Mesh
    from .buffer import ShardBuffer
    from .layout import SegmentLayout

# Marks Paddle's optimizers, clip and hybrid-parallel helpers (and PaddleFormers) read
# per parameter, Paddle 3.3 / PaddleFormers 1.2: the shard carries each one the original
# has. The list documents them (test/test_param_marks.py checks each is carried); the
# shard also takes any other public, non-tensor attribute set on the original (a mark
# this list does not know yet). Tensor-valued ones are per-parameter data of the full
# tensor (``main_grad``, fp8 caches), not marks: a shard must not hold them.
MARKS = ("optimize_attr", "regularizer", "do_model_average", "need_clip",
         "gradient_clip_attr",  # per-parameter clip (paddle.nn.clip)
         "is_distributed", "split_axis",  # tensor parallel: sliced over mp
         "sequence_parallel",  # sequence parallel: grads summed over mp
         "is_firstly_shared",  # the pipeline's shared weights, HSDP's outer replicas
         "is_moe_param", "expert", "expert_type", "mp_moe", "is_gate", "color", "no_sync",
         "context_parallel_disable_scale_grad")


def carried_marks(param: paddle.Tensor) -> dict[str, object]:
    """The marks of ``param`` its shard carries: every entry of :data:`MARKS` it has,
    and any other public attribute it was given that is not a tensor."""
    marks = {name: getattr(param, name) for name in MARKS if hasattr(param, name)}
    for name, value in vars(param).items():
        if not name.startswith("_") and name not in marks and name != "main_grad" \
                and not isinstance(value, paddle.Tensor):
            marks[name] = value
    return marks


@dataclass(frozen=True)
class Slot:
    """Where a parameter sits in its buffer (:meth:`ShardedParam.place`): where it starts
    in the full flat buffer, the rows this rank holds (``(first, count)``: its inner
    block, and the sub-block its optimizer sees) and where they start in the rank's
    flat shard."""

    full_offset: int = 0
    inner_rows: tuple[int, int] = (0, 0)
    sub_rows: tuple[int, int] = (0, 0)
    inner_offset: int = 0
    flat_offset: int = 0
    # all of it in one segment: one rank (one outer part) holds every row
    in_one_segment: bool = True


class ShardedParam:
    """An original parameter, its shard on this inner rank, and the modules using it."""

    def __init__(self, param: EagerParamBase, fqn: str, inner_size: int, inner_rank: int,
                 parts: int = 1, part: int = 0) -> None:
        self.full = param  # keeps autograd identity; its storage comes and goes
        self.fqn = fqn
        self.shape = list(param.shape)
        self.dtype = param.dtype
        self.trainable = not param.stop_gradient
        self.rows, self.row_numel = row_split(self.shape)  # as the buffer's layout
        self.inner_size = inner_size
        self.inner_rank = inner_rank
        # outer sub-shards (HFSDP); 1 and 0 without them
        self.parts, self.part = parts, part
        self.slot = Slot()  # set by the buffer that holds it (:meth:`place`)
        self.users: list[tuple[paddle.nn.Layer, str]] = []  # (module, attribute name)
        # Set in fully_shard before anything reads them: the buffer that holds it (its
        # constructor), the groups that buffer talks to (the unit), the parameter the
        # optimizer sees (:meth:`make_shard_param`).
        self.buffer: ShardBuffer
        self.mesh: Mesh
        self.shard: EagerParamBase
        # Whether the parameter has a grad in plain Paddle's sense (not None): this rank
        # produced one since its shard grad was last released (``grad_here``), and
        # some rank of its FSDP group did (``grad_anywhere``, agreed at the step). An
        # optimizer skips a parameter without one (engine/optimizers.untouched_shards).
        self.grad_here = False
        self.grad_anywhere = False
        # Which stretch of its unit's module tree it sits in, between sharded
        # sub-modules (0 before the first): the unit's buffers are split by it, so a
        # root's head and its embedding travel apart (unit.buffer_groups).
        self.segment = 0
        # what shard_placement_fn asked for it: None (the default rows), "shard" (rows,
        # asked explicitly), "owned" or "replicate"
        self.placement: str | None = None

    def place(self, layout: SegmentLayout, index: int) -> None:
        """Take parameter ``index`` of a buffer's :class:`~.layout.SegmentLayout`."""
        full_offset = layout.offsets[index]
        rank_numel = self.parts * layout.segment_numel  # the rank's flat shard
        first_segment = self.inner_rank * self.parts
        inner_rows = layout.rows_in(index, first_segment, self.parts)
        sub_rows = layout.rows_in(index, first_segment + self.part)
        base = full_offset - self.inner_rank * rank_numel
        size = layout.segment_numel
        self.slot = Slot(
            full_offset, inner_rows, sub_rows,
            base + inner_rows[0] * self.row_numel if inner_rows[1] else 0,
            base + sub_rows[0] * self.row_numel if sub_rows[1] else 0,
            full_offset // size == (full_offset + max(self.numel, 1) - 1) // size)

    @property
    def rest(self) -> list[int]:
        """The trailing dims (a row's shape)."""
        return self.shape[1:]

    @property
    def numel(self) -> int:
        return self.rows * self.row_numel

    @property
    def inner_numel(self) -> int:
        """Elements of this rank's inner block (0 when it holds no row)."""
        return self.slot.inner_rows[1] * self.row_numel

    @property
    def sub_numel(self) -> int:
        """Elements of the shard parameter (the sub-block with parts, else the inner
        block)."""
        return self.slot.sub_rows[1] * self.row_numel

    @property
    def shard_shape(self) -> list[int]:
        """The shape of the parameter the optimizer sees."""
        return [self.slot.sub_rows[1]] + self.rest

    def row_range(self, sub: bool) -> tuple[int, int]:
        """``(first row, row count)`` this rank holds: its inner block (``sub=False``)
        or the sub-block its optimizer sees (``sub=True``; the same with one part)."""
        return self.slot.sub_rows if sub else self.slot.inner_rows

    def forget_shard(self) -> None:
        """The shard param no longer names this object (paddle_hsdp.forget): a Paddle
        tensor's Python attributes are not traversed by the collector, so the cycle
        shard -> ShardedParam -> shard would outlive every other reference."""
        shard = getattr(self, "shard", None)  # (none yet if fully_shard failed early)
        if shard is not None and hasattr(shard, "_hsdp_sharded_param"):
            delattr(shard, "_hsdp_sharded_param")

    # -------------------------------------------------------------- layout helpers
    def rows_of(self, full: paddle.Tensor, sub: bool) -> paddle.Tensor:
        """The rows of ``full`` (this parameter's full value) this rank holds, shaped
        ``[count] + trailing dims`` (see :meth:`row_range`)."""
        first, count = self.row_range(sub)
        if count == 0:  # (then the sub-block holds none either: the shard's shape)
            return self.empty(full.dtype)
        return full.reshape([self.rows, self.row_numel])[first:first + count] \
            .reshape([count] + self.rest)

    def piece_of(self, flat: paddle.Tensor) -> paddle.Tensor:
        """The shard parameter's elements of a flat shard-layout tensor: a 1-D view, no
        copy (callers skip a 0-row shard: Paddle will not share an empty slice).

        Views of flat storage are taken with ``t[start:stop]`` throughout the package,
        never ``Tensor._slice``: in Paddle 3.3 ``_slice`` leaks a small Python list per
        call (64 bytes here), and the engine takes views on every step."""
        start = self.slot.flat_offset
        return flat[start:start + self.sub_numel]

    def inner_block_of(self, flat: paddle.Tensor) -> paddle.Tensor:
        """This rank's inner block in a flat shard-layout tensor (a 1-D view)."""
        start = self.slot.inner_offset
        return flat[start:start + self.inner_numel]

    def cut_into(self, full: paddle.Tensor, flat: paddle.Tensor, sub: bool) -> None:
        """Write this rank's rows of ``full`` (the parameter's full value, or its full
        grad) into their place in the flat shard-layout tensor ``flat``: its inner
        block, or with ``sub`` its outer piece; cast to ``flat``'s dtype. A rank that
        holds no rows writes nothing."""
        if self.sub_numel if sub else self.inner_numel:
            rows = self.rows_of(full, sub=sub).reshape([-1]).astype(flat.dtype)
            paddle.assign(rows, output=self.piece_of(flat) if sub else self.inner_block_of(flat))

    def full_of(self, full_flat: paddle.Tensor) -> paddle.Tensor:
        """The parameter's full tensor in its buffer's full flat buffer (a view)."""
        start = self.slot.full_offset
        return full_flat[start:start + self.numel].reshape(self.shape)

    # -------------------------------------------------------------- shard param
    def make_shard_param(self) -> EagerParamBase:
        """The parameter the optimizer sees: this rank's block, with the original's
        name and per-parameter attributes (its storage comes from :meth:`attach_shard`)."""
        p = self.full
        shard = EagerParamBase(shape=self.shard_shape, dtype=self.dtype, name=p.name,
                               trainable=self.trainable)
        shard.stop_gradient = p.stop_gradient
        for name, value in carried_marks(p).items():
            setattr(shard, name, value)
        if hasattr(p, "main_grad"):
            # MixPrecisionLayer wrapped the model first: MixPrecisionOptimizer reads the
            # shard's main_grad, which the buffer fills (engine/master_grad.py)
            shard.main_grad = None
        shard._hsdp_sharded_param = self  # lets optimizer/clip/state find the owner
        if self.sub_numel == 0:
            # paddle.DataParallel's reducer (a plain Trainer over a sharded model)
            # refuses a parameter of no elements; a 0-row shard has nothing to sync
            shard.no_sync = True
        self.shard = shard
        return shard

    def check_dtype(self) -> None:
        """A shard keeps the dtype it was sharded in: its buffer moves one dtype. A cast
        in place (``paddle.amp.decorate(level='O2')`` after fully_shard casts every
        parameter the model yields, i.e. the shards) would leave the buffer stale, and
        copying the value back would quietly undo the cast."""
        shard = self.shard
        if shard._is_initialized() and shard.dtype != self.dtype:
            raise NotImplementedError(
                f"{registry.param_path(self)}: its HSDP shard was cast from "
                f"{_name(self.dtype)} to {_name(shard.dtype)} after fully_shard (paddle.amp.decorate(level='O2') "
                "after fully_shard does this). Cast before sharding: call "
                "paddle.amp.decorate(models=model, level='O2', ...) before fully_shard, and "
                "build the optimizer afterwards with multi_precision=True (or decorate it "
                f"then: the parameters are cast already). {POLICY_HINT}")

    # -------------------------------------------------------------- views of flat storage
    def empty(self, dtype: paddle.dtype) -> paddle.Tensor:
        """A 0-row tensor of the shard's shape that holds storage (one element): Paddle
        shares no empty slice, and a tensor without storage has no place, which casts
        and ``set_value`` (``paddle.amp.decorate``, ``set_state_dict``) need."""
        t = paddle.zeros([1], dtype=dtype)
        t.get_tensor()._set_dims(self.shard_shape)
        return t

    def attach_shard(self, flat: paddle.Tensor) -> None:
        """Make the shard param a view of its chunk of the buffer's flat storage."""
        if self.sub_numel == 0:
            shard = self.shard
            if not shard._is_initialized() or shard.dtype != flat.dtype or \
                    list(shard.shape) != self.shard_shape:
                self.empty(flat.dtype)._share_buffer_to(shard)
                # (sharing keeps the receiver's dims: a relaid shard had rows before)
                shard.get_tensor()._set_dims(self.shard_shape)
            return
        self.piece_of(flat)._share_buffer_to(self.shard)
        self.shard.get_tensor()._set_dims(self.shard_shape)

    def views(self, tensor: paddle.Tensor | None, flat: paddle.Tensor) -> bool:
        """Whether ``tensor`` (this param's shard, grad or main grad) is its chunk of
        the buffer's flat storage ``flat``, not a copy: one pointer comparison (a 0-row
        one is, whatever its storage, once it has the right shape)."""
        if tensor is None:
            return False
        if self.sub_numel == 0:
            return list(tensor.shape) == self.shard_shape
        return is_view_at(tensor, flat, self.slot.flat_offset)

    def shard_is_view_of(self, flat: paddle.Tensor) -> bool:
        return self.views(self.shard, flat)

    def attach_grad(self, flat_grad: paddle.Tensor) -> None:
        """Make the shard's ``.grad`` a view of its chunk of the flat grad storage."""
        # a 0-row grad holds no storage: autograd adds a new grad to a stored one only
        # when both hold storage, and its 0-row grads hold none
        grad = own_view(self.piece_of(flat_grad), self.shard_shape) if self.sub_numel \
            else paddle.zeros(self.shard_shape, dtype=flat_grad.dtype)
        self.shard._copy_gradient_from(grad)

    def attach_full_grad(self, grid: paddle.Tensor) -> None:
        """Make the full parameter's ``.grad`` a view of its place in ``grid``, a full
        flat buffer (engine/buffer/full_grads.py)."""
        self.full._copy_gradient_from(own_view(self.full_of(grid), self.shape))

    def full_grad_is_view_of(self, grid: paddle.Tensor) -> bool:
        """Whether the full parameter's ``.grad`` is still its place in ``grid``."""
        grad = self.full.grad
        return grad is not None and is_view_at(grad, grid, self.slot.full_offset)

    def grad_is_view_of(self, flat_grad: paddle.Tensor) -> bool:
        return self.views(self.shard.grad, flat_grad)

    def attach_main_grad(self, flat_main_grad: paddle.Tensor) -> None:
        """Make the shard's ``main_grad`` (MixPrecisionLayer's float32 grad) a view of its
        chunk of the buffer's flat main-grad storage."""
        self.shard.main_grad = own_view(self.piece_of(flat_main_grad), self.shard_shape) \
            if self.sub_numel else paddle.zeros(self.shard_shape, dtype=flat_main_grad.dtype)

    def main_grad_is_view_of(self, flat_main_grad: paddle.Tensor) -> bool:
        return self.views(getattr(self.shard, "main_grad", None), flat_main_grad)

    # -------------------------------------------------------------- module slots
    def point_users_to(self, tensor: paddle.Tensor) -> None:
        """Make every module attribute that names this parameter hold ``tensor``."""
        for module, name in self.users:
            module._parameters[name] = tensor

    def set_full_data(self, tensor: paddle.Tensor) -> None:
        """Give the original parameter (the one autograd knows) this storage."""
        tensor.reshape(self.shape)._share_buffer_to(self.full)

    def free_full_data(self) -> None:
        if self.full._is_initialized():
            self.full._clear_data()

    def full_is_materialized(self) -> bool:
        return self.full._is_initialized()


def is_view_at(tensor: paddle.Tensor, flat: paddle.Tensor, offset: int) -> bool:
    """Whether ``tensor``'s storage starts at element ``offset`` of ``flat``'s: one
    pointer comparison."""
    return (tensor._is_initialized()
            and tensor.data_ptr() == flat.data_ptr() + offset * flat.element_size())


def own_view(view: paddle.Tensor, shape: list[int]) -> paddle.Tensor:
    """``view``'s storage in a tensor object of its own, shaped ``shape``. A slice of a
    tensor's whole range is the tensor itself to Paddle (the same DenseTensor), so a
    grad that is such a "view" and is released (``clear_gradient(False)`` moves its
    storage out) would free the flat buffer it belongs to."""
    t = paddle.zeros([1], dtype=view.dtype)  # its one element is dropped by the share
    view._share_buffer_to(t)
    t.get_tensor()._set_dims(shape)
    return t


def _name(dtype: paddle.dtype) -> str:
    return str(dtype).replace("paddle.", "")
