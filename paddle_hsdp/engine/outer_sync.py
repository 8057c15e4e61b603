"""The outer all-reduce issued during backward, not at the optimizer step.

The step's one outer collective per buffer (the all-reduce; with outer sub-shards the
reduce-scatter) crosses machines: issued at the step, none of it overlaps compute. In
the backward that ends an optimizer step, a buffer's shard grad is final as soon as its
last reduce-scatter is accumulated, so its outer sync can start then and run while the
rest of backward computes (on NCCL on the group's stream; on gloo on the outer group's
communication thread, :class:`paddle_hsdp.comm.collectives._CommThread`).

**Which backward is the last.** Nothing tells the engine. Each root counts its
backwards between optimizer steps (:func:`step_taken`; ``clear_grad`` without a step
restarts the count) and predicts that this step has as many as the last one: one in plain training, k under
k-step accumulation. A wrong guess costs bytes, never correctness: a backward after an
early sync brings the synced grads back to their summed form (``FSDPUnit.grads_synced``)
and the step syncs again. The first step has nothing to go by and syncs at the step,
as does a step with fewer backwards than predicted: the step boundary runs around the
update of every optimizer, whether or not it reaches Paddle's ``_apply_optimize``
(patches/optim.py), so no optimizer steps on unsynced grads. (Syncing at the end of
each of the first step's backwards instead would make its grads final earlier, but
the next micro-step's return to summed form rounds differently from a predicted step,
and a resumed run would no longer repeat the uninterrupted one bit for bit.)

**Order.** Every rank must issue the outer collectives of a group in one order, and
(on NCCL, where communicators share the device) at the same place among the inner
ones. The order is the one the buffers' reduce-scatters finished in during the root's
first backward *on the first rank of the root's FSDP group*: at the end of that
backward every rank adopts it (one broadcast of a few integers, once per root), so the
order is one by construction, even where the data makes the root's buffers finish in
another order on some replicas (a task head one replica uses and another does not).
In a predicted-last backward the longest prefix of it whose buffers have finished this
backward's reduce-scatter is issued at each unit's pre-backward
(:meth:`OuterSyncSchedule.issue_ready`); a buffer that finishes late on some ranks holds
the rest back there, until the end of backward issues it and what follows.

**Waiting.** The end of that backward issues what is left and waits for all of it, so
the grads are final when ``backward()`` returns, as under torch FSDP2: user code that
reads them, the clip and the step see synced grads, and no collective outlives the
backward. A failed backward waits for what was issued before dropping it.

Buffers that take part: trainable ones of units with ``enable_tensor_fusion_and_overlap``
and ``requires_all_reduce`` on, not offloaded (their grads reach the host only at the
step's settle: docs/gpu.md). The others sync at the step as before.
"""

from __future__ import annotations

import paddle

from ..comm import collectives as comm
from ..comm.traits import traits_of
from . import owned_exchange
from .registry import registry
from .states import GradState, SyncSchedule, move

# Tests switch it off to compare with the step-time sync (same numbers, other schedule).
ENABLED = True


