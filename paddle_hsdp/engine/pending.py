"""Collectives a buffer issued and has not waited for yet: what each keeps alive until
its wait, and the staging tensors it gives back to the pool after it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import paddle

from ..comm import collectives as comm
from .context import context


@dataclass
class PendingGather:
    handle: comm.Handle
    send: paddle.Tensor
    out: paddle.Tensor
    tag: paddle.Tensor | None
    compute: bool
    staged: tuple = ()  # from the staging pool: given back once, after the wait
    tag_handle: comm.Handle | None = None  # the tags' own all-gather
    tags: paddle.Tensor | None = None  # every rank's tag, [inner * TAG_NUMEL]


@dataclass
class PendingReduce:
    handle: comm.Handle
    grid: paddle.Tensor  # the input (kept alive until the wait)
    out: paddle.Tensor
    staged: tuple = ()
    present: tuple = ()  # per param: whether this rank had a grad for it (reduce-scatter)


def release_staging(pending: PendingGather | PendingReduce) -> None:
    """Give a waited collective's staging tensors back to the pool (once)."""
    staged, pending.staged = pending.staged, ()
    give_back(staged)


def give_back(staged: Iterable[paddle.Tensor]) -> None:
    for t in staged:
        context.staging.give(t)


def settle(pendings: Iterable[PendingGather | PendingReduce | None]) -> list[Exception]:
    """Wait for every pending collective (None skipped) even when some fail, then give
    their staging back: for error paths and prefetches never used (see
    :func:`paddle_hsdp.comm.collectives.settle`). Returns the failures."""
    live = [p for p in pendings if p is not None]
    handles = [p.handle for p in live]
    tag_handles = (getattr(p, "tag_handle", None) for p in live)  # a gather's tags'
    handles += [h for h in tag_handles if h is not None]
    failures = comm.settle(handles)
    for p in live:
        release_staging(p)
    return failures


@dataclass
class PendingOuterReduce:
    handle: comm.Handle
    send: paddle.Tensor  # the input (kept alive until the wait)
    out: paddle.Tensor  # this rank's reduced piece
    acc: paddle.Tensor  # the grad shard it lands in


@dataclass
class PendingRebuild:
    handle: comm.Handle
    send: paddle.Tensor
    out: paddle.Tensor
