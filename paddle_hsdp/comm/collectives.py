"""The only module that issues collectives.

Every collective of the project goes through here so that backend quirks are handled
once and every byte is counted once:

* gloo has no reduce-scatter kernel: we reduce each rank's slice to its owner instead
  (same result, more calls; gloo's reduces move about ``(1 + 1/n)`` times a ring
  reduce-scatter's bytes per rank, measured on the two-host benchmark's link; the
  counter records the ring figure, what NCCL's native op moves). Two-rank groups
  exchange their slices with one all-gather instead: exactly a ring's bytes;
* gloo's float16 all-reduce / reduce returns inf: we reduce in float32 and cast back
  (bfloat16 works natively);
* NCCL (and other device backends) use the native ops.

The :data:`counter` records, per group label (or the caller's ``tag``) and per op, calls, payload bytes (the size
of the full tensor the op is about) and the per-rank traffic a ring algorithm moves
(``(n-1)/n`` of the payload for all-gather, reduce-scatter and broadcast, twice that for
all-reduce). Those are the quantities of the volume formulas (docs/architecture.md, topology/cost.py).
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
import warnings
from collections import defaultdict
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Literal, overload

import paddle
import paddle.distributed as dist
from paddle.distributed import collective

from . import fingerprint, watchdog
from .fingerprint import describe
from .state import state
from .traits import traits_of

if TYPE_CHECKING:
    from paddle.distributed.communication.group import Group

    from .fingerprint import Description

# ---------------------------------------------------------------- counter


@dataclass
class OpStats:
    calls: int = 0
    payload_bytes: int = 0
    wire_bytes: float = 0.0


class CommCounter:
    """Calls and bytes per (group label, op); a dict update per collective, no syncs."""

    def __init__(self) -> None:
        self._stats: dict[tuple[str, str], OpStats] = defaultdict(OpStats)

    def record(self, label: str, op: str, payload_bytes: int, wire_bytes: float) -> None:
        s = self._stats[(label, op)]
        s.calls += 1
        s.payload_bytes += payload_bytes
        s.wire_bytes += wire_bytes

    def get(self, label: str, op: str) -> OpStats:
        s = self._stats.get((label, op))
        return OpStats(s.calls, s.payload_bytes, s.wire_bytes) if s else OpStats()

    def snapshot(self) -> dict[tuple[str, str], OpStats]:
        return {k: OpStats(v.calls, v.payload_bytes, v.wire_bytes) for k, v in self._stats.items()}

    def reset(self) -> None:
        self._stats.clear()


counter = CommCounter()

# ---------------------------------------------------------------- groups

_group_labels: dict[int, str] = {}


def name_group(group: Group, label: str) -> None:
    """Give a group the label the counter files its traffic under (first name wins)."""
    _group_labels.setdefault(group.id, label)


def group_label(group: Group) -> str:
    return _group_labels.get(group.id, f"group{group.id}")


def backend_of(group: Group) -> str:
    backend = collective._group_map_backend.get(group)
    if backend is None:  # single-rank or foreign groups: fall back to the default
        backend = collective._default_backend or "gloo"
    return backend


def is_gloo(group: Group) -> bool:
    return backend_of(group) == "gloo"


def numel_of(t: paddle.Tensor) -> int:
    """Element count from the shape (host metadata): ``int(t.numel())`` would read a
    device tensor, a host sync on GPU, once per collective."""
    return math.prod(t.shape)


def _nbytes(t: paddle.Tensor) -> int:
    return numel_of(t) * t.element_size()


# ---------------------------------------------------------------- handles


class UnwaitedCollectiveWarning(RuntimeWarning):
    """An issued collective's handle was garbage-collected without ``wait()``."""


class HandleLedger:
    """Handles made, waited and dropped unwaited, since the process started: three
    integer increments per collective, no syncs. ``dropped`` counts handles
    garbage-collected before anyone called ``wait()`` (each also warns with
    :class:`UnwaitedCollectiveWarning`): on a device their output buffers would have
    gone back to the allocator while the collective could still write them. Tests
    read ``dropped`` and :meth:`outstanding` (issued, not waited, still alive)."""

    def __init__(self) -> None:
        self.issued = self.waited = self.dropped = 0

    def outstanding(self) -> int:
        return self.issued - self.waited - self.dropped

    def snapshot(self) -> dict[str, int]:
        return {"issued": self.issued, "waited": self.waited, "dropped": self.dropped,
                "outstanding": self.outstanding()}


