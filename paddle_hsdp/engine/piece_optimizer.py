"""HFSDP's re-cut ([Note: the re-cut] in ft/pieces.py): the optimizer of each piece a
replica holds besides its own (ft reaches it through :mod:`.replication`).

The replica's optimizer was built over views of its own piece of each flat shard; every
replica holds the whole synced grad shard (the grads are all-reduced whole, [Note:
shared pieces] in engine/buffer/outer_pieces.py) and every piece of the flat shard (the
rebuild broadcasts them). A piece it holds besides its own therefore needs only an
optimizer of its own: a shallow copy of the replica's (same class, hyperparameters and
learning rate, the scheduler shared) over plain views of that piece, stepped after the
replica's own step. It has no clip: the HSDP clip already scaled the whole synced grad
shard in place, that piece's grads included. Its parameters are not the engine's (the
step boundary leaves them alone: no second sync, clip or rebuild), and carry the
shards' names, so its state has the keys a holder of that piece has; its
accumulators are renamed after a holder's when it takes that state (Paddle names a
second optimizer's ``w_moment1_1`` where the holder has ``w_moment1_0``).
"""

from __future__ import annotations

import collections
import copy
import re
from typing import TYPE_CHECKING

import paddle
from paddle.base import framework
from paddle.base.framework import EagerParamBase

from .optimizers import sharded_params_of, unwrap_optimizer
from .param import carried_marks

if TYPE_CHECKING:
    from paddle.optimizer import Optimizer

    from .param import ShardedParam

_UNIQUE_SUFFIX = re.compile(r"_\d+$")


class PieceOptimizer:
    """Piece ``piece`` of every trainable shard of ``optimizer`` (the replica's), with an
    optimizer of its own."""

    def __init__(self, optimizer: Optimizer, piece: int):
        self.piece = piece
        main = unwrap_optimizer(optimizer)
        why = why_no_second_piece(optimizer)
        if why is not None:
            raise NotImplementedError(f"paddle_hsdp.ft: {why}")
        shards = _shards(main)
        self._views = [(_view_at(sp, piece, index), sp.buffer) for sp, index in shards]
        params = [v.shard for v, _ in self._views]
        self.optimizer = _copy_over(main, params)
        for view, buf in self._views:
            view.attach_shard(buf.storage.raw)
        self.optimizer._create_accumulators(framework.default_main_program().global_block(),
                                            params)

    def step(self) -> None:
        """Update the piece from the step's synced (and clipped) grads, in place: its
        parameters and grads viewed anew (a buffer's storage may have been replaced
        since the last step)."""
        for view, buf in self._views:
            if buf.grads.flat is None:
                raise RuntimeError(f"paddle_hsdp.ft: {buf.describe()} has no grads to "
                                   f"step piece {self.piece} with")
            view.attach_shard(buf.storage.raw)
            view.attach_grad(buf.grads.flat)
        self.optimizer.step()

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def set_state_dict(self, state: dict) -> None:
        load_renamed(self.optimizer, state)


def load_renamed(optimizer: Optimizer, state: dict) -> None:
    """Load a holder's ``state`` of the same parameters into ``optimizer``, whose
    accumulators are first renamed after the holder's (the same parameter and
    accumulator, another unique suffix: ``w_moment1_1`` takes ``w_moment1_0``)."""
    by_stem = {_UNIQUE_SUFFIX.sub("", k): k for k, v in state.items()
               if isinstance(v, paddle.Tensor)}
    for per_param in optimizer._accumulators.values():
        for tensor in per_param.values():
            tensor.name = by_stem.get(_UNIQUE_SUFFIX.sub("", tensor.name), tensor.name)
    optimizer.set_state_dict(state)


def why_no_second_piece(optimizer: Optimizer) -> str | None:
    """Why a group training with ``optimizer`` cannot hold a second piece (then the
    pieces are not re-cut: redundancy comes back only when a holder rejoins), or None."""
    main = unwrap_optimizer(optimizer)
    if getattr(main, "_multi_precision", False):
        return "its optimizer keeps master weights (multi_precision)"
    if any(isinstance(g, dict) for g in main._param_groups):
        return "its optimizer has parameter groups"
    if any(sp.buffer.grads.main_grads for sp, _ in _shards(main)):
        return "its grads are MixPrecisionLayer's main grads"
    return None


def _shards(optimizer: Optimizer) -> list[tuple[ShardedParam, int]]:
    """The trainable shards of HFSDP's shared pieces ``optimizer`` updates, each with its
    place in its buffer."""
    sps = [p._hsdp_sharded_param for p in sharded_params_of(optimizer)]
    sps = [sp for sp in sps if sp.trainable and sp.buffer.shared_pieces]
    index = {id(sp): i for buf in {id(sp.buffer): sp.buffer for sp in sps}.values()
             for i, sp in enumerate(buf.params)}
    return [(sp, index[id(sp)]) for sp in sps]


def _view_at(sp: ShardedParam, piece: int, index: int) -> ShardedParam:
    """``sp`` placed at piece ``piece`` of its buffer, with a plain parameter of that
    piece's shape, the shard's name and marks (not the engine's: no sharded-param
    link)."""
    view = copy.copy(sp)
    view.part = piece
    view.place(sp.buffer.layout, index)
    view.shard = EagerParamBase(shape=view.shard_shape, dtype=sp.dtype, name=sp.shard.name,
                                trainable=sp.trainable)
    view.shard.stop_gradient = sp.shard.stop_gradient
    for name, value in carried_marks(sp.full).items():
        setattr(view.shard, name, value)
    return view


def _copy_over(optimizer: Optimizer, params: list[EagerParamBase]) -> Optimizer:
    """A shallow copy of ``optimizer`` over ``params`` with a state of its own, no clip
    (its learning rate, a scheduler included, is the same object)."""
    clone = copy.copy(optimizer)
    clone._parameter_list, clone._param_groups = list(params), list(params)
    clone._accumulators = collections.defaultdict(dict)
    clone._accumulators_holder, clone._master_weights, clone._master_grads = {}, {}, {}
    clone._already_create_accumulator, clone._opti_name_list = set(), []
    clone._param_device_map, clone._auxiliary_vars = {}, {}
    clone._grad_clip = None
    return clone


class PieceOptimizers:
    """The optimizers of the pieces this replica holds besides its own, by piece."""

    def __init__(self) -> None:
        self.by_piece: dict[int, PieceOptimizer] = {}

    def take(self, optimizer: Optimizer, pieces: frozenset[int]) -> None:
        """An optimizer for each of ``pieces`` not held yet (its state comes in the
        round's transfer); the others stay until :meth:`keep_only` (one may still send
        its piece in this round's transfer)."""
        for q in sorted(pieces - set(self.by_piece)):
            self.by_piece[q] = PieceOptimizer(optimizer, q)

    def keep_only(self, pieces: frozenset[int]) -> None:
        """The round's transfer is over: the pieces it no longer holds go."""
        for q in [q for q in self.by_piece if q not in pieces]:
            del self.by_piece[q]

    def step(self) -> None:
        for q in sorted(self.by_piece):
            self.by_piece[q].step()
