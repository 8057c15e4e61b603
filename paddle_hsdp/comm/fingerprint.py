"""Debug mode: before every collective, the ranks of its group compare fingerprints.

The classic silent hang of sharded training is a collective issued with different
sizes or dtypes on different ranks (a unit skipped on one rank, a rank-dependent
branch): NCCL waits forever, gloo aborts the process from its own thread. With the
check on, every collective that :mod:`paddle_hsdp.comm.collectives` issues is preceded by a
fixed-size all-gather of this rank's view of it::

    [op, element count, dtype, call number on this group, description bytes...]

(the description names the unit, buffer and parameters, or the caller's tag). The
fixed size means the check itself can never mismatch; a difference raises
:class:`CollectiveMismatchError` on every rank of the group, before the real
collective, with every rank's view and this rank's recent calls on the group.

Turn it on with ``PADDLE_HSDP_CHECK_COLLECTIVES=1`` in the environment of every rank
(read at import) or ``paddle_hsdp.check_collectives(True)`` on every rank at the same
point. Cost: one extra small all-gather (``(5 + 120) * 8`` bytes per rank) and one host
sync per collective; off by default.
"""

from __future__ import annotations

from collections import defaultdict, deque
from typing import TYPE_CHECKING, Callable, Optional, Union

import numpy as np

import paddle
import paddle.distributed as dist

from . import watchdog
from .gather_tags import CollectiveMismatchError
from .state import state

if TYPE_CHECKING:
    from paddle.distributed.communication.group import Group

# What a collective is for, in messages and fingerprints: text, or (on hot paths) a
# callable that makes the text only when it is needed
Description = Union[str, Callable[[], Optional[str]], None]

_OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "gather", "scatter")
_HEADER, _DESC = 5, 120
_HISTORY = 6

_calls: dict[int, int] = defaultdict(int)
_history: dict[int, deque] = defaultdict(lambda: deque(maxlen=_HISTORY))


def check_collectives(enabled: bool = True) -> None:
    """Turn the fingerprint check on or off (on every rank, at the same point)."""
    if not isinstance(enabled, bool):
        raise TypeError(f"check_collectives(enabled=...) must be True or False, got {enabled!r}")
    state.fingerprint_on = enabled


def enabled() -> bool:
    return state.fingerprint_on


_KNOWN_DTYPES = (paddle.float16, paddle.bfloat16, paddle.float32, paddle.float64, paddle.int8,
                 paddle.uint8, paddle.int16, paddle.int32, paddle.int64, paddle.bool)


def _dtype_code(dtype: object) -> int:
    return sum(ord(c) * 31 ** i for i, c in enumerate(str(dtype))) % (2 ** 31)


def _encode(op: str, numel: int, dtype: object, number: int, what: str) -> np.ndarray:
    row = np.zeros(_HEADER + _DESC, dtype=np.int64)
    desc = what.encode("utf-8", "replace")[:_DESC]
    row[:_HEADER] = [_OPS.index(op) + 1, numel, _dtype_code(dtype), number, len(desc)]
    row[_HEADER:_HEADER + len(desc)] = list(desc)
    return row


def _decode(row: np.ndarray, dtype_names: dict) -> str:
    op, numel, dtype, number, length = (int(v) for v in row[:_HEADER])
    what = bytes(int(b) for b in row[_HEADER:_HEADER + length]).decode("utf-8", "replace")
    name = _OPS[op - 1] if 1 <= op <= len(_OPS) else f"op {op}"
    return (f"{name} #{number} of {numel} elements, "
            f"{dtype_names.get(dtype, f'dtype code {dtype}')}, {what or 'no description'}")


def describe(what: Description) -> str | None:
    """``what`` as text: callers pass a string or, on hot paths, a callable that is only
    called when a message or a fingerprint needs it."""
    return what() if callable(what) else what


def verify(op: str, tensor: paddle.Tensor, group: Group, what: Description) -> None:
    """All-gather this rank's fingerprint of the collective about to run on ``group``
    and raise on every rank if any member's differs. No-op when off or alone."""
    if not state.fingerprint_on or group.nranks <= 1:
        return

    number = _calls[group.id]
    _calls[group.id] = number + 1
    what = describe(what) or ""
    _history[group.id].append(f"{op} #{number}: {int(tensor.numel())} x {tensor.dtype}, "
                              f"{what}")
    mine = _encode(op, int(tensor.numel()), tensor.dtype, number, what)
    out = paddle.empty([group.nranks * mine.size], dtype="int64")
    with watchdog.watched(lambda: f"the fingerprint all-gather before {op} on group "
                                  f"{list(group.ranks)} for {what}"):
        dist.stream.all_gather(out, paddle.to_tensor(mine), group=group, sync_op=True)
    rows = out.numpy().reshape(group.nranks, mine.size)
    if all(np.array_equal(row, mine) for row in rows):
        return
    names = {_dtype_code(d): str(d) for d in _KNOWN_DTYPES}
    views = "\n".join(f"    rank {r}: {_decode(row, names)}"
                      for r, row in zip(group.ranks, rows, strict=True))
    recent = "\n".join(f"    {line}" for line in _history[group.id])
    raise CollectiveMismatchError(
        f"Ranks of group {list(group.ranks)} are about to issue different collectives "
        f"(caught by PADDLE_HSDP_CHECK_COLLECTIVES before any of them ran):\n{views}\n"
        f"This rank's last calls on this group:\n{recent}\n"
        "Every rank must run the same fully_shard units in the same order with the same "
        "shapes and dtypes, and make collective calls (state_dict(), full_state_dict(), "
        "unshard()) on every rank.")