handles = HandleLedger()


class Handle:
    """What an async collective returns: ``wait()`` finishes it (idempotent).

    ``finalize`` runs after the underlying tasks, e.g. the cast back from the float32
    staging tensor of a float16 reduction on gloo. ``keep``: the tensors the collective
    reads or writes, referenced until the wait. A handle dropped without ``wait()`` is
    waited by its ``__del__`` (before the tensors it keeps are freed), counted in
    :data:`handles` and reported with an :class:`UnwaitedCollectiveWarning`: a last
    resort, the engine waits every handle it issues on every path.
    """

    def __init__(self, tasks: Iterable[Any] = (), finalize: Callable[[], object] | None = None,
                 failure: Callable[[Exception], Exception] | None = None,
                 waiting_for: Callable[[], str] | None = None, keep: tuple = ()) -> None:
        self._tasks = [t for t in tasks if t is not None]
        self._finalize = finalize
        self._failure = failure  # turns a backend error into a CollectiveError
        self._waiting_for = waiting_for or (lambda: "an asynchronous collective")
        self._keep = keep
        self._done = False
        self._settled = False  # wait() was called (even if it raised)
        handles.issued += 1

    @classmethod
    def completed(cls) -> "Handle":
        """A handle for work that is already done (nothing to wait for)."""
        handle = cls()
        handle.wait()
        return handle

    def wait(self) -> None:
        if self._done:
            return
        if not self._settled:
            self._settled = True
            handles.waited += 1
        for t in self._tasks:
            try:
                with watchdog.watched(self._waiting_for):
                    t.wait()
            except Exception as e:
                if self._failure is None or isinstance(e, CollectiveError):
                    raise  # (a task run on the communication thread was named there already)
                raise self._failure(e) from e
        if self._finalize is not None:
            self._finalize()
        self._keep = ()
        self._done = True

    def is_completed(self) -> bool:
        return self._done

    def transferred(self) -> bool:
        """Whether the exchange is over whatever the timing: waited for, or run at the
        issue (gloo's emulations; what is left is the caller's own kernels). A task in
        flight counts as not transferred even if it has finished: asking the backend
        would make the answer, and so what the caller does next, differ across ranks."""
        return self._done or not self._tasks

    def span(self) -> tuple[float, float] | None:
        """When the collective ran on the communication thread (``time.perf_counter()``
        start and end), once waited; None for one issued on the caller's thread."""
        for t in self._tasks:
            if getattr(t, "finished", None) is not None:
                return t.started, t.finished
        return None

    def __del__(self):
        if getattr(self, "_settled", True):  # True too if __init__ never finished
            return
        self._settled = True
        handles.dropped += 1
        try:
            warnings.warn(
                f"paddle_hsdp: {self._waiting_for()} was dropped without wait(); waiting "
                "for it now, before its buffers are freed (a bug: please report it)",
                UnwaitedCollectiveWarning, stacklevel=2)
            self.wait()
        except Exception:  # never raise from a finalizer (interpreter exit included)
            pass


def settle(pending: Iterable[Handle | None]) -> list[Exception]:
    """Wait for every handle in ``pending`` (None skipped) even when some fail; return
    the failures. For error paths: every issued collective is waited for before its
    buffers can be freed, and the error being handled is the one that propagates."""
    failures: list[Exception] = []
    for handle in pending:
        if handle is None:
            continue
        try:
            handle.wait()
        except Exception as e:
            failures.append(e)
    return failures


def _finish(handle: Handle, async_op: bool) -> Handle | None:
    if async_op:
        return handle
    handle.wait()
    return None


class CollectiveError(RuntimeError):
    """A collective failed in the backend: a peer died, a link broke, a timeout hit."""


