"""Per-parameter state: one original parameter, its local shard, and where they live.

Layout choice (why per-parameter dim-0 shards): every parameter is padded along dim 0 to
a multiple of the inner size ``I`` and split into ``I`` equal row blocks; inner rank
``i`` keeps block ``i`` as a real ``EagerParamBase`` that carries the original
parameter's name and attributes.  The optimizer therefore sees one tensor per original
parameter, never empty, never straddling two parameters, so everything Paddle keys per
parameter behaves exactly as in single-process training: ``apply_decay_param_fun``
(called with ``param.name``), ``optimize_attr["learning_rate"]``, ``need_clip``,
``regularizer``, frozen parameters (``stop_gradient``), ``is_distributed``.  Element-wise
optimizers give bit-identical updates on any such split.  The price is at most
``(I - 1)`` padding rows per parameter and a copy-out after each all-gather.

[Note: outer sub-shards] With ``fsdp_outer_sharding="optim"`` (HFSDP) a buffer's inner
block is cut once more, across its ``Q`` outer replicas (``parts``): every parameter is
padded to a multiple of ``I * Q`` rows and split into ``I * Q`` *virtual* blocks of
``sub_rows`` rows; inner rank ``i`` holds virtual blocks ``i*Q .. i*Q + Q-1`` (its
inner block, ``rows_per_rank = Q * sub_rows`` rows, as every replica needs for the
forward), and outer rank ``q`` of it is the one whose optimizer sees virtual block
``i*Q + q``: the shard parameter is that sub-block, still whole rows, never empty. The
buffer lays its flat shard out piece-major (``Q`` contiguous pieces, each the
concatenation of every parameter's sub-block for that ``q``), so the outer
reduce-scatter and all-gather move one contiguous piece per rank and the shard
parameters stay views. With ``Q = 1`` (HSDP, the default) everything reduces to the
layout above.
"""

from __future__ import annotations

import math

import paddle
from paddle.base.framework import EagerParamBase

from .policies import POLICY_HINT

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


def carried_marks(param) -> dict:
    """The marks of ``param`` its shard carries: every entry of :data:`MARKS` it has,
    and any other public attribute it was given that is not a tensor."""
    marks = {name: getattr(param, name) for name in MARKS if hasattr(param, name)}
    for name, value in vars(param).items():
        if not name.startswith("_") and name not in marks and name != "main_grad" \
                and not isinstance(value, paddle.Tensor):
            marks[name] = value
    return marks


