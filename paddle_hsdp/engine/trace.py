"""An event trace of the engine's schedule, for tests and for reading a step.

Off by default (one ``if`` per event). ``paddle_hsdp.engine.trace.enable()`` starts recording
``(kind, op, unit index)`` tuples: ``issue`` / ``wait`` for every collective a buffer
issues and waits (``all_gather``, ``reduce_scatter``, ``all_reduce``), and
``forward`` / ``backward`` when a unit's compute is about to start. On NCCL an
``issue`` returns at once and the collective runs on the communication stream; the
``wait`` is where the compute stream starts to depend on it.
"""

from __future__ import annotations

events: list[tuple[str, str, int]] = []
_on = False


def enable() -> None:
    global _on
    events.clear()
    _on = True


def disable() -> None:
    global _on
    _on = False


def record(kind: str, op: str, unit_index: int) -> None:
    if _on:
        events.append((kind, op, unit_index))
