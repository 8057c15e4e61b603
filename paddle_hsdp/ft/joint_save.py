"""One checkpoint written by the live replica groups together.

``save_checkpoint`` inside one replica group sees only that group: with HFSDP
(``fsdp_outer_sharding="optim"``) the group holds one piece of the optimizer state,
so its boxes cannot tile a tensor. A fault-tolerant job hands the checkpoint package
a :class:`JointSave` (through the live outer group, so neither package imports the
other); with it, every live group calls ``save_checkpoint`` after the same committed
step and

* each box is written by one group, decided from the round every group shares (no
  message): a replicated box (the model, HSDP's whole optimizer state, scalars) by
  the lowest live replica, a piece of HFSDP's optimizer state by the lowest live
  replica holding that piece (:class:`~.pieces.PiecePlan`);
* every group writes into the same scratch folder beside the checkpoint (so the
  groups need one file system: a shared one across hosts), its files named by the
  writers' virtual ranks;
* each group's leader writes its ranks' manifests into a file of that folder and puts
  only a commit record in the job's shared data (etcd): the file's name, bytes and
  SHA-256, under 200 bytes whatever the model (a 70B model's manifests are megabytes
  per group, and etcd refuses a value over 1.5 MiB); the round's lowest live replica
  (the publisher) reads every group's record as it is written, then every group's file,
  checked against its record,
  checks that the pieces of all groups tile every tensor, writes the metadata and
  moves the folder into place, then announces the outcome, which every other group
  awaits (bounded by two round timeouts: the others' parts, then the publishing). The
  outcome is a value of the round that every group waits for, so each group hears it on
  its one watch of etcd (:meth:`~.protocol.Keys.shared_data`); the records are only the
  publisher's (on that watch, every group's record would reach every group). A group
  that dies meanwhile fails the save on every live rank; the previous checkpoint stays.

A save's keys in etcd go by themselves: each is written with a lease (never renewed)
that ends :data:`SAVE_KEYS_ROUND_TIMEOUTS` round timeouts later, when no reader waits
for them any more; a save whose groups take longer has failed by then.

Every value this module writes to etcd is bounded: a payload over
:data:`MAX_VALUE_BYTES` (64 KiB) is refused before anything is written, and an
outcome is cut to :data:`MAX_OUTCOME_CHARS`.

The result is an ordinary checkpoint: it loads into any layout and into one process.
Its metadata also holds each writing rank's resume state (:meth:`JointSave.resume_state`),
from which ``replica.load_checkpoint`` resumes the whole job (:mod:`.resume`).
"""

from __future__ import annotations

import json
import time
import zlib
from typing import TYPE_CHECKING, Protocol

from .pieces import plan_of
from .protocol import round_kv
from .store import key

# the largest value a joint save writes to the job's etcd (etcd's own limit is 1.5 MiB
# by default, --max-request-bytes); the manifests go as files, beside the checkpoint
MAX_VALUE_BYTES = 64 * 1024
MAX_OUTCOME_CHARS = 4000  # an outcome naming many errors is cut to this
# a save's keys end with a lease this many round timeouts long (:meth:`JointSave._keys_ttl_s`)
SAVE_KEYS_ROUND_TIMEOUTS = 3

if TYPE_CHECKING:
    from .groups import LiveOuterGroup
    from .kv import SharedData
    from .protocol import Round


class ReplicaView(Protocol):
    """What a joint save reads of its :class:`~.replica.Replica` (which imports this
    module, so it is named here by what it has)."""
    replica_id: int
    ranks_per_replica: int
    round_timeout_s: float
    step: int
    round: Round | None
    outer: LiveOuterGroup
    store: SharedData

    def resume_state(self) -> dict: ...