def _failure(op: str, group: Group,
             what: Description) -> Callable[[Exception], CollectiveError]:
    """Make the error a failed ``op`` on ``group`` raises, naming both."""
    def make(error: Exception) -> CollectiveError:
        what_text = describe(what)
        return CollectiveError(
            f"paddle_hsdp: {op} on group '{group_label(group)}' (ranks {list(group.ranks)})"
            f"{' for ' + what_text if what_text else ''} failed: {type(error).__name__}: "
            f"{str(error).strip()[:500]}. "
            + (traits_of(group).failure_advice or _FAILURE_ADVICE))
    return make


_FAILURE_ADVICE = (
    "A rank of this group probably died or stopped answering, or the ranks did not all "
    "make the same collective calls (a call some ranks skipped, e.g. under `if rank == "
    "0`, pairs with another one); this rank stops too (restart the job from the last "
    "checkpoint).")


def _waiting_for(op: str, group: Group, what: Description) -> Callable[[], str]:
    """The watchdog's description of a collective (built only if it times out)."""
    return lambda: (f"{op} on group '{group_label(group)}' (ranks {list(group.ranks)})"
                    + (f" for {describe(what)}" if what else ""))


# ---------------------------------------------------------------- the communication thread


class _CommThread:
    """The one worker thread for every collective issued ``on_thread``.

    gloo runs a collective in the calling thread until it is done, and releases the GIL
    while it waits on the network: on a thread of its own, an outer all-reduce proceeds
    while the main thread computes (measured: a 1 s wait for a late peer hidden entirely
    behind 1.1 s of compute, docs/gpu.md). One thread, not one per group (the dense and
    the expert outer groups may be two group objects): its queue keeps the issue order,
    which every rank shares, and two threads would run two collectives at once (below).

    Paddle 3.3's gloo cannot run two collectives of one process at once, even on groups
    with no rank in common: measured on 4 CPU ranks, a main thread all-reducing over the
    inner pairs while a second thread all-reduces over the outer pairs hangs on every
    rank (both in ``GlooCommContext::AllReduce``, the GIL held). So every gloo collective
    started outside this thread first waits for everything it runs
    (:func:`drain_comm_thread`): here in :func:`_issue`, and for calls that bypass this
    module (a model's own all-to-all, user code) in the gloo process group's methods
    (:mod:`paddle_hsdp.patches.gloo_groups`). A threaded collective overlaps the
    caller's compute, never another collective. NCCL needs none of this: its
    collectives are queued on a stream already."""

    def __init__(self) -> None:
        self.executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="paddle_hsdp-comm",
            initializer=_mark_comm_thread)
        self.pending: list[Future] = []

    def submit(self, fn: Callable[[], object]) -> Future:
        self.pending = [f for f in self.pending if not f.done()]
        future = self.executor.submit(fn)
        self.pending.append(future)
        return future

    def drain(self) -> None:
        """Wait until the queued calls are done (their errors surface at their handles)."""
        if self.pending:
            futures.wait(self.pending)
            self.pending = []


_thread_state = threading.local()


def _mark_comm_thread() -> None:
    _thread_state.comm_thread = True


def on_comm_thread() -> bool:
    """Is the caller the communication thread (whose calls must not wait for it)?"""
    return getattr(_thread_state, "comm_thread", False)


def drain_comm_thread() -> None:
    """Wait until the communication thread runs and has queued no collective (see
    :class:`_CommThread`); a no-op on that thread and before it was started."""
    if state.comm_thread is not None and not on_comm_thread():
        state.comm_thread.drain()


def _verify(op: str, tensor: paddle.Tensor, group: Group, what: Description) -> None:
    """The debug fingerprint (a collective of its own), after the communication thread."""
    if fingerprint.enabled():
        drain_comm_thread()
    fingerprint.verify(op, tensor, group, what)


class _FutureTask:
    """A backend task run on the communication thread: ``wait()`` waits for it and re-raises;
    ``started`` / ``finished``: when it ran there (``time.perf_counter()``)."""

    def __init__(self, run: Callable[[], object]) -> None:
        self.started: float | None = None
        self.finished: float | None = None

        def timed():
            self.started = time.perf_counter()
            try:
                return run()
            finally:
                self.finished = time.perf_counter()
        self.run = timed
        self.future: Future | None = None

    def wait(self):
        return self.future.result()


