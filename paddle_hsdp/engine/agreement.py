"""Every rank of an FSDP group agrees on a unit's weights before its shards are cut.

[Note: agreement at sharding] ``fully_shard`` cuts each rank's rows out of the full
parameters that rank holds. Ranks that built the model from different seeds
(PaddleFormers' command line seeds each rank its own way), or that loaded weights on
one rank only, would otherwise train a patchwork of several initialisations, and
nothing would say so. The source is the first rank of each FSDP group (inner rank 0
of outer replica 0), as Paddle's ``DataParallel`` and sharding wrappers broadcast
from their group's first rank:

* ``sync_module_states=True`` (the default): each buffer's rows reach their rank by
  one scatter over the inner group from its first rank (a rank receives its own rows
  only: 1/I of the unit, where a broadcast would bring all of it), then the outer
  broadcast every unit already makes (:meth:`~.buffer.storage.ShardStorage.shard_from_full`);
  the module buffers the unit holds (norm statistics, rotary tables) go by one
  broadcast per dtype over the inner, then the outer group.
* ``sync_module_states=False`` (weights known to be equal: loaded alike on every
  rank): nothing is sent but a fingerprint per tensor, and the call refuses on every
  rank, before anything changes, naming the first tensor that differs and the ranks
  that hold other values than the source.

The groups are the unit's inner and outer groups (the expert ones for expert
parameters), which hold one tensor-parallel slice of one pipeline stage: nothing
crosses mp slices or stages, and no communicator of the FSDP group's size is used.
Parameters built under ``paddle.LazyGuard`` get their values at the cut, on every
rank from its own generator: they are always scattered from the source (their
fingerprint is only "not materialised yet", which must be alike on every rank).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import paddle

from ..comm import collectives as comm
from ..topology.placement import is_expert

if TYPE_CHECKING:
    from ..topology.mesh import Mesh

# the fingerprint of a parameter built under paddle.LazyGuard, not materialised yet
NOT_MATERIALISED = 0


class ReplicaMismatchError(RuntimeError):
    """``fully_shard(..., sync_module_states=False)`` on ranks whose weights differ."""


@dataclass(frozen=True)
class Held:
    """A tensor the agreement is about: its name (the path inside the module passed
    to ``fully_shard``), the tensor, and whether it goes over the expert groups."""

    name: str
    tensor: paddle.Tensor
    expert: bool


def module_buffers(module: paddle.nn.Layer) -> list[Held]:
    """The buffers of ``module``'s subtree that no sharded sub-module holds (those were
    agreed on by that sub-module's call), persistable or not. A buffer of a layer whose
    parameters are all expert ones goes over the expert groups."""
    out: list[Held] = []
    seen: set[int] = set()

    def walk(layer: paddle.nn.Layer, prefix: str) -> None:
        own = [p for p in layer._parameters.values() if p is not None]
        expert = bool(own) and all(is_expert(p) for p in own)
        for name, buf in layer._buffers.items():
            if buf is not None and id(buf) not in seen and buf._is_initialized():
                seen.add(id(buf))
                out.append(Held(f"{prefix}{name}", buf, expert))
        for name, sub in layer._sub_layers.items():
            if sub is not None and "_hsdp_unit_" not in sub.__dict__:
                walk(sub, f"{prefix}{name}.")

    walk(module, "")
    return out


def sync_buffers(held: list[Held], mesh: Mesh) -> None:
    """Make every rank's ``held`` tensors the source's: one broadcast per (dtype,
    expert) over the inner group, then the outer one."""
    for (dtype, expert), group in _buckets(held):
        flat = paddle.concat([h.tensor.detach().reshape([-1]) for h in group])
        _from_first(flat, mesh, expert, f"module buffers ({dtype})")
        offset = 0
        for h in group:
            n = int(h.tensor.numel())
            paddle.assign(flat[offset:offset + n].reshape(h.tensor.shape), output=h.tensor)
            offset += n


def _buckets(held: list[Held]) -> Iterator[tuple[tuple[str, bool], list[Held]]]:
    groups: dict[tuple[str, bool], list[Held]] = {}
    for h in held:
        if int(h.tensor.numel()):
            groups.setdefault((str(h.tensor.dtype), h.expert), []).append(h)
    yield from groups.items()


def _from_first(t: paddle.Tensor, mesh: Mesh, expert: bool, what: str) -> None:
    """``t`` as the FSDP group's first rank holds it, on every rank: from each inner
    group's first rank, then from outer rank 0 (whose inner rank 0 is the source)."""
    for group in (mesh.inner(expert), mesh.outer(expert)):
        comm.broadcast(t, src=group.ranks[0], group=group, tag="agreement", what=what)


