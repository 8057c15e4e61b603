"""A fused buffer: the parameters of one unit that travel in one collective.

Parameters are grouped by what must agree inside one collective: dtype, trainable or
frozen, dense or expert (expert buffers use the expert groups).  Optimizer attributes
need not agree, because the optimizer sees per-parameter shards (see :mod:`param`).

This rank's shard of the buffer is the concatenation of its block of every parameter,
``S`` elements; the all-gather output is ``[I, S]`` row-major (rank ``i``'s shard in row
``i``), and the reduce-scatter input is built in the same layout.
"""

from __future__ import annotations

import paddle

from . import comm, gather_check
from .param import ShardedParam


class ShardBuffer:
    """``mp_policy`` (a ``MixedPrecisionPolicy`` or None): the all-gather and compute run
    in ``param_dtype`` and grads are reduced in ``reduce_dtype``; shards, their grads and
    the optimizer stay in the parameters' own dtype (the float32 master copy).
    ``offload_policy`` (``CPUOffloadPolicy``): shards and grads in host memory."""

    def __init__(self, params: list[ShardedParam], inner_group, outer_group, is_expert: bool,
                 mp_policy=None, offload_policy=None):
        self.params = params
        self.inner = inner_group
        self.outer = outer_group
        self.is_expert = is_expert
        self.dtype = params[0].dtype
        self.trainable = params[0].trainable
        floating = self.dtype in (paddle.float32, paddle.float64, paddle.float16, paddle.bfloat16)
        policy = mp_policy if floating else None
        self.gather_dtype = _dtype(getattr(policy, "param_dtype", None)) or self.dtype
        self.reduce_dtype = _dtype(getattr(policy, "reduce_dtype", None)) or self.gather_dtype
        self.compute_dtype = compute_dtype_of(self.gather_dtype)
        # CPUOffloadPolicy on a device build: shards, their grads (and so the optimizer
        # state) live in host memory; collectives and compute run on the device.
        self.offload = offload_policy is not None and getattr(offload_policy, "offloads", False)
        self.pin_memory = bool(getattr(offload_policy, "pin_memory", False))
        self.device = paddle.get_device()
        offset = 0
        for sp in params:
            sp.offset = offset
            offset += sp.chunk_numel
        self.shard_numel = offset
        self.inner_size = inner_group.nranks
        # Fixed per buffer; every unshard/reshard reads them for the memory report.
        self.element_size = _element_size(self.dtype)
        self.compute_element_size = _element_size(self.compute_dtype)
        self.compute_nbytes = sum(sp.numel for sp in params) * self.compute_element_size
        # Set by the unit: which unit this buffer belongs to, for tags and messages.
        self.unit_index, self.index, self.owner = 0, 0, None

    # -------------------------------------------------------------- placement
    def to_device(self, t):
        return t.to(self.device) if self.offload else t

    def to_host(self, t):
        if not self.offload:
            return t
        t = t.cpu()
        return t.pin_memory() if self.pin_memory else t

    def zero_shard_grad(self, sp) -> paddle.Tensor:
        """Zeros shaped like ``sp``'s shard, where its grads live (host when offloaded)."""
        return self.to_host(paddle.zeros(sp.shard_shape, self.dtype))

    # -------------------------------------------------------------- sizes
    @property
    def padded_numel(self) -> int:
        """Elements of the gathered buffer, padding included (``I * S``)."""
        return self.inner_size * self.shard_numel

    @property
    def logical_numel(self) -> int:
        return sum(sp.numel for sp in self.params)

    # -------------------------------------------------------------- sharding
    def shard_from_full(self, src_outer_rank: int) -> None:
        """Cut this rank's blocks out of the local full params, make outer replicas
        identical (broadcast from outer rank ``src_outer_rank``), create shard params."""
        rank = self.inner.rank
        blocks = []
        for sp in self.params:
            # A param built under paddle.LazyGuard() has no data yet: materialise it
            # alone, keep this rank's block, free it; no rank ever holds the full model.
            if not sp.full._is_initialized():
                sp.full.initialize()
            blocks.append(sp.rank_block(sp.full.detach(), rank).clone())
            sp.free_full_data()
        flat = _concat_new(blocks)
        comm.broadcast(flat, src=self.outer.ranks[src_outer_rank], group=self.outer)
        for sp in self.params:
            shard = sp.make_shard_param(
                self.to_host(sp.piece_of(flat).clone()))
            if self.outer.rank != 0:
                shard.is_firstly_shared = False  # a replica: global-norm clip skips it

    def local_shard(self) -> paddle.Tensor:
        """This rank's shard as one flat tensor (from the live shard params)."""
        return _concat_new(self._shard_pieces(grads=False))

    def local_grad_shard(self) -> paddle.Tensor:
        """This rank's grad shard as one flat tensor (zeros where a shard has no grad)."""
        return _concat_new(self._shard_pieces(grads=True))

    def _shard_pieces(self, grads: bool, dtype=None) -> list[paddle.Tensor]:
        pieces = []
        for sp in self.params:
            if grads:
                t = sp.shard.grad if sp.shard.grad is not None else self.zero_shard_grad(sp)
            else:
                t = sp.shard.detach()
            t = t.reshape([-1])
            pieces.append(t if dtype is None or t.dtype == dtype else t.astype(dtype))
        return pieces

    def describe(self) -> str:
        """Which unit and buffer this is, for error messages."""
        first = self.params[0].fqn + (", ..." if len(self.params) > 1 else "")
        owner = self.owner.label if self.owner is not None else f"unit {self.unit_index}"
        return f"{owner}, buffer {self.index} ({first})"

    def gather_full(self, grads: bool = False, compute: bool = False) -> list[paddle.Tensor]:
        """All-gather in the inner group; return each parameter's full tensor (or, with
        ``grads=True``, its full gradient as the shards hold it now). ``compute=True``:
        gather in the policy's ``param_dtype`` and return the compute dtype.

        The shard travels with a few tag elements (see :mod:`gather_check`): ranks that
        pair up different all-gathers raise instead of computing on each other's rows."""
        dtype = self.gather_dtype if compute else self.dtype
        pieces = self._shard_pieces(grads, dtype)
        tag = None
        if gather_check.can_tag(dtype):
            purpose = "grads" if grads else ("compute" if compute else "params")
            tag = gather_check.make_tag(self.inner, self.unit_index, self.index, purpose,
                                        self.describe, dtype)
            pieces.append(tag.to(pieces[0].place) if not tag.place._equals(
                pieces[0].place) else tag)
        row = self.shard_numel + (gather_check.TAG_NUMEL if tag is not None else 0)
        out = paddle.empty([self.inner_size * row], dtype=dtype)
        comm.all_gather_into(out, self.to_device(_concat_new(pieces)), self.inner)
        grid = out.reshape([self.inner_size, row])
        sizes = [sp.chunk_numel for sp in self.params]
        if tag is not None:
            sizes.append(gather_check.TAG_NUMEL)
        parts = paddle.split(grid, sizes, axis=1) if len(sizes) > 1 else [grid]
        if tag is not None:
            gather_check.check(parts.pop(), tag.to(grid.place), self.inner)
        if compute and self.compute_dtype != dtype:
            parts = [p.astype(self.compute_dtype) for p in parts]
        return [sp.from_rank_blocks(part) for sp, part in zip(self.params, parts)]

    # -------------------------------------------------------------- gradients
    def reduce_scatter_grads(self) -> None:
        """Sum full grads over the inner group into this rank's block; accumulate it
        into each shard param's ``.grad``; release the full grads.

        A parameter with no grad on this rank (unused) contributes zeros: every rank
        joins the collective whatever its data did.
        """
        blocks = []
        for sp in self.params:
            g = sp.full.grad
            if g is None:  # every grad of one reduction is cast to the same dtype
                g = paddle.zeros(sp.shape, dtype=self.reduce_dtype)
            blocks.append(sp.as_rank_blocks(g.astype(self.reduce_dtype)))
        grid = paddle.concat(blocks, axis=1) if len(blocks) > 1 else blocks[0]
        out = paddle.empty([self.shard_numel], dtype=self.reduce_dtype)
        comm.reduce_scatter(out, grid.reshape([-1]), self.inner)
        out = self.to_host(out.astype(self.dtype))  # accumulate in the master dtype
        for sp in self.params:
            accumulate_grad(sp.shard, sp.piece_of(out))
            sp.full.clear_gradient(False)

    def all_reduce_grads(self, scale: float) -> None:
        """One outer all-reduce of this rank's grad shard, then scale (``1 / N``)."""
        flat = self.to_device(self.local_grad_shard())
        comm.all_reduce(flat, self.outer)
        self._write_grads(self.to_host(flat * scale))

    def scale_grads(self, scale: float) -> None:
        """Scale the grad shard without an outer all-reduce (replicas step alone)."""
        self._write_grads(self.local_grad_shard() * scale)

    def _write_grads(self, flat) -> None:
        for sp in self.params:
            set_grad(sp.shard, sp.piece_of(flat))