class ShardedParam:
    """An original parameter, its shard on this inner rank, and the modules using it."""

    def __init__(self, param, fqn: str, inner_size: int, inner_rank: int, parts: int = 1,
                 part: int = 0):
        self.full = param  # keeps autograd identity; its storage comes and goes
        self.fqn = fqn
        self.shape = list(param.shape)
        self.dtype = param.dtype
        self.trainable = not param.stop_gradient
        rows = self.shape[0] if self.shape else 1
        self.rest = self.shape[1:] if self.shape else []
        self.row_numel = math.prod(self.rest) if self.rest else 1
        self.rows = rows
        # outer sub-shards (see [Note: outer sub-shards]); 1 and 0 without them
        self.parts, self.part = parts, part
        self.sub_rows = -(-rows // (inner_size * parts))  # ceil
        self.sub_numel = self.sub_rows * self.row_numel
        self.rows_per_rank = self.sub_rows * parts
        self.padded_rows = self.rows_per_rank * inner_size
        self.chunk_numel = self.rows_per_rank * self.row_numel
        self.numel = rows * self.row_numel
        self.inner_size = inner_size
        self.inner_rank = inner_rank
        # set by the buffer that holds this param: where its sub-block sits in one piece
        # of the flat shard, and the piece's size (with one part: the chunk's offset,
        # the shard)
        self.offset = 0
        self.piece_numel = 0
        self.buffer = None
        self.users: list[tuple[object, str]] = []  # (module, attribute name)
        self.shard: EagerParamBase | None = None
        self.mesh = None  # set by the unit: the groups this param's buffer talks to
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

    @property
    def shard_shape(self) -> list[int]:
        """The shape of the parameter the optimizer sees (the sub-block with parts)."""
        return [self.sub_rows] + self.rest

    @property
    def flat_offset(self) -> int:
        """Where the shard parameter's elements start in the buffer's flat shard."""
        return self.part * self.piece_numel + self.offset

    def row_range(self, sub: bool) -> tuple[int, int]:
        """``(first row, row count)`` of the unpadded rows this rank holds: its inner
        block (``sub=False``) or the sub-block its optimizer sees (``sub=True``; the
        same with one part). The count is 0 for an all-padding block."""
        size = self.sub_rows if sub else self.rows_per_rank
        index = self.inner_rank * self.parts + self.part if sub else self.inner_rank
        start = min(index * size, self.rows)
        return start, min(start + size, self.rows) - start

    # -------------------------------------------------------------- layout helpers
    def padded_rows_of(self, full) -> paddle.Tensor:
        """``full`` reshaped to ``[padded_rows, row_numel]``, zero rows appended."""
        t = full.reshape([self.rows, self.row_numel])
        if self.padded_rows > self.rows:
            pad = paddle.zeros([self.padded_rows - self.rows, self.row_numel], dtype=t.dtype)
            t = paddle.concat([t, pad], axis=0)
        return t

    def as_rank_blocks(self, full) -> paddle.Tensor:
        """``full`` as ``[I, chunk_numel]``: row ``i`` is the block inner rank ``i`` owns
        (a view when no padding rows are needed, else a padded copy)."""
        return self.padded_rows_of(full).reshape([self.inner_size, self.chunk_numel])

    def piece_of(self, flat) -> paddle.Tensor:
        """The shard parameter's elements of a flat shard-layout tensor (its chunk, or
        with parts its sub-block): a 1-D view, no copy.

        Views of flat storage are taken with ``t[start:stop]`` throughout the package,
        never ``Tensor._slice``: in Paddle 3.3 ``_slice`` leaks a small Python list per
        call (64 bytes here), and the engine takes views on every step."""
        return flat[self.flat_offset:self.flat_offset + self.sub_numel]

    def pieces_of(self, flat) -> list[paddle.Tensor]:
        """The param's sub-blocks of every part in a flat shard-layout tensor, in row
        order (together its inner block): 1-D views, no copy."""
        starts = [q * self.piece_numel + self.offset for q in range(self.parts)]
        return [flat[start:start + self.sub_numel] for start in starts]

    def rank_block(self, full, rank: int) -> paddle.Tensor:
        """Inner rank ``rank``'s block of ``full`` (``[chunk_numel]``), built without a
        padded copy of the whole parameter."""
        start = min(rank * self.rows_per_rank, self.rows)
        stop = min(start + self.rows_per_rank, self.rows)
        block = full.reshape([self.rows, self.row_numel])[start:stop]
        if stop - start < self.rows_per_rank:
            pad = paddle.zeros([self.rows_per_rank - (stop - start), self.row_numel], full.dtype)
            block = paddle.concat([block, pad], axis=0)
        return block.reshape([self.chunk_numel])

    def sub_block(self, full) -> paddle.Tensor:
        """The rows of ``full`` the shard parameter holds (padded), in its shape."""
        block = self.rank_block(full, self.inner_rank)
        start = self.part * self.sub_numel
        return block[start:start + self.sub_numel].reshape(self.shard_shape)

    def from_rank_blocks(self, blocks) -> paddle.Tensor:
        """Inverse of :meth:`as_rank_blocks`: ``[I, chunk_numel]`` (or, with parts, the
        ``[I * parts, sub_numel]`` virtual blocks) -> full shape."""
        t = blocks.reshape([self.padded_rows, self.row_numel])
        if self.padded_rows > self.rows:
            t = t[: self.rows]
        return t.reshape(self.shape)

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
        self.shard = shard
        return shard

    def check_dtype(self) -> None:
        """A shard keeps the dtype it was sharded in: its buffer moves one dtype. A cast
        in place (``paddle.amp.decorate(level='O2')`` after fully_shard casts every
        parameter the model yields, i.e. the shards) would leave the buffer stale, and
        copying the value back would quietly undo the cast."""
        shard = self.shard
        if shard is not None and shard._is_initialized() and shard.dtype != self.dtype:
            raise NotImplementedError(
                f"{self.fqn}: its HSDP shard was cast from {_name(self.dtype)} to "
                f"{_name(shard.dtype)} after fully_shard (paddle.amp.decorate(level='O2') "
                "after fully_shard does this). Cast before sharding: call "
                "paddle.amp.decorate(models=model, level='O2', ...) before fully_shard, and "
                "build the optimizer afterwards with multi_precision=True (or decorate it "
                f"then: the parameters are cast already). {POLICY_HINT}")

    # -------------------------------------------------------------- views of flat storage
    def attach_shard(self, flat) -> None:
        """Make the shard param a view of its chunk of the buffer's flat storage."""
        self.piece_of(flat)._share_buffer_to(self.shard)
        self.shard.get_tensor()._set_dims(self.shard_shape)

    def views(self, tensor, flat) -> bool:
        """Whether ``tensor`` (this param's shard, grad or main grad) is its chunk of
        the buffer's flat storage ``flat``, not a copy: one pointer comparison."""
        return (tensor is not None and tensor._is_initialized() and tensor.data_ptr()
                == flat.data_ptr() + self.flat_offset * flat.element_size())

    def shard_is_view_of(self, flat) -> bool:
        return self.views(self.shard, flat)

    def attach_grad(self, flat_grad) -> None:
        """Make the shard's ``.grad`` a view of its chunk of the flat grad storage."""
        self.shard._copy_gradient_from(self.piece_of(flat_grad).reshape(self.shard_shape))

    def grad_is_view_of(self, flat_grad) -> bool:
        return self.views(self.shard.grad, flat_grad)

    def attach_main_grad(self, flat_main_grad) -> None:
        """Make the shard's ``main_grad`` (MixPrecisionLayer's float32 grad) a view of its
        chunk of the buffer's flat main-grad storage."""
        self.shard.main_grad = self.piece_of(flat_main_grad).reshape(self.shard_shape)

    def main_grad_is_view_of(self, flat_main_grad) -> bool:
        return self.views(getattr(self.shard, "main_grad", None), flat_main_grad)

    # -------------------------------------------------------------- module slots
    def point_users_to(self, tensor) -> None:
        """Make every module attribute that names this parameter hold ``tensor``."""
        for module, name in self.users:
            module._parameters[name] = tensor

    def set_full_data(self, tensor) -> None:
        """Give the original parameter (the one autograd knows) this storage."""
        tensor.reshape(self.shape)._share_buffer_to(self.full)

    def free_full_data(self) -> None:
        if self.full._is_initialized():
            self.full._clear_data()

    def full_is_materialized(self) -> bool:
        return self.full._is_initialized()


def _name(dtype) -> str:
    return str(dtype).replace("paddle.", "")
