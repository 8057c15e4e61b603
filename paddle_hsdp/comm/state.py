"""The communication layer's runtime state in one object (issue 52), not in module
globals: the watchdog's thread and the communication thread (made on first use), the
fingerprint check's switch, the all-gather tags' forward position and flag peak, the
describers the engine registers to name units and buffers in messages, the
checkpoint package's resumer (which ft calls), and the groups' declared traits
(comm/traits.py).
:meth:`CommState.reset` returns what a test may change to its state at import; the
threads, once made, live as long as the process."""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


def _fingerprint_from_env() -> bool:
    return os.environ.get("PADDLE_HSDP_CHECK_COLLECTIVES", "0").lower() not in (
        "", "0", "false", "no")


@dataclass
class CommState:
    watchdog_thread: threading.Thread | None = None  # watching collectives
    comm_thread: Any = None  # collectives._CommThread, made when first asked for
    fingerprint_on: bool = field(default_factory=_fingerprint_from_env)
    forward_position: int = 0  # a hash of the unit forwards since the root's (gather_tags)
    step_peak: int = 0  # the most tag flags one step boundary has read
    buffer_describer: Callable[[int, int], str | None] | None = None
    unit_describer: Callable[[int], str | None] | None = None
    # the checkpoint package's resume of a fault-tolerant job from its joint checkpoint
    # (checkpoint/resume.py's ``Resumer``, registered at its import): ft calls it, the
    # two packages knowing nothing of each other
    resumer: Any = None
    # comm/traits.py: what a group is beyond its ranks, held weakly by group
    group_traits: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)

    def reset(self) -> None:
        """Switches and counts back to their state at import (the threads and the
        describers the engine registered at its import kept)."""
        self.fingerprint_on = _fingerprint_from_env()
        self.forward_position = self.step_peak = 0


state = CommState()
