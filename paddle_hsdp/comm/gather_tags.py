"""Catch ranks that disagree on an all-gather, for a few elements per call.

A unit that runs on some ranks but not on others makes ranks pair up different
all-gathers. When the buffers have the same size nothing fails: each rank silently
combines its own rows with another unit's rows. So every all-gather a buffer issues
has a short tag gathered beside it (a second, tiny all-gather issued just before it:
the tag cannot ride in the shard, since the gathered buffer must hold parameters that
straddle two ranks' segments contiguously), and the tags that come back are compared
with our own before the result is used:

    [unit index mod 256, unit index div 256, buffer index, purpose, call number mod 256,
     forward position]

Every value is below 256, exact in every floating dtype a buffer may gather in
(bfloat16 included) and in integer ones. The call number counts this process's
all-gathers on that group: every member issues the same sequence on a group, so it
also catches a rank that made one extra call (say ``state_dict()`` on rank 0 only).

The forward position is a running hash (mod 256) of the units whose forward ran since
the current root forward began (the engine feeds it: :func:`start_forward`,
:func:`note_forward`). With prefetch, a unit skipped on some ranks often leaves the
next all-gathers identical (every rank prefetches by the recorded order), and the
ranks only part at a later collective, often one of another size, which gloo aborts
on and NCCL hangs on. The position differs from the first all-gather after the skip,
so the skip is named there, at any step.

Cost: one small collective (``TAG_NUMEL`` elements per rank) per all-gather, counted
as ``all_gather_tags`` by the byte counter, and a comparison of
an ``[inner, TAG_NUMEL]`` array. On CPU the comparison runs at once; on a device it is
kept as a device-side flag, so that no all-gather forces a host sync, and the flags are
read together (one stacked device-to-host copy, :func:`raise_pending`):

* at the optimizer step (the step boundary);
* at the end of a root unit's forward run without grad or in eval mode (the engine
  calls :func:`raise_pending`): evaluation and generation never step, and a mismatch
  found there is reported by the end of that forward;
* when :func:`pending_count` reaches :func:`pending_cap` (forwards with grad that never
  step): ``PENDING_CAP``, or twice the most flags one optimizer step has read, so a
  training step is not cut by an extra read once its size is known.

Buffers of sizes that differ across ranks never get that far: gloo aborts the process,
NCCL hangs; the debug fingerprint mode of the reliability work covers those.
"""

from __future__ import annotations

import weakref
from collections import defaultdict, deque
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

import numpy as np

import paddle

from . import watchdog
from .state import state

if TYPE_CHECKING:
    from paddle._typing import DTypeLike, PlaceLike
    from paddle.distributed.communication.group import Group

TAG_NUMEL = 6
POSITION_SLOT = 5  # the forward position's element in a tag
PURPOSES = {"compute": 1, "params": 2, "grads": 3}
_PURPOSE_NAMES = {v: k for k, v in PURPOSES.items()}
_HISTORY = 6  # calls remembered per group, for the error message

_calls: dict[int, int] = defaultdict(int)  # group id -> all-gathers issued so far
_history: dict[int, deque] = defaultdict(lambda: deque(maxlen=_HISTORY))
_pending: list[tuple] = []  # device-side mismatch flags not read yet
# (unit, buffer, purpose, dtype, place) -> [256, TAG_NUMEL]: row n is call number n's tag
_tables: dict[tuple, paddle.Tensor] = {}
PENDING_CAP = 256  # flags kept before a read, at least (see pending_cap)
# Keep the comparison on the device as a flag even for CPU tensors: tests set it to
# exercise the device path on CPU. Off: CPU tags are compared at once.
DEFER_ON_CPU = False
# What a buffer holds, given (unit index, buffer index), for the error message; the
# engine sets it (comm imports nothing above it). None, or an answer of None: indices.
# The forward position: its hash, the units behind it (for the message), and one
# [256] table of the values per (dtype, place), so a tag's position is a view too.
_FORWARD_HISTORY = 12
_forward_units: deque = deque(maxlen=_FORWARD_HISTORY)
_position_tables: dict[tuple, paddle.Tensor] = {}