def _issue(op: str, group: Group, what: Description, call: Callable[[], Any],
           on_thread: bool = False) -> Any:
    """Run the backend call under the watchdog; a backend error becomes a
    :class:`CollectiveError`. ``on_thread``: on the communication thread (:class:`_CommThread`),
    returning a task to wait for; otherwise after whatever that thread still runs."""
    if on_thread:
        if state.comm_thread is None:
            state.comm_thread = _CommThread()
        thread = state.comm_thread
        watchdog.note_issued(_waiting_for(op, group, what))
        task = _FutureTask(lambda: _issue(op, group, what, call))
        task.future = thread.submit(task.run)
        return task
    drain_comm_thread()
    waiting_for = _waiting_for(op, group, what)
    watchdog.note_issued(waiting_for)
    # A group whose hangs something else ends (paddle_hsdp.ft's outer groups: a
    # stopped peer fails the attempt, and the rank must live on) is not watched.
    watched = (contextlib.nullcontext() if traits_of(group).watchdog_exempt
               else watchdog.watched(waiting_for))
    try:
        with watched:
            return call()
    except Exception as e:
        raise _failure(op, group, what)(e) from e


def _check_split(what: str, flat: paddle.Tensor, shard: paddle.Tensor, n: int) -> None:
    if numel_of(flat) != n * numel_of(shard):
        raise ValueError(f"{what} has {numel_of(flat)} elements, expected "
                         f"{n} x {numel_of(shard)}")


def _needs_fp32_staging(tensor: paddle.Tensor, group: Group) -> bool:
    return tensor.dtype == paddle.float16 and is_gloo(group)


# ---------------------------------------------------------------- collectives


# The collectives return a Handle with async_op=True, None without (the overloads say so)
@overload
def all_gather_into(out_flat: paddle.Tensor, shard: paddle.Tensor, group: Group,
                    async_op: Literal[False] = ..., tag: str | None = ...,
                    what: Description = ..., counted_as: str = ...,
                    on_thread: bool = ...) -> None: ...
@overload
def all_gather_into(out_flat: paddle.Tensor, shard: paddle.Tensor, group: Group,
                    async_op: Literal[True], tag: str | None = ..., what: Description = ...,
                    counted_as: str = ..., on_thread: bool = ...) -> Handle: ...
@overload
def all_gather_into(out_flat: paddle.Tensor, shard: paddle.Tensor, group: Group,
                    async_op: bool, tag: str | None = ..., what: Description = ...,
                    counted_as: str = ..., on_thread: bool = ...) -> Handle | None: ...
def all_gather_into(out_flat: paddle.Tensor, shard: paddle.Tensor, group: Group,
                    async_op: bool = False, tag: str | None = None, what: Description = None,
                    counted_as: str = "all_gather", on_thread: bool = False) -> Handle | None:
    """Gather equal shards of the group into ``out_flat`` (rank order), in place.
    ``what`` names the caller's tensors in error messages and fingerprints;
    ``counted_as``: the op the byte counter files it under (``all_gather_tags`` for
    the all-gather check's own small call, engine/buffer/gather.py;
    ``all_reduce_int8`` for the compressed outer all-reduce's). ``on_thread`` (with
    ``async_op``, on gloo): on the communication thread, as :func:`all_reduce`."""
    n = group.nranks
    _check_split("all_gather_into: output", out_flat, shard, n)
    payload = _nbytes(out_flat)
    counter.record(tag or group_label(group), counted_as, payload, payload * (n - 1) / n)
    if n == 1:
        paddle.assign(shard.reshape(out_flat.shape), output=out_flat)
        return _finish(Handle(), async_op)
    what = what or tag
    _verify("all_gather", shard, group, what)
    threaded = on_thread and async_op and is_gloo(group)
    task = _issue("all_gather", group, what, lambda: dist.stream.all_gather(
        out_flat, shard, group=group, sync_op=not async_op or threaded), on_thread=threaded)
    return _finish(Handle([task], failure=_failure("all_gather", group, what),
                          waiting_for=_waiting_for("all_gather", group, what),
                          keep=(out_flat, shard)), async_op)


