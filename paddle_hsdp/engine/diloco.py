"""The outer sync every H steps (DiLoCo): ``OuterSyncPolicy(every=H >= 2)``.

Between syncs each outer replica trains on its own: the inner reduce-scatter still
runs, but the grad shard is scaled to the mean over the replica's inner group and the
step's outer collective is skipped (as ``set_requires_all_reduce(False)`` does:
``FSDPUnit.start_grad_sync``), so each replica's inner optimizer steps on its own
data. After every H-th optimizer step of a unit, each of its trainable buffers runs
:func:`_sync_buffer`, in unit and buffer order on every rank:

1. the pseudo-gradient of the shard, ``anchor - params`` (``anchor``: the params at the
   last sync, kept per buffer in the params' dtype), zero-padded to a multiple of O;
2. one reduce-scatter over the outer group: rank q of the outer group receives the sum
   of piece q (1/O of the shard), scaled by 1/O: the replicas' mean. With
   ``outer_compress`` that is the int8/fp8 all-gather of outer_compress.py instead,
   each rank adding up its own piece (with its error feedback);
3. the outer SGD step on that piece with the piece's momentum: ``m = mu m + g``, the
   step ``g + mu m`` (Nesterov) or ``m``, ``new = anchor - lr step``. The momentum is
   held for this rank's piece only, so the outer optimizer's state per rank is
   1/(I x O) of the model; the anchor is 1/I (every replica needs the whole shard's
   pseudo-gradient);
4. one all-gather of the new pieces over the outer group into the shard and the
   anchor: every replica holds the same bits after a sync.

On the wire, per sync: the reduce-scatter and the all-gather, each ``(O - 1) / O`` of
the shard in the params' dtype (an all-reduce's bytes, once per H steps).

**Streaming** (``fragments=F``, streaming DiLoCo): the units training apart are dealt
into F fragments by the bytes a sync moves (:func:`deal_fragments`: the largest unit
first, each into the fragment with the fewest bytes so far; ties by the order every
rank steps the units, so every rank deals alike), and fragment f syncs after the steps
where the position in the interval (``steps``, 0 to H - 1, the same on every unit)
comes round to ``f H // F``: each unit still syncs every H steps, but a sync moves only
its fragment, about 1/F of the bytes, so the link's peak falls about F times. A unit is
never split: one unit larger than 1/F of the model (a root holding the embedding and
head) is a fragment alone and sets the peak. Fragment
f > 0 has a shorter first interval (f H // F steps). The sync blocks the step as with
F = 1 (gloo runs one collective at a time per process, on the main thread here): it is
not overlapped with the next inner steps.

**On paddle_hsdp.ft's replica groups** (``replicated``, set by ``Replica.attach``): the
outer momentum is whole on every group (the live groups' count changes, and a dead
group's piece would go with it), the sync is one all-reduce of the pseudo-gradient,
and a step that comes to a sync owes it to the next attempt, which runs it over the
live groups and undoes it if it fails (:meth:`OuterSyncState.run_owed`,
:meth:`~OuterSyncState.settle`); a rejoiner takes the anchor as its params
(:meth:`~OuterSyncState.took_carried`). docs/fault-tolerance.md, "DiLoCo".

``every=1`` is plain HSDP (this module does nothing): the grads are averaged at every
step. DiLoCo's H=1 with an outer SGD of lr 1 averages the replicas' *updated params*,
which is not HSDP's averaged *grads* under a non-linear optimizer (Adam), so H=1 is
kept to mean HSDP, bit for bit.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import paddle

from ..comm import collectives as comm
from .buffer import outer_compress
from .dtypes import element_size

if TYPE_CHECKING:
    from .buffer.shard_buffer import ShardBuffer
    from .policies import OuterSyncPolicy
    from .unit import FSDPUnit


class OuterSyncState:
    """One unit's DiLoCo state: the position in the interval (``steps``: optimizer
    steps mod H since training began; with one fragment, the steps since the last
    sync), and per trainable buffer (by index) the anchor (the shard at the last sync)
    and the outer momentum of this rank's piece."""

    def __init__(self, policy: OuterSyncPolicy) -> None:
        self.policy = policy
        self.steps = 0
        self._sync_bytes: int | None = None
        self.anchors: dict[int, paddle.Tensor] = {}
        self.momentum: dict[int, paddle.Tensor] = {}
        # paddle_hsdp.ft (replication.keep_outer_state_on_every_replica): the momentum
        # whole on every replica, and the sync owed by the step that came to it, run by
        # the next attempt
        self.replicated = False
        self.owed = False
        self._undo: dict[int, tuple] | None = None  # what the owed sync replaced
        self._carried: paddle.Tensor | None = None  # the position, as a transfer moves it

    def take_anchors(self, unit: FSDPUnit) -> None:
        """Before the first update: the shards now are where the interval starts."""
        for buf in _synced_buffers(unit):
            self._anchor_of(buf)

    def _anchor_of(self, buf: ShardBuffer) -> paddle.Tensor:
        """``buf``'s anchor, taken from its shard now if it has none yet."""
        if buf.index not in self.anchors:
            buf.storage.repair_views()
            self.anchors[buf.index] = buf.storage.raw[:buf.shard_numel].clone()
        return self.anchors[buf.index]

    def reanchor(self, unit: FSDPUnit) -> None:
        """The params changed outside training (a checkpoint's params loaded without its
        optimizer, so without its outer state): the interval goes on from them, so the
        next sync's pseudo-gradient is the change since now. The outer momentum and
        the position in the interval are optimizer state, kept as the inner
        optimizer's is. Local (no collective): every replica loaded the same params."""
        for buf in _synced_buffers(unit):
            if buf.index in self.anchors:
                buf.storage.repair_views()
                self.anchors[buf.index] = buf.storage.raw[:buf.shard_numel].clone()

    def sync_bytes(self, unit: FSDPUnit) -> int:
        """The bytes of ``unit``'s trainable shards (what a sync reduces): alike on every
        rank (the shards are padded to one size), kept once known."""
        if self._sync_bytes is None:
            self._sync_bytes = sum(buf.shard_numel * element_size(buf.dtype)
                                   for buf in _synced_buffers(unit))
        return self._sync_bytes

    def after_step(self, unit: FSDPUnit, fragment: int) -> None:
        """Count the step; sync ``unit`` (in ``fragment``) where its turn came."""
        every = self.policy.every
        self.steps = (self.steps + 1) % every
        if self.steps != fragment * every // self.policy.fragments:
            return
        if self.replicated:  # (ft: the next attempt runs it, and redoes it if that fails)
            self.owed = True
            return
        for buf in _synced_buffers(unit):
            self._sync_buffer(buf)

    def _sync_buffer(self, buf: ShardBuffer) -> None:
        policy, outer = self.policy, buf.outer
        numel, replicas = buf.shard_numel, outer.nranks
        buf.storage.repair_views()  # an optimizer may have given a shard new storage
        shard = buf.storage.raw[:numel]
        anchor = self.anchors[buf.index]
        delta = anchor - shard
        summed, lo, piece = (self._all_reduced(buf, delta) if self.replicated
                             else self._reduced_piece(buf, delta))
        mean = summed * (1.0 / replicas)
        momentum = self.momentum.get(buf.index)
        if momentum is None:
            momentum = paddle.zeros([piece], delta.dtype)
        momentum = momentum * policy.momentum + mean
        step = mean + momentum * policy.momentum if policy.nesterov else momentum
        self.momentum[buf.index] = momentum
        if self.replicated:  # every replica computed the whole shard's new params
            new = anchor - step * policy.lr
            paddle.assign(new, output=shard)
            self.anchors[buf.index] = new
            return
        mine = _padded(anchor, piece * replicas)[lo:lo + piece] - step * policy.lr
        gathered = paddle.empty([piece * replicas], delta.dtype)
        comm.all_gather_into(gathered, mine, outer,
                             what=functools.partial(_label, buf, "outer sync (new params)"))
        paddle.assign(gathered[:numel], output=shard)
        self.anchors[buf.index] = gathered[:numel].clone()

    def _reduced_piece(self, buf: ShardBuffer, delta: paddle.Tensor) -> tuple:
        """The sum over the replicas of this rank's piece of ``delta`` (zero-padded to a
        multiple of O), with the piece's start and size: one reduce-scatter (or the
        compressed all-gather)."""
        numel, replicas = buf.shard_numel, buf.outer.nranks
        piece = -(-numel // replicas)
        if piece * replicas > numel:
            delta = paddle.concat([delta, paddle.zeros([piece * replicas - numel],
                                                       delta.dtype)])
        lo = buf.outer.rank * piece
        if buf.pieces.compresses:
            pending = outer_compress.start(buf, delta, delta, True, async_op=False,
                                           on_thread=False)
            return outer_compress.finish(buf, pending, lo, lo + piece).astype(delta.dtype), \
                lo, piece
        summed = paddle.empty([piece], delta.dtype)
        comm.reduce_scatter(summed, delta, buf.outer,
                            what=functools.partial(_label, buf, "outer sync (pseudo-grad)"))
        return summed, lo, piece

    def _all_reduced(self, buf: ShardBuffer, delta: paddle.Tensor) -> tuple:
        """ft: the whole shard's sum over the live replicas (one all-reduce), so that
        every replica holds the outer state whole and a dead one takes none of it."""
        comm.all_reduce(delta, buf.outer,
                        what=functools.partial(_label, buf, "outer sync (pseudo-grad)"))
        return delta, 0, buf.shard_numel

    # ------------------------------------------------------------ paddle_hsdp.ft
    # A replica group may die in a sync, so under ft the sync is not run by the step
    # that comes to it but by the next step's attempt, before its forward, and undone
    # if that attempt fails (the next one redoes it over the groups still live): the
    # committed state is the last committed step's, the sync included.

    def run_owed(self, unit: FSDPUnit) -> None:
        """The sync a committed step owes, now (a collective over the live groups);
        what it replaces is kept until :meth:`settle`."""
        if not self.owed or self._undo is not None:
            return
        undo = {}
        for buf in _synced_buffers(unit):
            buf.storage.repair_views()
            undo[buf.index] = (buf.storage.raw[:buf.shard_numel].clone(),
                               self.anchors[buf.index], self.momentum.get(buf.index))
        self._undo = undo
        for buf in _synced_buffers(unit):
            self._sync_buffer(buf)

    def settle(self, unit: FSDPUnit, committed: bool) -> None:
        """The attempt that ran the owed sync committed (the sync is done), or failed
        (the shards, anchors and momentum go back to before it; it stays owed)."""
        undo, self._undo = self._undo, None
        if undo is None:
            return
        if committed:
            self.owed = False
            return
        for buf in _synced_buffers(unit):
            shard, anchor, momentum = undo[buf.index]
            buf.storage.repair_views()
            paddle.assign(shard, output=buf.storage.raw[:buf.shard_numel])
            self.anchors[buf.index] = anchor
            if momentum is None:
                self.momentum.pop(buf.index, None)
            else:
                self.momentum[buf.index] = momentum
        unit.reshard(force=True)  # params the failed attempt kept gathered are stale

    def carried(self, unit: FSDPUnit) -> list[tuple[str, paddle.Tensor]]:
        """What a rejoining replica group takes from its donor (ft's transfer writes
        into these, then :meth:`took_carried`): every buffer's anchor and whole
        momentum, and the position in the interval with whether a sync is owed."""
        self.take_anchors(unit)
        out = []
        for buf in _synced_buffers(unit):
            if buf.index not in self.momentum:
                self.momentum[buf.index] = paddle.zeros([buf.shard_numel], buf.dtype)
            out += [(f"unit{unit.index}.buffer{buf.index}.outer_anchor",
                     self.anchors[buf.index]),
                    (f"unit{unit.index}.buffer{buf.index}.outer_momentum",
                     self.momentum[buf.index])]
        self._carried = paddle.to_tensor([self.steps, int(self.owed)], dtype="int64")
        return out + [(f"unit{unit.index}.outer_position", self._carried)]

    def took_carried(self, unit: FSDPUnit) -> None:
        """A rejoining group took its donor's outer state: the position, and the last
        synced model (the anchor) as its params, so that what it trains until the next
        sync is its own change since then, as every replica's is."""
        if self._carried is None:
            return
        self.steps, owed = (int(v) for v in self._carried.numpy())
        self.owed, self._carried = bool(owed), None
        for buf in _synced_buffers(unit):
            buf.storage.repair_views()
            paddle.assign(self.anchors[buf.index], output=buf.storage.raw[:buf.shard_numel])

    # ------------------------------------------------------------ checkpoints
    # Saved per parameter as its optimizer states (checkpoint/items.py): the anchor and
    # the momentum as blocks like the parameter's (so any layout loads them), the
    # position in the interval as one element.

    def gather_momentum(self, unit: FSDPUnit) -> dict[int, paddle.Tensor]:
        """Every buffer's outer momentum as a whole shard (one all-gather of the pieces
        over the outer group per buffer; zeros before the first sync): what a save
        reads blocks from. A collective: every rank of the outer group, in buffer
        order."""
        if self.owed:  # (ft; alike on every rank of every live group)
            raise ValueError(
                f"save_checkpoint: {unit.label} comes to an outer sync (DiLoCo every "
                f"{self.policy.every} steps) that paddle_hsdp.ft runs in the next step's "
                "attempt; a checkpoint now would lose it. Save after a step that does "
                "not come to a sync (one more step).")
        self.take_anchors(unit)
        whole = {}
        for buf in _synced_buffers(unit):
            piece = -(-buf.shard_numel // buf.outer.nranks)
            mine = self.momentum.get(buf.index)
            if self.replicated:  # (ft) every replica holds it whole: nothing to gather
                whole[buf.index] = mine if mine is not None else \
                    paddle.zeros([buf.shard_numel], buf.dtype)
                continue
            if mine is None:
                mine = paddle.zeros([piece], buf.dtype)
            gathered = paddle.empty([piece * buf.outer.nranks], buf.dtype)
            comm.all_gather_into(gathered, mine, buf.outer,
                                 what=functools.partial(_label, buf, "outer momentum (save)"))
            whole[buf.index] = gathered[:buf.shard_numel]
        return whole

    def read_block(self, flat: paddle.Tensor, sp) -> paddle.Tensor:
        """``sp``'s inner block of a shard-layout ``flat`` (the anchor, or a gathered
        momentum), shaped ``[rows held, ...]``."""
        count = sp.row_range(sub=False)[1]
        if count == 0:  # (Paddle will not view an empty slice)
            return paddle.zeros([0] + sp.rest, dtype=flat.dtype)
        return sp.inner_block_of(flat).reshape([count] + sp.rest)

    def write_anchor_block(self, buf: ShardBuffer, sp, block: paddle.Tensor) -> None:
        anchor = self._anchor_of(buf)
        if sp.inner_numel:
            paddle.assign(block.reshape([-1]).astype(buf.dtype),
                          output=sp.inner_block_of(anchor))

    def write_momentum_block(self, buf: ShardBuffer, sp, block: paddle.Tensor) -> None:
        """Write the part of ``sp``'s block (of a loaded whole-shard momentum) that
        falls in this rank's piece; the rest is other replicas' to keep."""
        piece = -(-buf.shard_numel // buf.outer.nranks)
        lo = buf.outer.rank * piece
        if self.replicated:  # (ft) the whole shard's momentum is this replica's
            piece, lo = buf.shard_numel, 0
        start = sp.slot.inner_offset
        first, last = max(start, lo), min(start + sp.inner_numel, lo + piece)
        if first >= last:
            return
        momentum = self.momentum.get(buf.index)
        if momentum is None:
            momentum = self.momentum[buf.index] = paddle.zeros([piece], buf.dtype)
        values = block.reshape([-1]).astype(buf.dtype)[first - start:last - start]
        paddle.assign(values, output=momentum[first - lo:last - lo])


def _label(buf: ShardBuffer, what: str) -> str:
    return f"{buf.describe()}: {what}"


def _padded(flat: paddle.Tensor, numel: int) -> paddle.Tensor:
    extra = numel - flat.shape[0]
    return paddle.concat([flat, paddle.zeros([extra], flat.dtype)]) if extra else flat


def _synced_buffers(unit: FSDPUnit) -> list:
    return [buf for buf in unit.buffers if buf.trainable]


def before_update(units) -> None:
    """The step boundary, before the optimizer's update: units training apart that
    have no anchor yet take it (their first step)."""
    for unit in units:
        if unit.outer_sync is not None:
            unit.outer_sync.take_anchors(unit)


def after_update(units) -> None:
    """The step boundary, after the update (``units`` in one order on every rank):
    each unit training apart counts the step and, every H-th (at its fragment's turn),
    syncs its buffers."""
    apart = [unit for unit in units if unit.outer_sync is not None]
    fragment_of: dict[int, int] = {}
    by_count: dict[int, list] = {}  # (units of policies with another fragment count apart)
    for unit in apart:
        by_count.setdefault(unit.outer_sync.policy.fragments, []).append(unit)
    for count, members in by_count.items():
        dealt = deal_fragments([u.outer_sync.sync_bytes(u) for u in members], count) \
            if count > 1 else [0] * len(members)
        fragment_of.update((id(u), f) for u, f in zip(members, dealt, strict=True))
    for unit in apart:
        unit.outer_sync.after_step(unit, fragment_of[id(unit)])


def deal_fragments(sizes: list[int], count: int) -> list[int]:
    """Each unit's fragment (0 to ``count`` - 1), given the units' sizes in the order
    every rank steps them: the largest first, each into the fragment holding the
    fewest bytes so far (ties: the earlier unit, the lower fragment). Greedy, so the
    largest fragment is at most 4/3 of the best split's (Graham's bound) and never
    below the largest unit; deterministic, so every rank deals alike."""
    held, fragment = [0] * count, [0] * len(sizes)
    for unit in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        lightest = min(range(count), key=lambda f: (held[f], f))
        fragment[unit] = lightest
        held[lightest] += sizes[unit]
    return fragment