class CollectiveMismatchError(RuntimeError):
    """Ranks of one group issued different all-gathers at the same point."""


def can_tag(dtype: DTypeLike) -> bool:
    return dtype != paddle.bool and "complex" not in str(dtype)


def start_forward() -> None:
    """A root forward begins: the forward position starts again."""
    state.forward_position = 0
    _forward_units.clear()


def note_forward(unit_index: int) -> None:
    """Unit ``unit_index``'s forward begins (before it gathers or prefetches)."""
    state.forward_position = (state.forward_position * 31 + unit_index + 1) % 256
    _forward_units.append(unit_index)


def make_tag(group: Group, unit_index: int, buffer_index: int, purpose: str,
             describe: Callable[[], str], dtype: DTypeLike, place: PlaceLike) -> paddle.Tensor:
    """This call's tag as a ``[TAG_NUMEL]`` tensor of ``dtype`` on ``place``; records the
    call. A view of a table built once per (buffer, purpose, dtype, place), its
    position written in from a table of positions: no host-to-device copy per
    all-gather (a row is written again only 256 calls later)."""
    number = _calls[group.id]
    _calls[group.id] = number + 1
    _history[group.id].append((number, _weakly(describe), purpose, state.forward_position,
                               tuple(_forward_units)))
    key = (unit_index, buffer_index, purpose, str(dtype), str(place))
    table = _tables.get(key)
    if table is None:
        values = np.zeros([256, TAG_NUMEL], dtype="float64")
        values[:, :4] = [unit_index % 256, unit_index // 256 % 256, buffer_index % 256,
                         PURPOSES[purpose]]
        values[:, 4] = np.arange(256)
        table = _tables[key] = paddle.to_tensor(values, dtype=dtype, place=place)
    positions = _position_tables.get(key[3:])
    if positions is None:
        positions = _position_tables[key[3:]] = paddle.to_tensor(
            np.arange(256, dtype="float64"), dtype=dtype, place=place)
    row = table[number % 256]
    paddle.assign(positions[state.forward_position:state.forward_position + 1],
                  output=row[POSITION_SLOT:POSITION_SLOT + 1])
    return row


def check(tags: paddle.Tensor, own_tag: paddle.Tensor, group: Group) -> None:
    """Compare every rank's tag (``tags``: ``[n, TAG_NUMEL]``) with ours."""
    if tags.place.is_cpu_place() and not DEFER_ON_CPU:
        _compare(tags.numpy(), own_tag.numpy(), group)
        return
    bad = paddle.any(tags != own_tag.reshape([1, -1]))
    # this rank's calls as they are now, for the message of a later read
    _pending.append((bad, tags, own_tag, group, tuple(_history[group.id])))
    if len(_pending) >= pending_cap():
        raise_pending()


def pending_count() -> int:
    """Device-side flags recorded and not read yet."""
    return len(_pending)


def pending_cap() -> int:
    """How many flags are kept before a read: ``PENDING_CAP``, or twice the most one
    step boundary has read."""
    return max(PENDING_CAP, 2 * state.step_peak)


def raise_pending(step: bool = False) -> None:
    """Read the device-side flags recorded since the last call: one stacked copy to the
    host (one sync) when there are any, nothing otherwise; raise
    :class:`CollectiveMismatchError` for the first mismatch. ``step``: called at the
    optimizer step (its count sets :func:`pending_cap`)."""
    if not _pending:
        return
    pending, _pending[:] = list(_pending), []
    if step:
        state.step_peak = max(state.step_peak, len(pending))
    # on NCCL this read waits for the gathers queued before it: bounded like them
    with watchdog.host_sync(f"the read of {len(pending)} all-gather tag flag(s)"):
        flags = paddle.stack([entry[0] for entry in pending]).numpy()
    if not flags.any():
        return
    _, tags, own_tag, group, history = pending[int(np.argmax(flags))]
    _compare(tags.numpy(), own_tag.numpy(), group, history)


