"""The outer groups of a fault-tolerant job: one per local rank, across replica groups.

Inside a replica group (one ``paddle.distributed.launch`` job) fleet's groups are the
usual ones, and the inner group is the replica's sharding group. Across replicas
nothing of fleet's exists: local rank ``i`` of every live replica forms outer group
``i``, created for a round straight from Paddle's process-group classes on a
rendezvous store of its own (:func:`paddle_hsdp.comm.gloo_store.make_group_store`,
its address published in the job's shared data on etcd under the round's key: one
value per round holding every local rank's address, written by the first member's
leader once each of its ranks handed it its part, :mod:`.relay`).

Ranks across replicas are *virtual*: ``replica * inner + local_rank``. The engine
holds one :class:`LiveOuterGroup` per process from ``fully_shard`` on; each new round
points it at the round's process group (``adopt``), so the buffers, the grad divisor
(``outer.nranks x inner``) and the comm counter follow the live replicas without a
rebuild of the engine.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from paddle.base import core
from paddle.distributed import collective
from paddle.distributed.communication.group import Group

from ..comm import collectives as comm
from ..comm.gloo_store import forget_group_store, make_group_store
from ..comm.traits import declare
from .protocol import FaultToleranceError, round_kv
from .store import on_socket, socket_fds

if TYPE_CHECKING:
    from .kv import SharedData

_T = TypeVar("_T")

# a round's process group and the socket descriptors its creation opened ((None, ()):
# a group of one replica, nothing to talk to)
Connection = tuple[core.ProcessGroup | None, Iterable[int]]

logger = logging.getLogger("paddle_hsdp.ft")

# Negative (never one of Paddle's ring ids) and fixed, so the comm counter files all
# rounds' traffic under one label.
LIVE_GROUP_ID = -(10 ** 6)
# Process-group ids of the rounds' groups (Paddle's own count up from 0).
_ROUND_GROUP_BASE = 10 ** 7


# what a failed collective on a live group means (paddle_hsdp.comm names it in the error)
FAILURE_ADVICE = ("A replica group of this outer group died, hung or was shut out (the "
                  "round's log names it): paddle_hsdp.ft drops the attempt and forms a "
                  "round without it; this rank goes on.")


class LiveOuterGroup(Group):
    """This rank's outer group, whichever replicas are live (a ``Group``, so Paddle's
    collectives take it). Until the first round it is this rank alone."""

    def __init__(self, replica: int, local_rank: int, inner: int):
        self.replica, self.local_rank, self.inner_size = replica, local_rank, inner
        super().__init__(0, LIVE_GROUP_ID, [self.virtual_rank(replica)], pg=None,
                         name=f"hsdp_ft_outer_{local_rank}")
        # Outer all-reduces during backward as in plain HSDP (engine/outer_sync.py), in
        # one order across the replica groups: the order each group agreed inside itself
        # is agreed once more over this group (the lowest replica's), and every member of
        # a round that changed who trains records and agrees it anew (ft/replica.py). A
        # hung peer fails the attempt (its lease ends; every rank's watch shuts the group
        # down): the watchdog, which would end this rank, stays out of it. ft.init adds
        # the shared HFSDP pieces and the joint save (comm/traits.py).
        declare(self, early_sync=True, order_agreed_on_it=True, watchdog_exempt=True,
                failure_advice=FAILURE_ADVICE)
        # process groups of past rounds, (group, id): those that ended well and those
        # abandoned after a failure, kept until the next rebuild (a thread may still be
        # failing out of one), then destroyed with their rendezvous stores
        self.retired: list[tuple[core.ProcessGroup, int | None]] = []
        self.broken: list[tuple[core.ProcessGroup, int | None]] = []
        self.freed = 0  # retired groups dropped (their stores destroyed) so far
        self._pg_id: int | None = None  # the current process group's id
        self._sockets: set[int] = set()
        # a round's group being created: (round, the sockets open before it began)
        self._creating: tuple[int, frozenset] | None = None
        self._round = -1  # the round whose process group this is
        self._lock = threading.Lock()
        comm.name_group(self, "outer")

    def virtual_rank(self, replica: int) -> int:
        return replica * self.inner_size + self.local_rank

    def adopt(self, replicas: list[int], connection: Connection, round_number: int) -> None:
        """Point at round ``round_number``'s process group over ``replicas`` (sorted);
        ``connection``: what :func:`connect` returned."""
        with self._lock:
            stale, self.retired, self.broken = self.retired + self.broken, [], []
            if self._pg is not None:
                self.retired.append((self._pg, self._pg_id))
            self._set(replicas, *connection)
            self._round = round_number
            self._pg_id = group_id(round_number, self.local_rank) \
                if connection[0] is not None else None
        self._free(stale)

    def _free(self, stale: list[tuple[core.ProcessGroup, int | None]]) -> None:
        """Drop process groups no round uses any more, and destroy their rendezvous
        stores (server and clients: their sockets close). The groups themselves outlive
        this: Paddle keeps every process group it creates in a C++ map by id until the
        process exits, and no call removes one (``ProcessGroupIdMap.destroy()`` destroys
        them all; creating another under a held id fails, "AlreadyExists"). So gloo's
        pair sockets of a retired group (one per peer) stay open, and on NCCL its
        communicator and buffers (not abortable from Python; unverified here)."""
        while stale:
            _, pg_id = stale.pop()  # the last reference to the group goes with it
            if pg_id is not None:
                forget_group_store(pg_id)
            self.freed += 1

    def carry_into(self, round_number: int) -> None:
        """A round that keeps the last one's process group (same members, no failure)."""
        with self._lock:
            self._round = round_number

    def shut_down(self, round_number: int | None = None) -> None:
        """A collective of this round failed somewhere: shut this group's connections
        down at once, so a collective this rank is blocked in (waiting for a peer that
        failed out of it, or for a dead or stopped one) fails now instead of after
        gloo's fixed 30 s timeout. Paddle's process groups have no abort and outlive
        their Python object, so this shuts down the sockets the group's creation
        opened (:func:`connect`); the descriptors stay open, so no other connection can
        take their numbers under gloo. Safe from any thread: the group's watch calls it with
        the round it judged, and a group of a later round is left alone."""
        with self._lock:
            creating = self._creating
            if creating is not None and round_number in (None, creating[0]):
                # a creation in progress (gloo's rendezvous has no timeout of its
                # own once a peer is gone): every socket opened since it began
                for fd in socket_fds() - creating[1]:
                    _shut_down(fd)
            if round_number is not None and round_number != self._round:
                return
            for fd in self._sockets:
                _shut_down(fd)
            self._sockets = set()

    @contextlib.contextmanager
    def creating(self, round_number: int, before: set[int]) -> Iterator[None]:
        """Round ``round_number``'s group is being created (``before``: the sockets
        open when it began): a failure announced meanwhile (:meth:`shut_down`) shuts
        down what the creation opened, so a rendezvous waiting for a peer that left
        fails instead of waiting for good."""
        with self._lock:
            self._creating = (round_number, frozenset(before))
        try:
            yield
        finally:
            with self._lock:
                self._creating = None

    def track(self, round_number: int, sockets: Iterable[int]) -> None:
        """Sockets of another group of round ``round_number`` (a transfer's pair) that a
        failure announced in the round shuts down with this group's."""
        with self._lock:
            if round_number == self._round:
                self._sockets |= set(sockets)

    def abandon(self) -> None:
        """This rank's attempt failed: shut down, and be this rank alone until the next
        round."""
        self.shut_down()
        with self._lock:
            if self._pg is not None:
                self.broken.append((self._pg, self._pg_id))
            self._set([self.replica], None)
            self._pg_id = None

    def _set(self, replicas: list[int], process_group: core.ProcessGroup | None,
             sockets: Iterable[int] = frozenset()) -> None:
        self._sockets = set(sockets)
        self._ranks = [self.virtual_rank(r) for r in replicas]
        self._rank_in_group = replicas.index(self.replica)
        self._world_size = len(replicas)
        self._pg = process_group

    @property
    def replicas(self) -> list[int]:
        return [r // self.inner_size for r in self._ranks]


def group_id(round_number: int, local_rank: int) -> int:
    """The process-group id of round ``round_number``'s outer group of ``local_rank``."""
    return _ROUND_GROUP_BASE + round_number * 1024 + local_rank


def connect(store: SharedData, round_number: int, replicas: list[int], group: LiveOuterGroup,
            timeout_s: float) -> Connection:
    """Create this rank's outer process group for a round (every member calls it):
    ``(process group, the socket descriptors its creation opened)``, ``(None, ())`` for
    a round of one replica (nothing to talk to)."""
    if len(replicas) == 1:
        return None, ()
    return _create(store, round_number, group, replicas.index(group.replica),
                   len(replicas), group_id(round_number, group.local_rank),
                   round_kv(round_number, "outer_store"), timeout_s,
                   f"round {round_number}'s outer group")


class PairGroup(Group):
    """Two replicas' ranks of one local rank, for a rejoin's state transfer alone (or a
    piece's holders, for a resume's reading of it: :func:`connect_holders`; the
    other members of the round never touch it, so its traffic cannot shift the tags of
    the outer group's collectives: Paddle's gloo groups number every call, sends
    included, and a member that skipped a send would then wait in the next all-reduce
    under another tag)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # a stopped peer fails the round, as on the outer group
        declare(self, watchdog_exempt=True, failure_advice=FAILURE_ADVICE)


# Process-group ids of the transfers' pair groups: unique per round (modulo
# PAIR_ROUNDS), local rank and pair, below 2**31 (Paddle's ids are C ints).
_PAIR_GROUP_BASE = 12 * 10 ** 8
PAIR_ROUNDS = 20_000
MAX_PAIRS = 40  # pairs per round and local rank; a round with more broadcasts instead


def pair_id(round_number: int, local_rank: int, index: int) -> int:
    """The process-group id of round ``round_number``'s ``index``-th transfer pair."""
    if not 0 <= index < MAX_PAIRS:
        raise ValueError(f"paddle_hsdp.ft: pair index {index} outside [0, {MAX_PAIRS})")
    return _PAIR_GROUP_BASE + ((round_number % PAIR_ROUNDS) * 1024 + local_rank) * MAX_PAIRS \
        + index


def connect_pair(store: SharedData, round_number: int, pair: tuple[int, int], index: int,
                 group: LiveOuterGroup, timeout_s: float) -> PairGroup:
    """The process group of replicas ``pair`` (sorted; this rank's replica is one of
    them) for round ``round_number``'s transfer: both call it, nobody else. Its
    sockets go with the outer group's, so a failure announced in the round shuts
    them down too."""
    return _side_group(store, round_number, list(pair), pair_id(round_number, group.local_rank,
                       index), round_kv(round_number, "pair_store", *pair), group, timeout_s,
                       f"transfer pair {pair}", "pair", "ft transfer")


# Process-group ids of a resume's piece groups: unique per round (modulo PIECE_ROUNDS)
# and local rank (a rank is in one a round), above the pairs', below 2**31.
_PIECE_GROUP_BASE = 2_030_000_000
PIECE_ROUNDS = 100_000


def piece_group_id(round_number: int, local_rank: int) -> int:
    """The process-group id of round ``round_number``'s group of a piece's holders."""
    return _PIECE_GROUP_BASE + (round_number % PIECE_ROUNDS) * 1024 + local_rank


def connect_holders(store: SharedData, round_number: int, piece: int, holders: list[int],
                    group: LiveOuterGroup, timeout_s: float) -> PairGroup:
    """The process group of HFSDP piece ``piece``'s holders (``holders``: replicas,
    sorted, this rank's among them) for a resume's split reading of that piece in
    round ``round_number``: they call it, nobody else (as a pair group: its calls
    leave the outer group's tags alone)."""
    return _side_group(store, round_number, holders,
                       piece_group_id(round_number, group.local_rank),
                       round_kv(round_number, "piece_store", piece), group, timeout_s,
                       f"piece {piece}'s holders {holders}", f"piece{piece}", "ft resume")


def _side_group(store: SharedData, round_number: int, replicas: list[int], pg_id: int,
                store_name: str, group: LiveOuterGroup, timeout_s: float, what: str,
                label: str, counted_as: str) -> PairGroup:
    """A process group of a few of the round's ``replicas`` (this rank's among them)
    besides the outer group. Its sockets go with the outer group's, so a failure
    announced in the round shuts them down too."""
    rank = replicas.index(group.replica)
    pg, sockets = _create(store, round_number, group, rank, len(replicas), pg_id, store_name,
                          timeout_s, f"round {round_number}'s {what}")
    group.track(round_number, sockets)
    side = PairGroup(rank, pg_id, [group.virtual_rank(r) for r in replicas], pg=pg,
                     name=f"hsdp_ft_{label}_{'_'.join(map(str, replicas))}_{group.local_rank}")
    comm.name_group(side, counted_as)
    return side


class _LocalRankPart:
    """Where the first member's ranks publish their group stores' addresses: one value
    per replica group in the job's shared data (``name``), each local rank's address a
    part of it (:meth:`~.kv.JobStore.set_part`): one request to etcd per group and
    round, not one per rank. A rendezvous store as ``make_group_store`` takes it."""

    def __init__(self, store: SharedData, name: str, group: LiveOuterGroup):
        self._store, self._name = store, name
        self._part, self._parts = group.local_rank, group.inner_size

    def set(self, key: str, value: str, /) -> None:
        self._store.set_part(self._name, self._part, self._parts, value)

    def get(self, key: str, /, *, abort: Callable[[], object] | None = None) -> bytes:
        return self._store.get_part(self._name, self._part, abort=abort)


def _create(store: SharedData, round_number: int, group: LiveOuterGroup,
            rank: int, size: int, pg_id: int, store_name: str, timeout_s: float,
            what: str) -> tuple[core.ProcessGroup, set[int]]:
    """A process group of ``size`` ranks on a rendezvous store of its own (its address
    published as this local rank's part of ``store_name``): ``(process group, the
    sockets its creation opened)``. A failure announced in the round meanwhile cuts
    the creation short."""
    before = socket_fds()
    abort = _abort_on_failure(store, round_number)
    with group.creating(round_number, before):
        group_store = make_group_store(_LocalRankPart(store, store_name, group), rank, size,
                                       pg_id, key=store_name,
                                       timeout_s=max(1, int(timeout_s)), listen_first=True,
                                       abort=abort)
        if (collective._default_backend or "gloo") == "nccl":  # unverified: no GPU here
            # CUDA builds of Paddle only: the CPU build's stubs, which mypy reads, lack it
            pg = core.ProcessGroupNCCL.create(  # type: ignore[attr-defined]
                group_store, rank, size, pg_id, collective._get_global_env().pg_timeout, 0, None)
        else:
            pg = _abandon_on_failure(
                lambda: core.ProcessGroupGloo.create(group_store, rank, size, pg_id), abort,
                lambda: forget_group_store(pg_id), what)
    return pg, socket_fds() - before


ABANDON_GRACE_S = 3.0  # an abandoned creation is given this long to end on its own


def _abandon_on_failure(create: Callable[[], _T], abort: Callable[[], object],
                        release: Callable[[], object], what: str) -> _T:
    """``create()`` on a thread of its own, abandoned once ``abort()`` raises (a failure
    announced in the round). The store's host of a round whose member died mid-way
    stayed inside gloo's rendezvous even once its sockets were shut down (seen in
    tools/sweep_ft_deaths.py: a member killed as the groups were created held the donor
    past the round timeout); abandoned, the thread stays blocked until gloo gives up
    (it holds no lock of ours), and the round fails now."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["pg"] = create()
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True, name="paddle_hsdp-ft-connect")
    thread.start()
    while True:
        thread.join(0.05)
        if not thread.is_alive():
            break
        try:
            abort()
        except Exception:
            # its store's connections closed, the rendezvous fails: the thread ends
            # (one left blocked would abort the process when it exits)
            release()
            thread.join(ABANDON_GRACE_S)
            if thread.is_alive():
                logger.warning("paddle_hsdp.ft: the creation of %s is still blocked in "
                               "gloo %g s after the round failed; abandoned", what,
                               ABANDON_GRACE_S)
            raise
    if "error" in result:
        raise result["error"]
    return result["pg"]


def _abort_on_failure(store: SharedData, round_number: int) -> Callable[[], None]:
    """Stop waiting for a round's group-store host once a failure is announced in the
    round (the host's, or another member's, lease ended): without it a host that
    died before publishing its address held every member for the round timeout."""
    def abort() -> None:
        if store.failed(round_number):
            raise FaultToleranceError(f"paddle_hsdp.ft: a failure was announced in round "
                                      f"{round_number} while its outer groups were created")
    return abort


def _shut_down(fd: int) -> None:
    # a listening socket or one already down raises OSError: nothing to do
    on_socket(fd, lambda sock: sock.shutdown(socket.SHUT_RDWR))