@overload
def reduce_scatter(out_shard: paddle.Tensor, in_flat: paddle.Tensor, group: Group,
                   async_op: Literal[False] = ..., tag: str | None = ...,
                   what: Description = ..., on_thread: bool = ...) -> None: ...
@overload
def reduce_scatter(out_shard: paddle.Tensor, in_flat: paddle.Tensor, group: Group,
                   async_op: Literal[True], tag: str | None = ..., what: Description = ...,
                   on_thread: bool = ...) -> Handle: ...
@overload
def reduce_scatter(out_shard: paddle.Tensor, in_flat: paddle.Tensor, group: Group,
                   async_op: bool, tag: str | None = ..., what: Description = ...,
                   on_thread: bool = ...) -> Handle | None: ...
def reduce_scatter(out_shard: paddle.Tensor, in_flat: paddle.Tensor, group: Group,
                   async_op: bool = False, tag: str | None = None, what: Description = None,
                   on_thread: bool = False) -> Handle | None:
    """Sum ``in_flat`` over the group; rank i receives slice i in ``out_shard``.
    ``in_flat`` is scratch: on gloo its other slices are overwritten. ``on_thread``
    (with ``async_op``, on gloo): the exchange runs on the communication thread (see
    :func:`all_reduce`); the sum's last add and the copy into ``out_shard`` run at
    ``wait()``, on the caller's thread."""
    n = group.nranks
    _check_split("reduce_scatter: input", in_flat, out_shard, n)
    payload = _nbytes(in_flat)
    counter.record(tag or group_label(group), "reduce_scatter", payload, payload * (n - 1) / n)
    if n == 1:
        paddle.assign(in_flat.reshape(out_shard.shape), output=out_shard)
        return _finish(Handle(), async_op)
    what = what or tag
    _verify("reduce_scatter", in_flat, group, what)
    failure = _failure("reduce_scatter", group, what)
    waiting_for = _waiting_for("reduce_scatter", group, what)
    if not is_gloo(group):
        task = _issue("reduce_scatter", group, what, lambda: dist.stream.reduce_scatter(
            out_shard, in_flat, op=dist.ReduceOp.SUM, group=group, sync_op=not async_op))
        return _finish(Handle([task], failure=failure, waiting_for=waiting_for,
                              keep=(out_shard, in_flat)), async_op)
    exchange, land = _gloo_reduce_scatter(out_shard, in_flat, group)
    threaded = on_thread and async_op
    task = _issue("reduce_scatter", group, what, exchange, on_thread=threaded)
    return _finish(Handle([task] if threaded else [], land, failure, waiting_for,
                          keep=(out_shard, in_flat)), async_op)


def _gloo_reduce_scatter(out_shard: paddle.Tensor, in_flat: paddle.Tensor, group: Group,
                         ) -> tuple[Callable[[], None], Callable[[], None]]:
    """gloo has no reduce-scatter: reduce each slice to the rank that owns it, in place
    (gloo uses a non-owner's input as scratch, which only clobbers slices we never read).
    Returns ``(exchange, land)``: the communication (collective calls only, so it may run
    on the communication thread) and what makes this rank's slice of it (kernels: run by the
    caller's thread)."""
    staged = in_flat.astype("float32") if _needs_fp32_staging(in_flat, group) else in_flat
    flat = staged.reshape([-1])
    size = numel_of(out_shard)
    me = group.rank

    own = flat[me * size:(me + 1) * size]
    if group.nranks == 2:
        # Two ranks: each sends the other its slice (an all-gather of one slice each)
        # and adds what comes back: a ring's bytes, where gloo's reduce moves 1.5x
        # that (measured on the two-host link). Same sum, a + b in either order.
        other = 1 - me
        got = paddle.empty([2 * size], staged.dtype)

        def exchange():
            dist.stream.all_gather(got, flat[other * size:(other + 1) * size],
                                   group=group, sync_op=True)

        def mine():
            a, b = own, got[other * size:(other + 1) * size]
            if a.dtype == paddle.bfloat16:  # CPU has no bfloat16 add: one rounding, below
                a, b = a.astype("float32"), b.astype("float32")
            return a + b
    else:
        def exchange():
            for i, owner in enumerate(group.ranks):
                dist.stream.reduce(flat[i * size:(i + 1) * size], dst=owner,
                                   op=dist.ReduceOp.SUM, group=group, sync_op=True)

        def mine():
            return own

    def land():
        result = mine()
        if result.dtype != out_shard.dtype:
            result = result.astype(out_shard.dtype)
        paddle.assign(result.reshape(out_shard.shape), output=out_shard)
    return exchange, land