def _compare(tags: np.ndarray, own: np.ndarray, group: Group,
             history: Sequence[tuple] | None = None) -> None:
    tags = tags.astype("int64")
    own = own.astype("int64")
    for i, row in enumerate(tags):
        if not np.array_equal(row, own):
            raise CollectiveMismatchError(_message(group, i, row, own, history))


def _message(group: Group, peer_index: int, row: np.ndarray, own: np.ndarray,
             history: Sequence[tuple] | None = None) -> str:
    unit_index = int(row[0]) + 256 * int(row[1])
    peer = group.ranks[peer_index]
    what = _PURPOSE_NAMES.get(int(row[3]), "unknown")
    history = _history[group.id] if history is None else history
    rule = ("Every rank must run the same fully_shard units in the same order (a unit that "
            "runs on some ranks only, e.g. an expert that got no tokens, must still be "
            "called on every rank, on an empty batch), and collective calls such as "
            "state_dict() must be made on every rank.")
    if np.array_equal(row[:POSITION_SLOT], own[:POSITION_SLOT]):
        # the same all-gather, after different forwards: a unit skipped on some ranks
        # this call's entry: the one with its call number
        entry = next((e for e in reversed(history) if e[0] % 256 == int(own[4])), None)
        ran = ", ".join(_describe_unit(u) for u in entry[4]) if entry else "unknown"
        return (
            f"Ranks disagree on the forward before an all-gather in group "
            f"{list(group.ranks)}: rank {peer} and this rank both gathered "
            f"{_describe(unit_index, int(row[2]))} ({what}) as all-gather #{int(row[4])} "
            "(mod 256), but after running the forwards of different units since the root "
            f"forward began (its forward position {int(row[POSITION_SLOT])}, this rank's "
            f"{int(own[POSITION_SLOT])}; this rank ran: {ran}). A unit ran on some ranks "
            "and not on others (a data-dependent skip, a branch taken on some ranks): the "
            f"collectives that follow would pair different units. {rule}")
    mine = "\n".join(f"    all-gather #{entry[0]}: {entry[1]()} ({entry[2]})"
                     for entry in history)
    return (
        f"Ranks disagree on an all-gather in group {list(group.ranks)}: rank {peer} was "
        f"gathering {_describe(unit_index, int(row[2]))} ({what}) as its all-gather "
        f"#{int(row[4])} (mod 256) on this group, while this rank's last all-gathers "
        f"there were:\n{mine}\n{rule}")


def forget_units(indices: Iterable[int]) -> None:
    """Drop the tag tables of units that are gone (paddle_hsdp.forget): indices are
    never reused, so the tables would otherwise grow with every forgotten model."""
    gone = set(indices)
    for key in [k for k in _tables if k[0] in gone]:
        del _tables[key]


def _weakly(describe: Callable[[], str]) -> Callable[[], str]:
    """``describe`` without keeping its buffer alive: the history outlives a model that
    paddle_hsdp.forget released (a bound method is held weakly, said as forgotten once
    its object is gone)."""
    if not hasattr(describe, "__self__"):
        return describe
    method = weakref.WeakMethod(describe)
    return lambda: (method() or (lambda: "a forgotten model's buffer"))()


def set_buffer_describer(describer: Callable[[int, int], str | None]) -> None:
    """How error messages name a peer's buffer (the engine's registry knows)."""
    state.buffer_describer = describer


def set_unit_describer(describer: Callable[[int], str | None]) -> None:
    """How error messages name a unit (the engine's registry knows)."""
    state.unit_describer = describer


def _describe_unit(unit_index: int) -> str:
    text = state.unit_describer(unit_index) if state.unit_describer else None
    return text or f"unit {unit_index}"


def _describe(unit_index: int, buffer_index: int) -> str:
    describer = state.buffer_describer
    text = describer(unit_index, buffer_index) if describer else None
    return text or f"unit {unit_index}, buffer {buffer_index}"