def _concat_new(parts) -> paddle.Tensor:
    """A new flat tensor holding ``parts`` back to back (never an alias of one of them)."""
    return paddle.concat(parts) if len(parts) > 1 else parts[0].clone()


def _dtype(d):
    if d is None:
        return None
    return paddle.base.framework.convert_np_dtype_to_dtype_(d) if isinstance(d, str) else d


def _element_size(dtype) -> int:
    return paddle.zeros([1], dtype=dtype).element_size()


def compute_dtype_of(param_dtype):
    """Paddle's CPU kernels have no bfloat16/float16 matmul: on CPU, parameters gathered
    in those dtypes are computed in float32 (keeping their rounding)."""
    param_dtype = _dtype(param_dtype)
    low = param_dtype in (paddle.bfloat16, paddle.float16)
    return paddle.float32 if low and paddle.get_device().startswith("cpu") else param_dtype


def accumulate_grad(param, value) -> None:
    """``param.grad += value``, creating the grad on first use."""
    set_grad(param, value if param.grad is None else param.grad + value)


def set_grad(param, value) -> None:
    """Overwrite ``param.grad`` in place, so a grad list collected earlier (by an
    optimizer's ``step`` before ``_apply_optimize``) sees the new values."""
    if param.grad is None:
        param._copy_gradient_from(value.clone())
    else:
        paddle.assign(value, output=param.grad)