def fingerprint(t: paddle.Tensor) -> int:
    """64 bits of checksum of the tensor's bytes (its dtype and shape included): CRC-32
    (every difference of up to 3 bits, every burst of up to 32, is caught) and
    Adler-32 beside it. Not a defence against a forger, only against ranks that
    initialised apart; zlib's checksums run at 2-3 GB/s here, 4-5x a cryptographic
    hash (the whole unit is read once, on the host)."""
    if not t._is_initialized():
        return NOT_MATERIALISED
    data = np.ascontiguousarray(t.detach().cpu().numpy()).reshape([-1]).view(np.uint8).data
    header = f"{t.dtype}{list(t.shape)}".encode()
    crc = zlib.crc32(data, zlib.crc32(header))
    adler = zlib.adler32(data, zlib.adler32(header))
    value = ((adler << 32) | crc) - (1 << 63)  # as a signed int64
    return value or 1


def verify(held: Iterable[Held], mesh: Mesh, what: str) -> None:
    """Refuse, on every rank alike, when any rank's ``held`` tensors differ from the
    FSDP group's first rank's. Per (expert) group: two broadcasts and two all-reduces
    of one integer per tensor, two more only to name the ranks when one differs."""
    by_group: dict[bool, list[Held]] = {}
    for h in held:
        by_group.setdefault(h.expert, []).append(h)
    for expert in (False, True):  # the same order on every rank
        tensors = by_group.get(expert, [])  # the same model: alike on every rank
        if tensors and _group_has_peers(mesh, expert):
            _verify_group(tensors, mesh, expert, what)


def _group_has_peers(mesh: Mesh, expert: bool) -> bool:
    return mesh.inner(expert).nranks * mesh.outer(expert).nranks > 1


def _verify_group(held: list[Held], mesh: Mesh, expert: bool, what: str) -> None:
    # every rank of the group calls this with the same tensors (the same model), so
    # the lengths match
    mine = paddle.to_tensor(np.array([fingerprint(h.tensor) for h in held], "int64"))
    source = mine.clone()
    _from_first(source, mesh, expert, f"{what}: fingerprints")
    differs = (mine != source).astype("int64")
    counts = differs.clone()
    _reduce(counts, mesh, expert, "sum", f"{what}: agreement")
    counted = counts.numpy()
    bad = [int(i) for i in np.flatnonzero(counted)]
    if not bad:
        return
    first = bad[0]
    inner = mesh.inner(expert)
    rank = inner.ranks[inner.rank]  # global
    mine_differs = bool(differs.numpy()[first])
    span = paddle.to_tensor(np.array([rank + 1 if mine_differs else 0,
                                      -(rank + 1) if mine_differs else -(2 ** 62)], "int64"))
    _reduce(span, mesh, expert, "max", f"{what}: the ranks that differ")
    last, low = (int(v) for v in span.numpy())
    count, lowest = int(counted[first]), -low - 1
    ranks = f"rank {lowest}" if count == 1 else f"{count} ranks, from {lowest} to {last - 1}"
    others = "" if len(bad) == 1 else f" (and {len(bad) - 1} more tensors)"
    source_rank = mesh.fsdp_group(expert).ranks[0]
    raise ReplicaMismatchError(
        f"{what} with sync_module_states=False: '{held[first].name}' differs between "
        f"ranks that hold the same slice of the model: {ranks} hold other values than "
        f"rank {source_rank}, the first rank of the {'expert ' if expert else ''}FSDP "
        f"group{others}. Sharding would train a mix of them. Build the model alike on "
        "every rank (the same seed, or the same checkpoint loaded everywhere), or leave "
        "sync_module_states=True (the default): fully_shard then takes every tensor from "
        "the group's first rank. Nothing was sharded.")


def _reduce(t: paddle.Tensor, mesh: Mesh, expert: bool, op: str, what: str) -> None:
    """Over the FSDP group, as the inner then the outer group (no communicator of the
    FSDP group's size)."""
    for group in (mesh.inner(expert), mesh.outer(expert)):
        comm.all_reduce(t, group, tag="agreement", op=op, what=what)