class JointSave:
    """The checkpoint package's view of the live replica groups (duck-typed there:
    ``begin``, ``writes``, ``file_rank``, ``world_size``, ``gather``, ``announce``,
    ``outcome``, ``resume_state``). Built by :class:`~.replica.Replica`; valid after a
    committed step."""

    def __init__(self, replica: ReplicaView):
        self._replica = replica
        # saves of one path at one step so far: every group makes the same calls, so a
        # second save of a path at a step (a retry, a final save after a periodic one)
        # gets keys of its own
        self._calls: dict[tuple[str, int], int] = {}
        self._token: str | None = None

    def begin(self, path: str) -> str:
        """A save of ``path`` starts (every rank of every live group): its token, the
        same on all of them and new for each save."""
        at = (path, self._replica.step)
        record = self._round
        self._calls[at] = self._calls.get(at, 0) + 1
        self._token = (f"ft{record.number}s{self._replica.step}c{self._calls[at]}-"
                       f"{zlib.crc32(path.encode()):08x}")
        return self._token

    @property
    def _round(self) -> Round:
        record = self._replica.round
        if record is None or self._replica.step == 0:
            raise RuntimeError("paddle_hsdp.ft: save_checkpoint in a fault-tolerant job "
                               "comes after a committed train_step (the groups' round "
                               "says who writes what)")
        return record

    def writes(self, piece: int | None) -> bool:
        """Whether this group writes a box of ``piece`` (None: a box every live group
        holds)."""
        replicas = self._round.replicas
        plan = plan_of(self._replica.outer)
        if piece is None or plan is None:
            return self._replica.replica_id == min(replicas)
        holders = [r for r in replicas if plan.piece_of(r) == piece]
        return bool(holders) and self._replica.replica_id == min(holders)

    def resume_state(self) -> dict | None:
        """This rank's resume state (step, RNG, scheduler, user state) if its group
        writes the replicated boxes (the lowest live replica), else None: the metadata
        keeps one per rank of that group, so a resumed job goes on as this one would."""
        return self._replica.resume_state() if self.writes(None) else None

    def file_rank(self) -> int:
        """This rank's index among every live group's ranks (its rank file's name)."""
        return self._replica.outer.virtual_rank(self._replica.replica_id)

    @property
    def world_size(self) -> int:
        return len(self._round.replicas) * self._replica.ranks_per_replica

    def _key(self, *parts: object) -> str:
        """A key of the save :meth:`begin` started."""
        return key("save", self._token, *parts)

    def gather(self, payload: dict) -> list | None:
        """Leader only: put this group's ``payload`` (JSON: a commit record, not the
        manifests, which go as files) in; every group's payloads, in replica order, to
        the round's lowest live replica once each is written (it publishes; after a
        round timeout it announces the failure and raises TimeoutError), None to the
        others. A payload over :data:`MAX_VALUE_BYTES` is
        refused (ValueError) before anything is written."""
        store, replicas = self._replica.store, self._round.replicas
        text = json.dumps(payload)
        if len(text.encode()) > MAX_VALUE_BYTES:
            raise ValueError(f"paddle_hsdp.ft: a joint save's payload must be at most "
                             f"{MAX_VALUE_BYTES} bytes of JSON (a commit record; the "
                             f"manifests go as files), got {len(text.encode())}")
        lease = store.lease(self._keys_ttl_s())
        store.set(self._key("group", self._replica.replica_id), text, lease=lease)
        if self._replica.replica_id != replicas[0]:
            return None
        # the publisher reads each group's record once written (a watch while it is
        # not: R reads in all); every other group made 2 requests. (A counter each
        # group added itself to, the group completing it publishing, cost R
        # compare-and-swap retries per group: 1,024 groups had not finished in 65 s.)
        deadline = time.monotonic() + self._replica.round_timeout_s
        try:
            return [json.loads(store.get(self._key("group", r), max(
                0.001, deadline - time.monotonic())).decode()) for r in replicas]
        except TimeoutError as e:  # the others hear it now, not after their own wait
            self.announce(f"the publishing group waited for every group's record: {e}")
            raise

    def announce(self, outcome: str) -> None:
        """The publisher: the save's outcome ("" when published) for the others."""
        store = self._replica.store
        if len(outcome) > MAX_OUTCOME_CHARS:
            outcome = outcome[:MAX_OUTCOME_CHARS] + " (cut)"
        store.set(self._outcome_key(), outcome, lease=store.lease(self._keys_ttl_s()))

    def _outcome_key(self) -> str:
        """The save's outcome, under its round's keys: every group's one watch carries it."""
        return round_kv(self._round.number, "save", self._token, "outcome")

    def _keys_ttl_s(self) -> float:
        """How long this save's keys live: every reader is done by then (a group's record
        is read by the publisher once the count completes; the outcome is awaited for at
        most two round timeouts from a reader's start, and every group starts within a
        round timeout of the others, or the save fails)."""
        return SAVE_KEYS_ROUND_TIMEOUTS * self._replica.round_timeout_s

    def outcome(self) -> str:
        """Every rank but the publisher's leader: the publisher's outcome, or why none
        came in time (read from the store by each rank, so no rank waits in a
        collective of its group meanwhile: gloo's own timeout is 30 s)."""
        store = self._replica.store
        timeout_s = 2 * self._replica.round_timeout_s  # the others' parts, the publishing
        try:
            return store.get(self._outcome_key(), timeout_s).decode()
        except TimeoutError as e:
            return (f"{e}: no outcome of the joint save within {timeout_s:.0f} s: a replica "
                    f"group died or fell behind during the save "
                    f"(replicas {self._round.replicas} were live)")