class OuterSyncSchedule:
    """One root's prediction of the step's last backward and its early outer syncs."""

    label = "the outer-sync schedule"  # (what states.move names in an error)

    def __init__(self) -> None:
        self.order: list = []  # buffers, in the order their reduce-scatters finished
        self.state = SyncSchedule.RECORDING  # (states.py; the first backward records)
        self.backwards = 0  # this root's backwards since the last step boundary
        self.expected: int | None = None  # backwards the last step had
        self._finished: set[int] = set()  # id(buffer): reduce-scatter done this backward
        self._next = 0  # index in ``order`` of the next buffer to issue
        self._work: list = []  # (buffer, pending, scale), issue order

    @property
    def recording(self) -> bool:
        return self.state is SyncSchedule.RECORDING

    @property
    def active(self) -> bool:
        """This backward is predicted to be the step's last (its syncs go early)."""
        return self.state is SyncSchedule.EARLY

    # ------------------------------------------------------------ the root's calls
    def begin_backward(self) -> None:
        self.backwards += 1
        if not self.recording:
            last = ENABLED and self.expected is not None and self.backwards == self.expected
            move(self, "state", SyncSchedule.EARLY if last else SyncSchedule.WAITING,
                 "begin_backward")
        self._finished.clear()
        self._next = 0

    def step_taken(self) -> None:
        """The optimizer stepped: this step had ``backwards`` backwards."""
        if self.backwards:
            self.expected, self.backwards = self.backwards, 0

    def reduced(self, buf) -> None:
        """``buf``'s reduce-scatter result is in its shard grad."""
        if self.recording:
            if buf not in self.order:
                self.order.append(buf)
            return
        if self.active:
            self._finished.add(id(buf))

    def issue_ready(self) -> None:
        """Issue the outer syncs the finished reduce-scatters allow. Called at each
        unit's pre-backward, after its gather and prefetch and before its compute, so
        on gloo the thread's all-reduce runs beside that compute; any collective of the
        main thread waits for it first (comm.collectives._CommThread)."""
        if self.active:
            self._issue_ready()

    def end_backward(self, group, buffers) -> None:
        """Every reduce-scatter of the backward is done: issue the rest, wait for all,
        and mark the units synced. After the recording backward: adopt the order of the
        first rank of ``group`` (the root's FSDP group; ``buffers``: every trainable
        buffer under the root, the same on every rank)."""
        if self.recording:
            order = agreed_order(self.order, group, buffers)
            outer = buffers[0].outer if buffers else None
            if traits_of(outer).order_agreed_on_it:  # replicas outside ``group``
                order = agreed_order(order, outer, buffers)
            # only once every broadcast went through: one that failed leaves the
            # recording to be redone by the next attempt, on every rank alike
            self.order = order
            move(self, "state", SyncSchedule.WAITING, "end_backward")
            return
        if not self.active:
            return
        move(self, "state", SyncSchedule.WAITING, "end_backward")
        self._issue_ready()
        units = []
        for buf, *_ in self._work:
            if buf.owner not in units:
                units.append(buf.owner)
        done = {id(buf) for buf, *_ in self._work}
        for unit in units:  # a unit is synced whole: buffers the prefix did not reach
            for buf in unit.buffers:
                if buf.trainable and id(buf) not in done:
                    self._issue(buf)
        work, self._work = self._work, []
        finish_outer_syncs(work)  # synced: the step will not sync them again

    def record_again(self) -> None:
        """Forget the agreed order: the next backward records and agrees it anew (and
        syncs at the step). paddle_hsdp.ft calls it on every member of a round that
        changed who trains, so the order is one over the new members by construction,
        whatever each went through before. No backward of that step syncs early
        either (``expected`` forgotten until it ends): with several backwards per step
        the last would, and a replica sitting the step out must zero its grads before
        they are synced (``engine.replication.withhold_grads``)."""
        self.order = []
        self.expected = None
        move(self, "state", SyncSchedule.RECORDING, "record_again")
        self._work, self._next = [], 0
        self._finished.clear()

    def restart_count(self) -> None:
        """Grads were dropped without a step (``clear_grad``): a new count starts."""
        self.backwards = 0

    def reopen(self, buf) -> None:
        """More grads are about to reach ``buf`` after its outer sync was issued this
        backward (a recomputed segment's, a guess gone wrong): finish that sync, and
        bring the buffer back to its summed form (x N / O: the next sync's outer sum
        and 1 / N leave it unchanged; with outer sub-shards only this rank's piece
        holds it: x N) so the new grads add to it; it is synced again later. Other
        buffers of the unit keep their sync."""
        for i, (other, pending, scale) in enumerate(self._work):
            if other is buf:
                del self._work[i]  # finish_outer_sync waits first
                buf.pieces.finish_outer_sync(pending, scale)
                buf.pieces.unsync(buf.owner.summed_scale(buf))
                return

    def abandon(self) -> None:
        """A failed backward: wait for what was issued (its buffers must outlive the
        collectives), use none of it."""
        work, self._work = self._work, []
        if self.active:
            move(self, "state", SyncSchedule.WAITING, "abandon")
        if self.recording:
            self.order.clear()  # a partial order may differ across ranks
        comm.settle(pending.handle for _, pending, _ in work)
        for buf, _, _ in work:  # waited, not landed: its grads are still owed a sync
            buf.grads.reset(GradState.REDUCED)

    # ------------------------------------------------------------ issuing
    def _issue_ready(self) -> None:
        while self._next < len(self.order) and id(self.order[self._next]) in self._finished:
            buf = self.order[self._next]
            self._next += 1
            if _takes_part(buf.owner, buf):
                self._issue(buf)

    def _issue(self, buf) -> None:
        pending = buf.pieces.start_outer_sync(async_op=True, on_thread=True)
        self._work.append((buf, pending, 1.0 / buf.owner.divisor(buf)))


def agreed_order(order: list, group, buffers) -> list:
    """``order`` as the first rank of ``group`` recorded it: it broadcasts its buffers'
    (unit, buffer) indices, padded to ``len(buffers)`` entries so every rank sends and
    receives the same size whatever it recorded."""
    if group.nranks <= 1:
        return order
    codes = [[-1, -1]] * (len(buffers) + 1)
    codes[0] = [len(order), 0]
    codes[1:len(order) + 1] = [[buf.unit_index, buf.index] for buf in order]
    message = paddle.to_tensor(codes, dtype="int64")
    comm.broadcast(message, src=group.ranks[0], group=group, tag="outer sync order")
    rows = message.numpy().tolist()  # once per root, at the end of its first backward
    units = registry.by_index
    return [units[u].buffers[b] for u, b in rows[1:rows[0][0] + 1]]


def finish_outer_syncs(work: list) -> None:
    """Wait for each issued outer sync of ``work`` (``(buffer, pending, scale)``, issue
    order) and land it scaled, then exchange their whole-matrix optimizer's shared
    matrices (engine/owned_exchange.py). If one raises, the rest are waited for before
    the error propagates (their buffers must outlive the collectives)."""
    buffers = [buf for buf, _, _ in work]
    try:
        while work:
            buf, pending, scale = work[0]
            del work[0]  # finish_outer_sync waits first: out of the list is waited
            buf.pieces.finish_outer_sync(pending, scale)
    except BaseException:
        comm.settle(pending.handle for _, pending, _ in work)
        raise
    owned_exchange.exchange(buffers)


def _takes_part(unit, buf) -> bool:
    # ``early_sync`` False on an outer group: it syncs at the step only
    return (buf.trainable and unit.controls.overlap and unit.syncs_grads_over_outer
            and unit.grads_pending_outer_sync and traits_of(buf.outer).early_sync
            and not any(b.host is not None for b in unit.buffers))


def schedule_of(unit) -> OuterSyncSchedule | None:
    root = unit.root()
    return None if root is None else root.outer_sync


def step_taken(units) -> None:
    """The optimizer stepped on ``units``' shards (patches.optim): each root learns how
    many backwards its step had. An explicit ``finish_grad_sync`` is no step: more
    micro-steps may follow it."""
    seen = set()
    for unit in units:
        schedule = schedule_of(unit)
        if schedule is not None and id(schedule) not in seen:
            seen.add(id(schedule))
            schedule.step_taken()
