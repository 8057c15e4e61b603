"""An event trace of the engine's schedule, and a memory timeline, for tests, the
benchmark and reading a step.

Off by default (one ``if`` per event). ``paddle_hsdp.engine.trace.enable()`` starts recording
``(kind, op, unit index)`` tuples: ``issue`` / ``wait`` for every collective a buffer
issues and waits (``all_gather``, ``reduce_scatter``, ``all_reduce``), and ``ready``
``reduce_scatter`` when a buffer's full grads are complete, about to be reduced
(the last moment they are all alive); ``forward`` /
``backward`` ``compute`` when a unit's compute is about to start (after its gather and
prefetch: its pre-forward / pre-backward) and ``done`` when it is over (its
post-forward / post-backward); ``backward end`` (unit: the root) when the end of
backward has reduced and resharded everything; ``step done`` (unit -1) after an
optimizer update. What was recorded is :func:`recorded`'s: ``events``, ``times`` (each
event's ``time.perf_counter()``) and ``spans`` (when an outer collective run on the
communication thread, on gloo, started and ended there, so the overlap with the main
thread's events can be read off). On NCCL an ``issue`` returns at once and the
collective runs on the communication stream; the ``wait`` is where the compute stream
starts to depend on it.

**Memory timeline** (``enable(memory=True)``): at every event, one row in
``recorded().timeline``: ``t`` (``time.perf_counter()``), ``event`` (``"kind op"``), ``unit``,
and the bytes the engine holds on this rank by kind (:data:`KINDS`), summed over every
unit of the process:

* ``shard``: the parameter shards; ``shard_grad``: their grads (and float32 main
  grads); ``full_grad``: full-size grads not reduce-scattered yet (a grad grid in use
  counts here, not in ``staging``: engine/buffer/full_grads.py); ``gathered``: full
  parameters gathered now (``memory_report`` gives the same figures: ``grad`` is
  ``shard_grad + full_grad``);
* ``staging``: what the staging pool holds, free or in flight (engine/staging.py:
  reduce-scatter inputs and outputs, all-gather tags, mixed-precision send copies;
  an all-gather's output is the gathered parameters themselves, ``gathered``);
* ``optimizer``: the optimizer's state (moments, master weights) as of its last step
  since :func:`enable` (0 before it).

All of it comes from shapes and Python-side state, never from a device value (no host
sync: ``test/test_host_syncs.py`` runs with it on). ``rss=True`` adds ``rss``, the
process's resident set from ``/proc/self/statm`` (Linux; absent elsewhere).
``tools/bench.py`` draws rank 0's timeline.
"""

from __future__ import annotations

import os
import time

from .context import TraceState, context
from .registry import registry

KINDS = ("shard", "gathered", "full_grad", "shard_grad", "staging", "optimizer")


def enable(memory: bool = False, rss: bool = False) -> None:
    """Start recording events (cleared), and with ``memory`` the timeline (cleared; the
    optimizer's state counts from the next step)."""
    switches = context.trace
    switches.clear()
    switches.on, switches.memory = True, bool(memory)
    switches.rss, switches.optimizer_bytes = bool(rss) and bool(memory), 0


def recorded() -> TraceState:
    """What was recorded since :func:`enable` (``events``, ``times``, ``spans``,
    ``timeline``), kept until the next :func:`enable`."""
    return context.trace


def disable() -> None:
    switches = context.trace
    switches.on = switches.memory = switches.rss = False


def record(kind: str, op: str, unit_index: int) -> None:
    state = context.trace
    if state.on:
        state.events.append((kind, op, unit_index))
        state.times.append(time.perf_counter())
        if state.memory:
            state.timeline.append(sample(f"{kind} {op}", unit_index))


def record_span(op: str, unit_index: int, span) -> None:
    """``span``: ``(start, end)`` of a collective run on the communication thread, or None."""
    if context.trace.on and span is not None:
        context.trace.spans.append((op, unit_index, *span))


def note_optimizer_bytes(nbytes: int) -> None:
    """The optimizer's state after its step (engine/optimizers.optimizer_state_bytes)."""
    context.trace.optimizer_bytes = int(nbytes)


def recording_memory() -> bool:
    return context.trace.on and context.trace.memory


def sample(event: str, unit_index: int) -> dict:
    """One timeline row now (also callable with the timeline off)."""
    row = {"t": time.perf_counter(), "event": event, "unit": unit_index}
    row.update(dict.fromkeys(KINDS, 0))
    for unit in registry.units:
        for kind, nbytes in unit.bytes_by_kind().items():
            row[kind] += nbytes
    row["staging"] = context.staging.staging_bytes
    row["optimizer"] = context.trace.optimizer_bytes
    if context.trace.rss:
        rss = rss_bytes()
        if rss is not None:
            row["rss"] = rss
    return row


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int | None:
    """This process's resident set size now (None where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None