_REDUCE_OPS: dict[str, Any] = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


@overload
def all_reduce(tensor: paddle.Tensor, group: Group, async_op: Literal[False] = ...,
               tag: str | None = ..., op: str = ..., what: Description = ...,
               on_thread: bool = ...) -> None: ...
@overload
def all_reduce(tensor: paddle.Tensor, group: Group, async_op: Literal[True],
               tag: str | None = ..., op: str = ..., what: Description = ...,
               on_thread: bool = ...) -> Handle: ...
@overload
def all_reduce(tensor: paddle.Tensor, group: Group, async_op: bool, tag: str | None = ...,
               op: str = ..., what: Description = ..., on_thread: bool = ...,
               ) -> Handle | None: ...
def all_reduce(tensor: paddle.Tensor, group: Group, async_op: bool = False,
               tag: str | None = None, op: str = "sum", what: Description = None,
               on_thread: bool = False) -> Handle | None:
    """Reduce ``tensor`` over the group (``op``: "sum" or "max"), in place.
    ``on_thread`` (with ``async_op``, on gloo): run it on the communication thread, so it
    overlaps the caller's work (see :class:`_CommThread`); elsewhere it is ignored."""
    reduce_op = _REDUCE_OPS[op]
    n = group.nranks
    payload = _nbytes(tensor)
    counter.record(tag or group_label(group), "all_reduce", payload, 2 * payload * (n - 1) / n)
    if n == 1:
        return _finish(Handle(), async_op)
    what = what or tag
    _verify("all_reduce", tensor, group, what)
    failure = _failure("all_reduce", group, what)
    waiting_for = _waiting_for("all_reduce", group, what)
    if _needs_fp32_staging(tensor, group):
        staged = tensor.astype("float32")
        task = _issue("all_reduce", group, what, lambda: dist.stream.all_reduce(
            staged, op=reduce_op, group=group, sync_op=not async_op))
        return _finish(Handle([task], lambda: paddle.assign(staged.astype(tensor.dtype),
                                                            output=tensor), failure,
                              waiting_for, keep=(staged, tensor)), async_op)
    threaded = on_thread and async_op and is_gloo(group)
    task = _issue("all_reduce", group, what, lambda: dist.stream.all_reduce(
        tensor, op=reduce_op, group=group, sync_op=not async_op or threaded),
        on_thread=threaded)
    return _finish(Handle([task], failure=failure, waiting_for=waiting_for, keep=(tensor,)),
                   async_op)


@overload
def broadcast(tensor: paddle.Tensor, src: int, group: Group, async_op: Literal[False] = ...,
              tag: str | None = ..., what: Description = ...) -> None: ...
@overload
def broadcast(tensor: paddle.Tensor, src: int, group: Group, async_op: Literal[True],
              tag: str | None = ..., what: Description = ...) -> Handle: ...
@overload
def broadcast(tensor: paddle.Tensor, src: int, group: Group, async_op: bool,
              tag: str | None = ..., what: Description = ...) -> Handle | None: ...
