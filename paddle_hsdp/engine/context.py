"""The engine's runtime state in one object (issue 52), not in module globals.

What a backward is doing (the units whose forward runs, the roots waiting for their
post-backward, how deep the autograd engine is nested, errors a grad hook deferred,
the graphs a backward may still run), the trace's switches and the offload's copy
counters live on :data:`context`; modules read and write them there, so one
:meth:`EngineContext.reset` returns the engine to its state at import (the test suite
calls it between tests) and refuses while a backward is under way.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from .staging import StagingPool


@dataclass
class BackwardState:
    """The forward and backward in flight (engine/hooks.py)."""

    # units whose forward is running, outermost first; a forward that raised leaves
    # stale entries, which the next root's forward clears
    active: list = field(default_factory=list)
    roots_in_backward: list = field(default_factory=list)  # roots owed a post-backward
    depth: int = 0  # > 0 while the autograd engine runs (nested: recompute)
    hook_errors: list = field(default_factory=list)  # raised in a grad hook, re-raised at its end
    # every _BackwardHook node a backward may still run (for the retain_graph refusal)
    live_graphs: weakref.WeakSet = field(default_factory=weakref.WeakSet)
    autograd_wrapped: bool = False  # the autograd entry points are wrapped (once)

    @property
    def in_flight(self) -> bool:
        return self.depth > 0 or bool(self.roots_in_backward)


@dataclass
class TraceState:
    """engine/trace.py's switches (recording events, memory, RSS; the optimizer's bytes)
    and what it recorded since :func:`~.trace.enable`."""

    on: bool = False
    memory: bool = False
    rss: bool = False
    optimizer_bytes: int = 0
    events: list[tuple[str, str, int]] = field(default_factory=list)  # (kind, op, unit)
    times: list[float] = field(default_factory=list)  # time.perf_counter() of each event
    # (op, unit, start, end): when a collective run on the communication thread
    # actually ran there (engine/outer_sync.py), recorded at its wait
    spans: list[tuple[str, int, float, float]] = field(default_factory=list)
    timeline: list[dict] = field(default_factory=list)  # bytes by kind at each event

    def clear(self) -> None:
        for recorded in (self.events, self.times, self.spans, self.timeline):
            recorded.clear()


@dataclass
class OffloadCounters:
    """Host <-> device copies of offloaded buffers (engine/offload.py), for tests and
    the benchmark."""

    uploads: int = 0
    upload_bytes: int = 0
    downloads: int = 0
    download_bytes: int = 0
    waits: int = 0        # host waits for in-flight downloads
    host_steps: int = 0   # optimizer steps run on the host


@dataclass
class OffloadState:
    counters: OffloadCounters = field(default_factory=OffloadCounters)
    device_stack: list = field(default_factory=list)  # the compute device, in on_host()
    issued: int = 0     # downloads issued so far (the newest one's seq)
    completed: int = 0  # every download up to this seq is known to be complete


class MemoryPeaks:
    """``memory_report``'s running figures (engine/memory.py): full-size parameter bytes
    and units gathered now and at their peak, and the peak of full-size grad bytes
    while that sampling is on. Kept as class attributes (``context.memory`` is the
    class): every gather and reshard writes them, and the same writes to a dataclass
    instance's fields measured a growth of the process's Python blocks inside Paddle's
    PyLayer calls, ~1 a step over the first few hundred steps and ~110 before it levels
    off near step 2,000 (test_collective's growth check fails on it); class attributes
    show none. Not understood; measured with tools-free loops of 200-3,000 steps."""

    gathered = gathered_peak = units = units_peak = 0
    sampling_full_grads = False
    full_grads_peak = 0

    @classmethod
    def restart_peaks(cls) -> None:
        """The peaks from what is gathered now (which belongs to the live units)."""
        cls.gathered_peak, cls.units_peak = cls.gathered, cls.units
        cls.full_grads_peak = 0


@dataclass
class EngineContext:
    backward: BackwardState = field(default_factory=BackwardState)
    trace: TraceState = field(default_factory=TraceState)
    offload: OffloadState = field(default_factory=OffloadState)
    # (buffer, PendingReduce) of the reduce-scatters issued and not waited for yet
    # (engine/reductions.py), across all units
    reduces: list = field(default_factory=list)
    staging: StagingPool = field(default_factory=StagingPool)  # engine/staging.py
    memory: type[MemoryPeaks] = MemoryPeaks
    warned_cpu_offload: bool = False  # CPUOffloadPolicy on a CPU-only run, said once

    def reset(self) -> None:
        """Back to the state at import, keeping the autograd wrappers (installed once
        per process). Refused while a backward is under way."""
        if self.backward.in_flight or self.reduces:
            raise RuntimeError("EngineContext.reset() during a backward: "
                               f"{len(self.backward.roots_in_backward)} root(s) owed a "
                               f"post-backward, autograd depth {self.backward.depth}, "
                               f"{len(self.reduces)} reduce-scatter(s) in flight")
        if self.staging.taken_bytes:
            raise RuntimeError("EngineContext.reset() with staging tensors handed out "
                               f"({self.staging.taken_bytes} bytes): a collective or a "
                               "grad grid still uses them")
        wrapped = self.backward.autograd_wrapped
        self.backward = BackwardState(autograd_wrapped=wrapped)
        self.trace = TraceState()
        self.offload = OffloadState()
        self.staging = StagingPool()
        # what is gathered now belongs to the units (the registry's), not to history:
        # kept, the peaks restart from it
        self.memory.restart_peaks()
        self.memory.sampling_full_grads = False
        self.warned_cpu_offload = False


context = EngineContext()
