"""A replica's state, streamed from a donor replica to the ones that need it.

Per local rank ``i``: each receiver's rank ``i`` takes the state of its donor's rank
``i`` (:func:`plan_transfer`: point to point over a process group of the two, the
round's other members not involved; in a round where one replica feeds all the others,
a broadcast over the round's outer group), one tensor at a time (every unit buffer's
flat shard, the parameters and buffers the engine does not shard, then each
optimizer-state tensor), so no rank ever holds more than its own shard plus one tensor
in flight. What is not a tensor (names, shapes and dtypes, the step count, the RNG
state, an LR scheduler's and the user's state) goes first, as JSON, over the same link
(:func:`_meta_over_link`): etcd carries the round's control, not its data. (Through etcd,
round 0's broadcast made every group's ranks read the donor's 0.1-0.4 MB per rank: at
1,024 groups of 8, 1.6 GB out of etcd, whose renewals queued behind it.)

With shared optimizer pieces (HFSDP with redundancy, :mod:`.pieces`) the model comes
from the receiver's donor and each piece's optimizer state from a holder of that piece.

The donor computes each tensor's checksum once and sends them after the tensors; the
receiver compares. Both compute them on a thread of their own while the tensors move
(:class:`_Digests`: the donor hashes tensor k while it is on the wire, the receiver
while k + 1 is), so the check adds little more than the last tensor's hash to the
transfer. With the job's secret (:mod:`.trust`) the checksum is an HMAC-SHA256 of the
bytes (of a large tensor alone, of a run of small ones together), their round, copy and
place (a CRC-32 without one): it catches a
torn or corrupted transfer (a tensor cut short, bytes changed on the way, a tensor
taken from another round or place), and a peer on the link without the secret can
neither forge the list nor craft data that matches it; it does not stop a sender that
holds the secret (a group of the job) from sending a wrong state. The metadata is
signed as a value of etcd would be (bound to its round, copy and place). Receivers take the model's tensors in place and hand the optimizer
its state once everything arrived and checked: a receiver whose transfer fails holds a
state it must not use, and says so at the next round (``fresh``).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import paddle

from ..comm import collectives as comm
from ..comm.gloo_store import forget_group_store
from ..engine import replication
from . import groups
from .pieces import plan_of
from .protocol import FaultToleranceError, round_kv
from .trust import Forged, TransferDigest

if TYPE_CHECKING:
    from paddle.distributed.communication.group import Group
    from paddle.optimizer import Optimizer

    from .kv import SharedData
    from .pieces import PiecePlan
    from .protocol import Round

# an optimizer-state tensor's path in the state dict (a key, or a key and a sub-key)
Path = tuple[str, ...]


def _flatten(state: dict, prefix: Path = ()) -> tuple[list[tuple[Path, paddle.Tensor]], dict]:
    """An optimizer state dict as (path, tensor) pairs and the rest (plain values)."""
    tensors: list[tuple[Path, paddle.Tensor]] = []
    rest = {}
    for name in sorted(state):
        value = state[name]
        if isinstance(value, paddle.Tensor):
            tensors.append((prefix + (name,), value))
        elif isinstance(value, dict) and value and \
                all(isinstance(v, paddle.Tensor) for v in value.values()):
            sub, _ = _flatten(value, prefix + (name,))
            tensors.extend(sub)
        else:
            rest[name] = value
    return tensors, rest


def _unflatten(pairs: Iterable[tuple[Path, paddle.Tensor]], rest: dict) -> dict:
    out = dict(rest)
    for path, tensor in pairs:
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = tensor
    return out


def _dtype(tensor: paddle.Tensor) -> str:
    return str(tensor.dtype).replace("paddle.", "")  # what paddle.zeros takes


def _checksums(store: SharedData, number: int, what: tuple,
               tensors: Iterable[paddle.Tensor]) -> list[int]:
    """The checks of round ``number``'s copy ``what``, in order (:class:`_Digests`'
    blocks), computed one after the other on this thread."""
    with _Digests(store, number, what, thread=False) as digests:
        for tensor in tensors:
            digests.add(tensor)
        return digests.result()


def _bytes_of(tensor: paddle.Tensor) -> memoryview:
    """A tensor's bytes: in place for a contiguous host tensor (``numpy()`` copies, and
    the copy of a 64 MiB tensor took longer here than its hash: 50-100 ms), a host copy
    otherwise. The tensor must outlive the view."""
    size = math.prod(tensor.shape) * tensor.element_size()
    if size and tensor.place.is_cpu_place() and tensor.is_contiguous():
        return memoryview((ctypes.c_char * size).from_address(tensor.data_ptr())).cast("B")
    return np.ascontiguousarray(tensor.numpy()).view(np.uint8).reshape(-1).data


# a tensor this large is checked alone; a run of smaller ones together (one MAC's
# set-up for hundreds of small tensors), handed to the digest thread in batches of
# BATCH_BYTES (one hand-over per tensor would make the two threads trade Python's
# lock at every tensor, each waiting up to its 5 ms switch interval)
THREAD_MIN_BYTES = 1 << 20
BATCH_BYTES = 256 << 10


class _Digests:
    """The checks of one copy, computed on a thread of its own while the caller moves
    its tensors: the job's signer's digest (keyed with the secret, :mod:`.trust`; else
    a CRC-32) of each *block*, a tensor of :data:`THREAD_MIN_BYTES` or more alone, or a
    run of smaller consecutive ones together (each tensor's bytes after its length),
    bound to round ``number``, the copy ``what`` and the block's place. Empty tensors
    count for nothing. hashlib lets go of Python's lock while it hashes, so the thread
    hashes while the caller's sends and receives run: the sender adds every tensor
    before it sends the first (tensor k is hashed while it is on the wire), a receiver
    each tensor once it arrived (k is hashed while k + 1 is on the wire); small
    tensors go to the thread :data:`BATCH_BYTES` at a time. Only the last block's hash,
    at most, is left after the transfer. ``thread`` False: everything on the caller's
    thread, at once. A context: the thread ends with it."""

    def __init__(self, store: SharedData, number: int, what: tuple, thread: bool = True):
        self._signer, self._where = store.signer, (number, *what)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="paddle_hsdp-ft-digest") \
            if thread else None
        self._blocks: list[TransferDigest] = []
        self._jobs: list[Future] = []
        self._run: TransferDigest | None = None  # the open run of small tensors
        self._batch: list[paddle.Tensor] = []  # its tensors not handed over yet
        self._batch_bytes = 0

    def _hash(self, digest: TransferDigest, tensors: list[paddle.Tensor]) -> None:
        for tensor in tensors:
            digest.update(_bytes_of(tensor))

    def _hand_over(self) -> None:
        if self._batch and self._run is not None:
            self._submit(self._run, self._batch)
        self._batch, self._batch_bytes = [], 0

    def _submit(self, digest: TransferDigest, tensors: list[paddle.Tensor]) -> None:
        if self._pool is None:
            self._hash(digest, tensors)
        else:  # one worker: the jobs run in order, a run's batches one after the other
            self._jobs.append(self._pool.submit(self._hash, digest, tensors))

    def add(self, tensor: paddle.Tensor) -> None:
        """Check ``tensor`` (whose bytes no one changes until :meth:`result`) next."""
        size = math.prod(tensor.shape) * tensor.element_size()
        if not size:
            return
        if size >= THREAD_MIN_BYTES:
            self._hand_over()
            self._run = None
            self._blocks.append(self._signer.transfer_digest((*self._where,
                                                             len(self._blocks))))
            self._submit(self._blocks[-1], [tensor])
            return
        if self._run is None:
            self._run = self._signer.transfer_digest((*self._where, len(self._blocks)))
            self._blocks.append(self._run)
        self._batch.append(tensor)
        self._batch_bytes += size
        if self._batch_bytes >= BATCH_BYTES:
            self._hand_over()

    def result(self) -> list[int]:
        """Every block's check, in order, once computed."""
        self._hand_over()
        for job in self._jobs:
            job.result()
        return [digest.value() for digest in self._blocks]

    def __enter__(self) -> _Digests:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            for job in self._jobs:  # a failed transfer: what is not hashed yet is not
                job.cancel()
            self._pool.shutdown(wait=True)


@dataclass(frozen=True)
class Phase:
    """One copy of a round's transfer: ``what`` (``("model",)`` or ``("optimizer",
    piece)``) from ``donor`` to ``takers``."""
    what: tuple
    donor: int
    takers: tuple


def plan_transfer(record: Round, plan: PiecePlan | None) -> tuple[list[Phase], bool]:
    """The round's copies, in one order on every member, and whether they go point to
    point. With two or more up-to-date members, each receiver is fed by its own donor
    (:meth:`Round.donor_of`; each HFSDP piece's optimizer state by a holder of it) over
    a process group of the two, and the round's other members start the step at once;
    otherwise (the first round, or one up-to-date member for everyone: no group would
    be left to go on) one broadcast per tensor over the round's outer group, which
    every member joins."""
    sharded = plan is not None and plan.parts > 1
    receivers = record.receivers
    if len(record.up_to_date) > 1:
        phases = [Phase(("model",), record.donor_of(r), (r,)) for r in receivers]
        for q, piece_donor, takers in _optimizer_phases(record, plan):
            phases += [Phase(("optimizer", q), piece_donor if sharded else record.donor_of(t),
                             (t,)) for t in takers]
        if len(_pairs(phases)) <= groups.MAX_PAIRS:
            return phases, True
    phases = [Phase(("model",), record.donor, tuple(receivers))] if receivers else []
    phases += [Phase(("optimizer", q), d, tuple(t)) for q, d, t in _optimizer_phases(record, plan)]
    return phases, False


def _pair_of(phase: Phase) -> tuple[int, int]:
    """A point-to-point phase's two replicas, (lower, higher)."""
    return tuple(sorted((phase.donor, phase.takers[0])))


def _pairs(phases: Iterable[Phase]) -> list[tuple[int, int]]:
    """The distinct replica pairs of point-to-point phases, sorted."""
    return sorted({_pair_of(p) for p in phases})


def stream_state(store: SharedData, record: Round, group: groups.LiveOuterGroup,
                 model: paddle.nn.Layer, optimizer: Optimizer, extra: dict,
                 piece_optimizers: Mapping[int, Optimizer] | None = None
                 ) -> tuple[dict | None, int]:
    """Copy round ``record``'s state to this rank if its replica is a receiver. Every
    member of ``group`` calls it; point to point, those neither sending nor taking return
    at once. ``extra``: this replica's plain state (step, RNG, scheduler, user; a
    donor's is sent); returns the donor's ``extra`` on a receiver, None elsewhere, and
    the bytes of tensors this rank sent or took (for the log). Each taker checks what it
    took against the checksums its donor computed once per tensor. ``piece_optimizers``:
    HFSDP's re-cut, the optimizer of each piece this replica holds besides its own
    (it sends that piece's state from it, and loads it there)."""
    replica = group.replica
    phases, point_to_point = plan_transfer(record, plan_of(group))
    takers = sorted({t for p in phases for t in p.takers})  # (receivers, a re-cut's takers)
    links = _PairLinks(store, record.number, group, _pairs(phases)) if point_to_point \
        else None
    if point_to_point:
        phases = [p for p in phases if replica == p.donor or replica in p.takers]
    if not phases:
        if point_to_point:  # a bystander: its step's first outer all-reduce would wait
            _await_receivers(store, record, group, takers)  # out the transfer (gloo's timeout)
        return None, 0
    optimizers: dict[Any, Any] = {**(piece_optimizers or {}), "own": optimizer}
    sender = _Sender(store, record, group, model, optimizers, extra)
    kept: dict[tuple, Any] = {}  # what this rank took as a taker, by its phase's what
    moved = 0
    try:
        for phase in phases:
            link = links.of(phase) if links is not None else group
            if replica == phase.donor:
                moved += sender.send(phase, link)
                continue
            took, taken = _take_phase(store, record, group, model, phase, link)
            moved += took
            if taken is not None:
                kept[phase.what] = taken
    finally:
        if links is not None:
            links.forget()  # both ends connected: the rendezvous is over
    for what, taken in kept.items():
        if what[0] == "optimizer":
            paths, targets, rest = taken
            _optimizer_for(optimizers, what).set_state_dict(
                _unflatten(zip(paths, targets, strict=True), rest))
    if replica in record.receivers:
        replication.state_replaced(model)  # views re-pointed, gathered params resharded
    if point_to_point and replica in takers:  # one value per taker, a local rank's a part
        store.set_part(_received_key(record, replica), group.local_rank, group.inner_size,
                       "1")
    return kept.get(("model",)) if replica in record.receivers else None, moved


def _optimizer_for(optimizers: Mapping[Any, Optimizer], what: tuple) -> Optimizer:
    """The optimizer of phase ``what``'s piece: a piece held besides its own has its own
    optimizer (HFSDP's re-cut), its own piece (or HSDP's one) is the replica's ("own")."""
    return optimizers.get(what[1], optimizers["own"])


class _PairLinks:
    """Point to point: the pair groups this rank's phases run over, each connected when
    first used; a pair's index among all the round's ``pairs`` names its rendezvous (the
    same on both ends)."""

    def __init__(self, store: SharedData, round_number: int, group: groups.LiveOuterGroup,
                 pairs: list[tuple[int, int]]):
        self._store, self._round, self._group, self._pairs = store, round_number, group, pairs
        self._made: dict[tuple[int, int], groups.PairGroup] = {}

    def of(self, phase: Phase) -> groups.PairGroup:
        pair = _pair_of(phase)
        if pair not in self._made:
            self._made[pair] = groups.connect_pair(
                self._store, self._round, pair, self._pairs.index(pair), self._group,
                self._store.timeout_s)
        return self._made[pair]

    def forget(self) -> None:
        for link in self._made.values():
            forget_group_store(link.id)


def _take_phase(store: SharedData, record: Round, group: groups.LiveOuterGroup,
                model: paddle.nn.Layer, phase: Phase, link: Group) -> tuple[int, Any]:
    """A phase this rank does not send: its tensors received over ``link``, checked
    and kept where this replica is a taker. Returns the bytes, and what a taker keeps:
    the donor's plain state for the model's phase, ``(paths, tensors, rest)`` for an
    optimizer phase (None elsewhere)."""
    replica, taking = group.replica, group.replica in phase.takers
    meta = _meta_over_link(store, record, (group.local_rank, *phase.what, phase.donor),
                           link, group.virtual_rank(phase.donor))
    if phase.what[0] == "model":
        tensors = replication.state_tensors(model) if taking else None
        _check_same_model(tensors, meta, replica, phase.donor)
        targets = [t for _, t in tensors] if tensors is not None else \
            [paddle.zeros(s, d) for _, s, d in meta["model"]]
    else:
        targets = [paddle.zeros(s, d) for _, s, d in meta["tensors"]]
    moved = _take(store, record.number, link, phase, targets, group, check=taking)
    if not taking:
        return moved, None
    if phase.what[0] == "model":
        return moved, meta["extra"]
    return moved, ([tuple(p) for p, _, _ in meta["tensors"]], targets, meta["rest"])


# how long a bystander waits for a transfer, in round timeouts (a large state on a
# slow link takes long; a failure announced in the round ends the wait at once)
TRANSFER_WAIT_ROUNDS = 10


def _received_key(record: Round, receiver: int) -> str:
    return round_kv(record.number, "received", receiver)


def _await_receivers(store: SharedData, record: Round, group: groups.LiveOuterGroup,
                     takers: list[int]) -> None:
    """A member neither sending nor taking state waits until every taker's rank of its
    local rank has its state (one value per taker on etcd, each local rank's receipt a
    part of it: the receivers, and the takers of a piece the re-cut gave them), so that
    its first outer
    collective does not wait out the transfer under the backend's own timeout (gloo's
    is fixed): the wait is bounded by round timeouts, and ends at once on a failure
    announced in the round."""
    def abort() -> None:
        if store.failed(record.number):
            raise FaultToleranceError(f"paddle_hsdp.ft: a failure was announced in round "
                                      f"{record.number} during its state transfer")
    for receiver in takers:
        store.get_part(_received_key(record, receiver), group.local_rank,
                       store.timeout_s * TRANSFER_WAIT_ROUNDS, abort=abort)


class _Sender:
    """A donor's side: the metadata written once per copy it serves, and each tensor's
    checksum computed once, however many receivers it feeds."""

    def __init__(self, store: SharedData, record: Round, group: groups.LiveOuterGroup,
                 model: paddle.nn.Layer, optimizers: Mapping[Any, Optimizer], extra: dict):
        self.store, self.record, self.group = store, record, group
        self.model, self.optimizers, self.extra = model, optimizers, extra
        self._tensors: dict[tuple, list[paddle.Tensor]] = {}  # what -> [tensor]
        self._meta: dict[tuple, dict] = {}  # what -> its metadata, sent on each link
        # what -> int64 tensor of checksums (None until the first send computes them)
        self._sums: dict[tuple, paddle.Tensor | None] = {}

    def send(self, phase: Phase, link: Group) -> int:
        what = phase.what
        if what not in self._tensors:
            if what[0] == "model":
                named = replication.state_tensors(self.model)
                meta = {"model": _described(named), "extra": self.extra}
                tensors = [t for _, t in named]
            else:
                pairs, rest = _flatten(_optimizer_for(self.optimizers, what).state_dict())
                meta = {"tensors": _described(pairs), "rest": rest}
                tensors = [t for _, t in pairs]
            self._meta[what] = meta
            self._tensors[what] = tensors
            self._sums[what] = None
        _meta_over_link(self.store, self.record, (self.group.local_rank, *what, phase.donor),
                        link, self.group.virtual_rank(phase.donor), self._meta[what])
        tensors, sums = self._tensors[what], self._sums[what]
        check = None if sums is not None else \
            _Digests(self.store, self.record.number, what)  # the first copy's
        moved, computed = _send_checked(link, tensors, phase.donor, self.group, check, sums)
        if sums is None:
            self._sums[what] = computed
        return moved


def _send_checked(link: Group, tensors: list[paddle.Tensor], donor: int,
                  group: groups.LiveOuterGroup, check: _Digests | None,
                  sums: paddle.Tensor | None) -> tuple[int, paddle.Tensor]:
    """The donor's side of one copy: each tensor, then their checks (``sums``, or
    computed by ``check`` while the tensors go). The bytes moved and the checks (int64,
    one per block: :class:`_Digests`)."""
    moved = 0
    with check or contextlib.nullcontext():
        if check is not None:
            for tensor in tensors:
                check.add(tensor)
        for tensor in tensors:
            moved += _move(link, tensor, donor, group)
        if check is not None:
            sums = paddle.to_tensor(np.array(check.result(), dtype="int64"))
    if sums is None:
        raise ValueError("paddle_hsdp.ft: _send_checked needs check or sums (the checks "
                         "computed for an earlier receiver)")
    if sums.shape[0]:
        comm.broadcast(sums, src=group.virtual_rank(donor), group=link, tag="ft state check")
    return moved, sums


def _move(link: Group, tensor: paddle.Tensor, donor: int, group: groups.LiveOuterGroup) -> int:
    """One tensor from ``donor`` over ``link``, in place; its bytes (0 if empty)."""
    if math.prod(tensor.shape) == 0:  # nothing to send (a rank's empty share of a buffer)
        return 0
    comm.broadcast(tensor, src=group.virtual_rank(donor), group=link, tag="ft state")
    return math.prod(tensor.shape) * tensor.element_size()


def _take(store: SharedData, number: int, link: Group, phase: Phase,
          targets: list[paddle.Tensor], group: groups.LiveOuterGroup, check: bool) -> int:
    """Receive ``phase``'s tensors into ``targets`` and, on a taker (``check``), compare
    their checks with those its donor sent after them (round ``number``'s), each
    computed while the next tensors arrive."""
    moved, bad, blocks = _take_checked(link, targets, phase.donor, group,
                                       _Digests(store, number, phase.what) if check else None)
    if bad:
        raise FaultToleranceError(
            f"paddle_hsdp.ft: {len(bad)} of the {blocks} checks of {phase.what} "
            f"received from replica {phase.donor} differ from what it sent (checksums of "
            f"its {len(targets)} tensors, a large one alone, a run of small ones together; "
            f"first: check {bad[0]}); the round is redone")
    return moved


def _blocks(tensors: Iterable[paddle.Tensor]) -> int:
    """How many checks :class:`_Digests` computes for ``tensors`` (from their sizes:
    the same on both sides of a copy)."""
    count, in_run = 0, False
    for tensor in tensors:
        size = math.prod(tensor.shape) * tensor.element_size()
        if size:
            count += not (in_run and size < THREAD_MIN_BYTES)
            in_run = size < THREAD_MIN_BYTES
    return count


def _take_checked(link: Group, targets: list[paddle.Tensor], donor: int,
                  group: groups.LiveOuterGroup,
                  check: _Digests | None) -> tuple[int, list[int], int]:
    """A receiver's side of one copy: each tensor into ``targets``, then the donor's
    checks; with ``check``, this side's are computed while the next tensors arrive
    (:class:`_Digests`) and compared. The bytes moved, the blocks whose checks
    differ, and how many blocks there are."""
    moved, blocks = 0, _blocks(targets)
    with check or contextlib.nullcontext():
        for tensor in targets:
            moved += _move(link, tensor, donor, group)
            if check is not None:
                check.add(tensor)
        if not blocks:
            return moved, [], 0
        # this side's checks first: computed while the donor computes its last ones
        mine = check.result() if check is not None else []
        sent = paddle.zeros([blocks], dtype="int64")
        comm.broadcast(sent, src=group.virtual_rank(donor), group=link, tag="ft state check")
    if check is None:
        return moved, [], blocks
    bad = [i for i, (m, s) in enumerate(zip(mine, sent.numpy().tolist(), strict=True))
           if m != s]
    return moved, bad, blocks


def _check_same_model(tensors: list[tuple[str, paddle.Tensor]] | None, meta: dict, replica: int,
                      donor: int) -> None:
    if tensors is None:
        return
    mine = _described(tensors)
    if mine != meta["model"]:
        first = next(((a, b) for a, b in zip(mine, meta["model"], strict=False) if a != b),
                     f"{len(mine)} tensors here, {len(meta['model'])} there")
        raise FaultToleranceError(
            f"paddle_hsdp.ft: replica {replica} cannot take replica {donor}'s state: "
            "their models differ (names, shapes or dtypes of the shards; the inner degree "
            f"or the sharding must be the same). First difference: {first}")


def _described(tensors: Iterable[tuple[object, paddle.Tensor]]) -> list:
    """``(name, shape, dtype)`` of each named tensor: what a receiver allocates."""
    return [[n, list(t.shape), _dtype(t)] for n, t in tensors]  # as JSON gives it back


MAX_META_BYTES = 64 << 20  # a copy's metadata claiming more is refused unread


def _meta_over_link(store: SharedData, record: Round, where: tuple, link: Group, src: int,
                    meta: dict | None = None) -> dict:
    """What is not a tensor, as JSON over the copy's own ``link`` (never a pickle: what a
    trainer reads from the network must not run code): the donor (global rank ``src``,
    passing ``meta``) broadcasts its length, then its bytes, signed as the etcd value
    ``where`` of round ``record`` would be (:meth:`~.trust.Signer.sign`: with the job's
    secret, a peer on the link cannot forge it, nor replay another round's or place's);
    every other member of ``link`` takes it. Each side gets the JSON round trip (tuples
    become lists). etcd sees none of it: a broadcast's metadata reached every group's
    ranks through etcd before, R x G values of 0.1-0.4 MB in round 0."""
    key = round_kv(record.number, "state", *where)
    size = paddle.zeros([1], dtype="int64")
    if meta is not None:
        text = json.dumps(meta, default=_plain)
        data = np.frombuffer(store.signer.sign(key, text).encode(), dtype=np.uint8)
        size[0] = data.size
    comm.broadcast(size, src=src, group=link, tag="ft state metadata")
    length = int(size.numpy()[0])
    if meta is None and not 0 <= length <= MAX_META_BYTES:  # before any allocation
        raise FaultToleranceError(f"paddle_hsdp.ft: the metadata of {key} from global rank "
                                  f"{src} claims {length} bytes (at most {MAX_META_BYTES}); "
                                  "refused, the round is redone")
    payload = paddle.to_tensor(data) if meta is not None else \
        paddle.zeros([length], dtype="uint8")
    comm.broadcast(payload, src=src, group=link, tag="ft state metadata")
    if meta is not None:
        return json.loads(text)
    try:
        return json.loads(store.signer.open(key, payload.numpy().tobytes().decode()))
    except (Forged, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FaultToleranceError(f"paddle_hsdp.ft: the metadata of {key} from global rank "
                                  f"{src} is refused ({e}); the round is redone") from e


def _exchange_meta(store: SharedData, record: Round, where: tuple, sending: bool,
                   build: Callable[[], dict] | None) -> dict:
    """What is not a tensor goes as JSON through the store (a handoff's, :mod:`.handoff`:
    one reader per value; a set-up copy's goes over its link, :func:`_meta_over_link`;
    never a pickle: what a trainer reads from the network must not run code): the
    sender writes ``build()``
    under round ``record``'s key ``where``, the others read it; a reader stops waiting
    once a failure is announced in the round (the sender may be dead). The receiver
    gets the JSON round trip (tuples become lists); so does the sender, alike."""
    meta_key = round_kv(record.number, "state", *where)
    if sending:
        if build is None:
            raise ValueError("paddle_hsdp.ft: _exchange_meta(sending=True) needs build, "
                             "which returns the metadata to write")
        text = json.dumps(build(), default=_plain)
        store.set(meta_key, text)
        return json.loads(text)

    def abort() -> None:
        if store.failed(record.number):
            raise FaultToleranceError(f"paddle_hsdp.ft: a failure was announced while "
                                      f"{meta_key} was awaited")
    return json.loads(store.get(meta_key, abort=abort))


def _plain(value: object) -> Any:
    """JSON for the numpy scalars a scheduler's or optimizer's state may hold."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"paddle_hsdp.ft: {type(value).__name__} in a replica's state cannot "
                    "go to a rejoining group as JSON")


def _optimizer_phases(record: Round, plan: PiecePlan | None) -> list[tuple[int, int, list[int]]]:
    """``(piece, its donor, the replicas taking it)`` for each optimizer-state copy of
    the round: the donor's whole state to every receiver, or with shared pieces one
    copy per piece and donor (the plan's copies: a receiver's own piece, and a piece
    the re-cut gave a member)."""
    if plan is None or plan.parts == 1:
        return [(0, record.donor, list(record.receivers))]
    phases: dict[tuple[int, int], list[int]] = {}
    for q, donor, taker in plan.copies:
        phases.setdefault((q, donor), []).append(taker)
    return [(q, donor, takers) for (q, donor), takers in phases.items()]