def broadcast(tensor: paddle.Tensor, src: int, group: Group, async_op: bool = False,
              tag: str | None = None, what: Description = None) -> Handle | None:
    """Copy ``tensor`` from global rank ``src`` to every member, in place."""
    n = group.nranks
    payload = _nbytes(tensor)
    counter.record(tag or group_label(group), "broadcast", payload, payload * (n - 1) / n)
    if n == 1:
        return _finish(Handle(), async_op)
    what = what or tag
    _verify("broadcast", tensor, group, what)
    task = _issue("broadcast", group, what, lambda: dist.stream.broadcast(
        tensor, src=src, group=group, sync_op=not async_op))
    return _finish(Handle([task], failure=_failure("broadcast", group, what),
                          waiting_for=_waiting_for("broadcast", group, what),
                          keep=(tensor,)), async_op)


def scatter(out: paddle.Tensor, full: paddle.Tensor | None, src: int, group: Group,
            tag: str | None = None, what: Description = None) -> None:
    """Chunk ``i`` of ``full`` (on global rank ``src``: ``group.nranks`` equal chunks,
    group-rank order; None elsewhere) into ``out`` on group rank ``i``, in place: each
    rank receives its own chunk only (fully_shard's first cut: P/I bytes a rank, where
    a broadcast of the whole would bring P)."""
    n = group.nranks
    payload = _nbytes(out)
    counter.record(tag or group_label(group), "scatter", payload, payload * (n - 1) / n)
    source = group.ranks[group.rank] == src
    if source:
        if full is None:
            raise ValueError("scatter: the source rank passes the full tensor")
        _check_split("scatter: input", full, out, n)
    if n == 1:
        assert full is not None, "scatter: a group of one is its own source"
        paddle.assign(full.reshape(out.shape), output=out)
        return
    what = what or tag
    _verify("scatter", out, group, what)
    chunks = ([c.reshape(out.shape) for c in full.reshape([n, -1]).unbind(0)]
              if source and full is not None else None)
    _issue("scatter", group, what, lambda: dist.stream.scatter(
        out, chunks, src=src, group=group, sync_op=True))


def send(tensor: paddle.Tensor, dst: int, group: Group, tag: str | None = None,
         what: Description = None) -> None:
    """Send ``tensor`` to global rank ``dst`` of ``group`` and return once it has it:
    gloo's point-to-point calls block until the peer makes the matching call (whatever
    ``sync_op`` says), so the caller orders its sends and receives (pipeline p2p:
    :mod:`paddle_hsdp.patches.cpu_pipeline`). No fingerprint: two ranks take part, not
    the group."""
    payload = _nbytes(tensor)
    counter.record(tag or group_label(group), "send", payload, payload)
    _issue("send", group, what or tag,
           lambda: dist.send(tensor, dst=dst, group=group, sync_op=True))


def recv(tensor: paddle.Tensor, src: int, group: Group, tag: str | None = None,
         what: Description = None) -> None:
    """Receive ``tensor`` in place from global rank ``src`` of ``group`` (blocking; see
    :func:`send`)."""
    counter.record(tag or group_label(group), "recv", _nbytes(tensor), 0.0)
    _issue("recv", group, what or tag,
           lambda: dist.recv(tensor, src=src, group=group, sync_op=True))


def gather(tensor: paddle.Tensor, gather_list: list[paddle.Tensor] | None, dst: int,
           group: Group, tag: str | None = None, what: Description = None) -> None:
    """Every member's ``tensor`` (one shape on all) into ``gather_list`` on global rank
    ``dst`` (a list there, in group-rank order; None elsewhere). What only one rank
    needs reaches only it: W times the bytes arrive there, and nowhere else."""
    n = group.nranks
    payload = _nbytes(tensor)
    counter.record(tag or group_label(group), "gather", payload, payload)
    if n == 1:  # this rank is dst: it passed the list
        assert gather_list is not None, "gather: dst passes gather_list"
        gather_list.append(tensor.clone())
        return
    what = what or tag
    _verify("gather", tensor, group, what)
    _issue("gather", group, what, lambda: dist.gather(
        tensor, gather_list if gather_list is not None else [], dst=dst, group=group,
        sync_op=True))


def barrier(group: Group | None = None) -> None:
    if group is not None and group.nranks == 1:
        return
    label = group_label(group) if group is not None else "world"
    counter.record(label, "barrier", 0, 0.0)
    with watchdog.watched(lambda: f"a barrier on group '{label}'"):
        dist.barrier(group=group)
