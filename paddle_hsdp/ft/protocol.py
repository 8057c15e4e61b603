"""The fault-tolerance protocol on etcd: every key, record and state of it (Paddle-free).

What each replica group (its leader) does, and what it costs the service:

* **Membership and liveness.** A group registers under ``groups/<id>`` with an etcd
  lease of its own (TTL: the heartbeat timeout), renewed by its leader a few times per
  TTL only while the group's own ranks answer each other (``healthy()``, watched inside
  the group, never by other groups). A killed group's lease expires; a hung one's leader
  revokes it. Either way etcd deletes the key; the decider of the latest round, which
  watches ``groups/`` for deletions, reports it under its round's ``ctl/`` keys, and
  every group hears it through its one watch (below; the decider's own death is its
  decider key's deletion). No group hears another's registration. A second launch of a live id is refused: the
  key exists and its lease is being renewed; a launch that finds the holder's lease not
  renewed for a renewal interval (a crashed group restarted) revokes it and takes the id.
* **Rounds.** Round ``n``'s arrivals are keys ``rounds/<n>/arrivals/<id>`` written with
  the group's lease (a group that dies while it waits leaves no arrival behind). The
  first member to arrive takes the round's decider key (an etcd transaction), watches
  the arrivals, and writes the round's record once it may close (:func:`may_close`):
  ``ctl/<n>/record``, in one transaction with ``closed`` (the last closed round). Every
  group reads the record from its one watch, of the keys under ``ctl/``
  (one stream, one connection; its job store's waits for a round's values every group
  waits for hear them from it too: :meth:`Keys.shared_data`): the changes since round
  ``n-1``'s record, which every member holds (:meth:`Round.to_delta`: its size follows
  the changes, not the number of groups). The whole record goes, in the same
  transaction, to ``rounds/<n>/record``, outside the watch: a group without round
  ``n-1``'s (a joiner) reads it once. The next round's decider is
  the same group while it lives (the others do not compete: one transaction a round);
  a decider that dies frees its key with its lease, and another member takes it.
* **Joiners** (a group started later, or left out) arrive at the round after ``closed``
  and write ``ctl/<n>/join``; members hear it and arrive there at their next step.
* **Failures.** A member whose attempt fails writes ``ctl/<n>/failed`` (once: the first
  writer creates it; from a thread of its own, so the group's vote never waits for
  etcd); every member hears it and drops the attempt.
* **etcd away or lost.** Every call waits for etcd up to the round timeout; a group
  whose renewals found it away longer stops (``EtcdUnavailable``). An etcd that lost
  its data (:class:`~.etcd.History`: its revision went back) is noticed by the first
  request that reaches it: every group registers anew, watches the new etcd, and
  meets the others at the ``restart`` round with the step it holds.

**Trust.** With the job's secret (``PADDLE_HSDP_FT_SECRET``, :mod:`.trust`) every
arrival, record, ``closed``, ``finished``, decider key, claim and configuration is
signed (an HMAC of its key and value) and checked where it is read: a value without a
valid signature is refused, named in the log, and the protocol goes on with the
genuine ones (a forged record or decider key in the way of the genuine one is
replaced; a forged claim of an id deleted). ``failed`` and ``join`` act by their
existence and are not signed: a writer can fail a round or wake the members, not steer
one.

Per round: one arrival write per group, one decider transaction, one record, and the
decider's clean-up of the round two before (three range deletions and a compaction of
etcd's history: :meth:`GroupControl._forget`); each ``ctl/`` key reaches every group
once, its size following what changed, not the number of groups. In steady state the
only requests are the leases' renewals, ``3 R / TTL`` a second for ``R`` groups.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections import Counter
import logging
import queue
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from typing import Generic, TypeVar

from .degrees import size_refusal
from .etcd import (Etcd, EtcdRefused, EtcdReset, EtcdUnavailable, History, Security, Watch,
                   prefix_end)
from .trust import SECRET_ENV, UNSIGNED, Forged, Signer

logger = logging.getLogger("paddle_hsdp.ft")

HEALTH_TICK_S = 0.25  # how often a leader asks whether its group's ranks answer
RENEWALS_PER_TTL = 3  # a lease is renewed this often per TTL
# a death's report that etcd refused is written again: this many tries in all, the
# first pause this long and doubling (0.25 + 0.5 + 1 s: bounded, on the report's thread)
REPORT_TRIES, REPORT_PAUSE_S = 4, 0.25
WAIT_LOG_S = 10.0  # a waiting group says what it waits for this often


# ``dead(r)``: why replica ``r`` is gone, or None if it is not
Dead = Callable[[int], str | None]


class FaultToleranceError(RuntimeError):
    """A round could not be formed (too few replicas, the coordinator gone), or this
    group was refused."""


class LeaseLost(FaultToleranceError):
    """This group's lease ended (it stopped answering, was cut off, or hung): the job
    goes on without it; it may register again and rejoin as a new group."""


class ProtocolError(RuntimeError):
    """A replica group's attempt took a transition the protocol does not have (a bug)."""


# ---------------------------------------------------------------- keys
class Keys:
    """Every key of one job (``job`` names it; jobs share an etcd side by side)."""

    def __init__(self, job: str):
        self.root = f"/paddle_hsdp/ft/{job}/"
        self.groups = self.root + "groups/"
        self.ctl = self.root + "ctl/"
        self.closed = self.root + "closed"  # the number of the last closed round
        # the round every group meets at after etcd lost its data (the first proposal)
        self.restart = self.root + "restart"
        self.finished = self.ctl + "finished"
        self.kv = self.root + "kv/"  # the job's shared data (:mod:`.kv`)

    def group(self, replica: int) -> str:
        return f"{self.groups}{replica:06d}"

    def rounds(self, number: int) -> str:
        return f"{self.root}rounds/{number:09d}/"

    def arrival(self, number: int, replica: int) -> str:
        return f"{self.rounds(number)}arrivals/{replica:06d}"

    def ctl_of(self, number: int) -> str:
        return f"{self.ctl}{number:09d}/"

    def record(self, number: int) -> str:
        return self.ctl_of(number) + "record"

    def failed(self, number: int) -> str:
        return self.ctl_of(number) + "failed"

    def join(self, number: int) -> str:
        return self.ctl_of(number) + "join"

    def decider(self, number: int) -> str:
        return self.ctl_of(number) + "decider"

    def gone(self, number: int, replica: int) -> str:
        """The report that group ``replica``'s key went (its value: the revision it went
        at), written under the reporter's latest round by the decider (:class:`_Deaths`)."""
        return f"{self.ctl_of(number)}gone/{replica:06d}"

    def snapshot(self, number: int) -> str:
        """Round ``number``'s whole record, for a group that lacks the round before's
        (``ctl/<n>/record`` is a delta against it): outside ``ctl/``, so no watch
        carries it; read once by a joiner or a group left out. Under ``rounds/<n>/``,
        it goes with the round's arrivals (:meth:`GroupControl._forget`)."""
        return self.rounds(number) + "record"

    def shared_data(self, name: str) -> str:
        """The key of ``name`` in the job's shared data (:mod:`.kv`): under ``kv/``,
        except a round's values that every group of it waits for (its outer groups'
        addresses, a receiver's receipts), which go under the round's ``ctl/<n>/kv/``:
        every group's one watch (:meth:`GroupControl.register`) carries them to its
        waiting ranks, no watch of their own (a stream, a connection), and they go with
        the round's ``ctl/`` keys (:meth:`GroupControl._forget`)."""
        found = _EVERY_GROUP_WAITS.fullmatch(name)
        return f"{self.ctl_of(int(found[1]))}kv/{name}" if found else self.kv + name

    def kv_round(self, number: int) -> str:
        """The prefix of round ``number``'s keys in the shared data (:func:`round_kv`)."""
        return self.kv + round_kv(number)

    def config(self, digest: str) -> str:
        return f"{self.root}config/{digest}"

    def parse_ctl(self, key: str) -> tuple[str, int]:
        """``("record" | "failed" | "join" | "decider", round)``, or ``(name, -1)`` for a
        job-wide key (``finished``)."""
        rest = key[len(self.ctl):]
        number, _, what = rest.partition("/")
        return (what, int(number)) if what else (number, -1)


# a round's shared values that every group of the round waits for (Keys.shared_data)
# (its outer groups' addresses, a receiver's receipts, a joint save's outcome)
_EVERY_GROUP_WAITS = re.compile(
    r"round/(\d{9})/(?:outer_store|received/\d+|save/[^/]+/outcome)")


def round_kv(number: int, *parts: object) -> str:
    """The name in the job's shared data (:mod:`.kv`) of round ``number``'s key
    ``parts`` (a group-store address, a rejoin's metadata; no parts: the prefix of them
    all). The round is written with 9 digits, so that the keys of every round before one
    form one range of keys (deleted with one request: :meth:`GroupControl._forget`)."""
    return f"round/{number:09d}/" + "/".join(map(str, parts))


# ---------------------------------------------------------------- records
@dataclass(frozen=True)
class Arrival:
    step: int  # optimizer steps this replica has taken
    fresh: bool = False  # its state matches no replica's (just started, or left out)
    failed: bool = False  # its last attempt failed: the outer groups are rebuilt
    config: str = ""  # hash of what it must share with the others (ft/config.py)
    # HFSDP's re-cut (ft/pieces.py): the pieces it holds a valid copy of besides its own
    extra: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "extra", tuple(self.extra))  # (a list, read from JSON)

    def holds(self, replica: int, piece: int, pieces: int) -> bool:
        """Whether replica ``replica``, arriving so, holds ``piece`` of ``pieces``."""
        return replica % pieces == piece or piece in self.extra


@dataclass(frozen=True)
class Round:
    number: int
    members: dict[int, Arrival]  # replica -> its arrival
    rebuild: bool  # new outer groups (membership changed or an attempt failed)
    failures: int = 0  # failures the job had announced when it closed (for the log)
    # pieces of the optimizer state (HFSDP in a fault-tolerant job, ft/pieces.py), 1
    # without: replica r holds piece r % pieces
    pieces: int = 1
    # the previous round's members that are not in this one, and why (for the log)
    left: dict[int, str] = field(default_factory=dict)
    # groups that arrived with another configuration, and why they were left out
    refused: dict[int, str] = field(default_factory=dict)
    decider: int = -1  # the group that wrote it (it decides the next round, if alive)
    replicas: list[int] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "replicas", sorted(self.members))

    # step, donor, receivers and up_to_date are computed once per record: each walks
    # the members and calls the one before, so as plain properties ``receivers`` cost
    # O(R^3) per call (tools/sim_ft.py: minutes of CPU per round at 128 groups)
    @cached_property
    def step(self) -> int:
        """The step the round trains: the furthest step of a replica whose state is
        known, and with pieces the furthest at which a replica holds each piece (one
        that committed a step its piece-mates failed is taken back to theirs)."""
        known = {r: a.step for r, a in self.members.items() if not a.fresh}
        steps = sorted(set(known.values()), reverse=True)
        for step in steps:
            if all(any(t == step and self.members[r].holds(r, q, self.pieces)
                       for r, t in known.items()) for q in range(self.pieces)):
                return step
        return steps[0] if steps else 0

    @cached_property
    def donor(self) -> int:
        """The replica the others' state is copied from: the lowest id at the round's step
        (in the very first round, where every state is fresh, the lowest id)."""
        known = [r for r in self.replicas
                 if not self.members[r].fresh and self.members[r].step == self.step]
        return min(known) if known else self.replicas[0]

    @cached_property
    def receivers(self) -> list[int]:
        """Replicas whose state is replaced by the donor's before the attempt."""
        return [r for r in self.replicas if r != self.donor and
                (self.members[r].fresh or self.members[r].step != self.step)]

    @cached_property
    def up_to_date(self) -> list[int]:
        """Members whose state is the round's (known, at its step): the donors."""
        return [r for r in self.replicas
                if not self.members[r].fresh and self.members[r].step == self.step]

    def donor_of(self, receiver: int) -> int:
        """Where ``receiver``'s model state comes from: the receivers, in id order, take
        the up-to-date members in turn, so several joiners load several donors, not one
        (in the first round, where no state is known, every one takes the donor's)."""
        donors = self.up_to_date or [self.donor]
        return donors[self.receivers.index(receiver) % len(donors)]

    def to_json(self) -> str:
        """The whole record, compact: one short list per member (the round's snapshot,
        and round 0's record)."""
        return json.dumps({"number": self.number, "rebuild": self.rebuild,
                           "failures": self.failures, "pieces": self.pieces,
                           "members": {str(r): _wire(a) for r, a in self.members.items()},
                           "left": {str(r): why for r, why in self.left.items()},
                           "refused": {str(r): why for r, why in self.refused.items()},
                           "decider": self.decider},
                          separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> "Round":
        """A whole record (:meth:`to_json`, or the older form with a dict per member)."""
        return Round._whole(json.loads(text))

    @staticmethod
    def _whole(data: dict) -> "Round":
        members = {int(r): _arrival(a) for r, a in data["members"].items()}
        return Round(data["number"], members, data["rebuild"], data["failures"],
                     data.get("pieces", 1),
                     {int(r): why for r, why in data.get("left", {}).items()},
                     {int(r): why for r, why in data.get("refused", {}).items()},
                     data.get("decider", -1))

    def to_delta(self, base: "Round | None") -> str:
        """The record as its readers receive it: what changed since ``base`` (a record
        they hold; None: the whole record), so its size follows the changes, not the
        number of groups. Members gone are ``left`` (with why) or ``dropped``; the
        members kept arrive mostly alike (every survivor of a failure ``failed`` at the
        same step), so one ``default`` arrival covers them and ``changed`` names the
        others and the new members; ``digest`` is of the whole membership, so that a
        delta read against another base is detected (:func:`members_digest`)."""
        if base is None:
            return self.to_json()
        kept = Counter(a for r, a in self.members.items() if r in base.members)
        default = kept.most_common(1)[0][0] if kept else None
        data = {"number": self.number, "base": base.number, "rebuild": self.rebuild,
                "failures": self.failures, "pieces": self.pieces, "decider": self.decider,
                "default": _wire(default) if default else None,
                "changed": {str(r): _wire(a) for r, a in self.members.items()
                            if r not in base.members or a != default},
                "left": {str(r): why for r, why in self.left.items()},
                "dropped": [r for r in base.members
                            if r not in self.members and r not in self.left],
                "refused": {str(r): why for r, why in self.refused.items()},
                "digest": members_digest(self.members)}
        optional = ("default", "changed", "left", "dropped", "refused")  # left out if empty
        return json.dumps({k: v for k, v in data.items() if v or k not in optional},
                          separators=(",", ":"))

    @staticmethod
    def from_delta(text: str, base: "Round | None") -> "Round":
        """The record of :meth:`to_delta`'s ``text`` (a whole one too), read against
        ``base``; :class:`WrongBase` if it is a delta against another record than
        ``base`` (or none): the reader takes the round's snapshot instead."""
        data = json.loads(text)
        if "base" not in data:
            return Round._whole(data)
        number = data["number"]
        if base is None or base.number != data["base"]:
            raise WrongBase(f"round {number}'s record is a delta against round "
                            f"{data['base']}'s, and this reader holds "
                            f"{'none' if base is None else f'round {base.number}'}")
        gone = {int(r) for r in data.get("left", {})} | set(data.get("dropped", []))
        kept = [r for r in base.members if r not in gone]
        members: dict[int, Arrival] = {}
        if kept:
            if "default" not in data:
                raise WrongBase(f"round {number}'s record keeps none of round "
                                f"{data['base']}'s members, and this reader's round "
                                f"{base.number} has {kept} that it does not drop")
            default = _arrival(data["default"])
            members = {r: default for r in kept}
        members.update({int(r): _arrival(a) for r, a in data.get("changed", {}).items()})
        if members_digest(members) != data["digest"]:
            raise WrongBase(f"round {number}'s record, applied to this reader's round "
                            f"{base.number}, gives another membership than its decider's "
                            "(the reader's round is not the decider's)")
        return Round(number, members, data["rebuild"], data["failures"], data["pieces"],
                     {int(r): why for r, why in data.get("left", {}).items()},
                     {int(r): why for r, why in data.get("refused", {}).items()},
                     data["decider"])


class WrongBase(ValueError):
    """A record written as a delta against one round's record was read against another
    (or none): the reader takes the round's whole record from its snapshot."""


def _wire(arrival: Arrival) -> list:
    wire = [arrival.step, int(arrival.fresh), int(arrival.failed), arrival.config]
    return wire + [list(arrival.extra)] if arrival.extra else wire  # (HFSDP's re-cut only)


def _arrival(wire: list | dict) -> Arrival:
    if isinstance(wire, dict):
        return Arrival(**wire)
    return Arrival(wire[0], bool(wire[1]), bool(wire[2]), wire[3],
                   tuple(wire[4]) if len(wire) > 4 else ())


def members_digest(members: dict[int, Arrival]) -> str:
    """A short hash of a round's members and their arrivals (16 hex digits): a delta
    applied to another base than its decider's gives another one."""
    text = ";".join(f"{r},{a.step},{a.fresh:d},{a.failed:d},{a.config}"
                    + (f",{list(a.extra)}" if a.extra else "")
                    for r, a in sorted(members.items()))
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


# ---------------------------------------------------------------- the decision
@dataclass(frozen=True)
class Rules:
    """What a round waits for."""
    start_replicas: int  # round 0 closes once this many have arrived
    min_replicas: int = 1  # no round closes with fewer
    join_window_s: float = 3.0  # a member missing this long after the decider came is left out
    pieces: int = 1  # HFSDP's pieces of the optimizer state (1: HSDP)


def pieces_without_state(present: dict[int, Arrival], expected: list[int] | None, dead: Dead,
                         pieces: int) -> list[int]:
    """The pieces of the state (HSDP: the one piece, 0) that no present group holds a
    known copy of. HSDP waits for a holder until the round timeout. With HFSDP's pieces,
    only while a holder of the last round may still come: with every holder dead the
    round closes (and every rank stops with PieceLostError naming it)."""
    held = {q for r, a in present.items() if not a.fresh for q in (r % pieces, *a.extra)}
    if pieces == 1:
        return [] if held else [0]
    return [q for q in range(pieces) if q not in held and any(
        r % pieces == q and r not in present and not dead(r) for r in expected or [])]


def may_close(number: int, present: dict[int, Arrival], expected: list[int] | None,
              dead: Dead, waited_s: float, rules: Rules, needs_state: bool) -> bool:
    """Whether round ``number`` may close now. ``present``: who has arrived;
    ``expected``: the last round's members (None: round 0, or a joiner's view);
    ``dead(r)``: a reason if member ``r`` is gone, else None; ``waited_s``: since the
    decider arrived; ``needs_state``: the job has trained, so a round of fresh groups
    alone would train it again from their initial models."""
    if expected is None:  # only the very first round closes without members
        return number == 0 and len(present) >= rules.start_replicas
    if len(present) < rules.min_replicas:
        return False
    if needs_state and pieces_without_state(present, expected, dead, rules.pieces):
        return False  # the job's state is elsewhere: wait for a group that holds it
    if waited_s > rules.join_window_s:
        return True  # the missing ones are dead or slow: a slow one joins next round
    return all(r in present or dead(r) for r in expected)


def decide(number: int, present: dict[int, Arrival], expected: list[int] | None, dead: Dead,
           rules: Rules, failures: int, refused: dict[int, str],
           join_window_s: float | None = None, decider: int = -1) -> Round:
    """Round ``number``'s record: who is in, whether the outer groups are rebuilt, and
    why each of the last round's members is not in it."""
    members = {r: a for r, a in present.items() if r not in refused}
    rebuild = (expected is None or sorted(members) != sorted(expected)
               or any(a.fresh or a.failed for a in members.values()))
    window = rules.join_window_s if join_window_s is None else join_window_s
    left = {}
    for r in expected or []:
        if r in members:
            continue
        left[r] = ("refused: another configuration" if r in refused else
                   dead(r) or (f"not arrived within the join window ({window:g} s; a slow "
                               "group joins the next round)"))
    return Round(number, members, rebuild, failures, rules.pieces, left, refused, decider)


# ---------------------------------------------------------------- machines of phases
Phase = TypeVar("Phase", bound=enum.Enum)


class PhaseMachine(Generic[Phase]):
    """A piece of work as phases: one method per phase, each returning the next, every
    move checked against :attr:`transitions` (a move it lacks is a bug in paddle_hsdp,
    not a fault: ProtocolError). ft/replica.py's ``_Step`` and :class:`_RoundArrival`."""

    phase: Phase
    transitions: Mapping[Phase, frozenset[Phase]]
    what: str  # the work, as a bug's message names it
    table: str  # where the transitions are written

    def _run_phases(self, phases: Mapping[Phase, Callable[[], Phase]], end: Phase) -> None:
        while self.phase is not end:
            self._move(phases[self.phase]())

    def _move(self, to: Phase) -> None:
        if to not in self.transitions[self.phase]:
            raise ProtocolError(
                f"paddle_hsdp.ft: {self.what} moved from {self.phase.value!r} to "
                f"{to.value!r}, which {self.table} does not allow (a bug in paddle_hsdp: "
                "please report it with this traceback)")
        self.phase = to


# ---------------------------------------------------------------- a group's attempt
class AttemptState(enum.Enum):
    UNREGISTERED = "unregistered"  # no lease (before the start, or after losing it)
    REGISTERED = "registered"  # holds its id's lease, in no round yet
    ARRIVED = "arrived"  # waits for a round's record
    MEMBER = "member"  # in the round: sets up its groups, then trains
    LEFT_OUT = "left out"  # the round closed without it: arrives at the next as a joiner
    TRAINING = "training"  # attempts steps (a committed step stays here)
    FAILED = "failed"  # an attempt failed: arrives at the next round
    STOPPED = "stopped"  # finished, refused, or gave up


_S = AttemptState
TRANSITIONS = {
    _S.UNREGISTERED: {_S.REGISTERED, _S.STOPPED},
    _S.REGISTERED: {_S.ARRIVED, _S.UNREGISTERED, _S.STOPPED},
    _S.ARRIVED: {_S.MEMBER, _S.LEFT_OUT, _S.UNREGISTERED, _S.STOPPED},
    _S.LEFT_OUT: {_S.ARRIVED, _S.UNREGISTERED, _S.STOPPED},
    _S.MEMBER: {_S.TRAINING, _S.FAILED, _S.UNREGISTERED, _S.STOPPED},
    # TRAINING -> ARRIVED: a joiner waits, so the members form a round at a step boundary
    _S.TRAINING: {_S.TRAINING, _S.ARRIVED, _S.FAILED, _S.UNREGISTERED, _S.STOPPED},
    _S.FAILED: {_S.ARRIVED, _S.UNREGISTERED, _S.STOPPED},
    _S.STOPPED: set(),
}


class Attempt:
    """A replica group's state in the protocol, with its transitions checked."""

    def __init__(self) -> None:
        self.state = AttemptState.UNREGISTERED

    def to(self, new: AttemptState) -> None:
        if new not in TRANSITIONS[self.state]:
            raise ProtocolError(f"paddle_hsdp.ft: a replica group cannot go from "
                                f"{self.state.value} to {new.value}")
        self.state = new


# ---------------------------------------------------------------- one group's side
class GroupControl:
    """One replica group's side of the protocol (its leader runs it).

    ``healthy()`` says whether the group's own ranks still answer each other (asked
    every ``HEALTH_TICK_S``; False revokes the lease: the group is gone for the others).
    ``on_failure(round)`` is called (from a watch's thread) when the round this group
    trains in failed: another member announced it, or a member's key was deleted.
    ``on_lost(why)`` is called once this group lost its lease."""

    def __init__(self, address: str, job: str, replica: int, token: str, host: str,
                 rules: Rules, ttl_s: float, round_timeout_s: float,
                 healthy: Callable[[], bool] = lambda: True,
                 on_failure: Callable[[int], None] = lambda number: None,
                 on_lost: Callable[[str], None] = lambda why: None,
                 security: Security | None = None,
                 clock: Callable[[], float] = time.monotonic, signer: Signer = UNSIGNED,
                 shared: Etcd | None = None):
        self.keys, self.replica, self.token, self.host = Keys(job), replica, token, host
        self.signer = signer  # signs what this group writes, checks what it reads
        self.rules, self.round_timeout_s, self.clock = rules, round_timeout_s, clock
        self.ttl_s = max(2, int(round(ttl_s)))
        self._healthy, self._on_failure, self._on_lost = healthy, on_failure, on_lost
        self._address, self._security = address, security
        self._open_clients(shared)
        # why etcd stays away longer than the round timeout (the group stops), if it does
        self.unavailable: str | None = None
        self._reset = False  # etcd lost its data since the group last took a round from it
        self._watches_stale = False  # the watches resume from the lost etcd's revisions
        self._configs: dict[str, str] = {}  # published (again after etcd lost its data)
        self._restart_number = -1  # the round the groups met at after etcd lost its data
        self.attempt = Attempt()
        self.lease = 0
        self._cv = threading.Condition()
        self._records: dict[int, Round] = {}
        self._unread: dict[int, str] = {}  # records whose base this group lacks (a joiner)
        self._record_revision: dict[int, int] = {}
        self._failed: set[int] = set()  # rounds announced failed
        self._joins: set[int] = set()  # rounds a joiner waits at
        self._decider_gone: set[int] = set()
        self._gone: dict[int, tuple[int, float]] = {}  # replica -> (revision, time) deleted
        self.finished = False
        self.armed: int | None = None  # the round this group trains in
        self.members: list[int] = []
        self.lost: str | None = None  # why this group lost its lease
        self._stop = threading.Event()
        self._watches: list[Watch] = []
        self._deaths: _Deaths | None = None  # while this group reports the deaths
        self._reporting = threading.Lock()  # (taken by the arrival and the watch's thread)
        self._decides = -1  # the newest round whose decider key this group took
        self.events_seen = 0  # events its one watch delivered (tests, tools/sim_ft.py)
        self._renewer: threading.Thread | None = None
        self.deaths_seen: list[tuple[float, int]] = []  # (time, replica): for simulation

    def _open_clients(self, shared: Etcd | None) -> None:
        """The leader's main thread's, the renewing thread's and the announcer's etcd
        clients: each waits up to the round timeout for a restarted coordinator. They
        share one connection for their requests and one stream for every watch (and,
        with ``shared``, the group's job store's: ft/kv.py), so a leader holds 2
        connections to etcd; a renewal waits at most for one short request (waits are
        watches). Failures are written by a thread of their own (announce_failure
        returns at once: the group's vote never waits for etcd)."""
        # what every client of this group saw of etcd: an etcd that lost its data is
        # noticed by the first request that reaches it (_on_reset)
        self._history = History(self._on_reset)

        def client(shared: Etcd | None) -> Etcd:
            return Etcd(self._address, security=self._security, away_s=self.round_timeout_s,
                        history=self._history, shared=shared)
        self.etcd = client(shared)
        self._kept, self._announcer = client(self.etcd), client(self.etcd)
        self._announcing = threading.Lock()
        self._to_announce: queue.Queue[tuple[int, int] | None] = queue.Queue()
        self._announcing_thread: threading.Thread | None = None

    # ------------------------------------------------------------ set-up
    @property
    def requests(self) -> int:
        return self.etcd.requests + self._kept.requests + self._announcer.requests

    def register(self) -> None:
        """Take this group's id (FaultToleranceError if a live group holds it), then
        watch the job's control keys and group deletions and renew the lease. Called
        again once the lease is lost, it takes the id anew (a new group to the others)."""
        if self.attempt.state is not AttemptState.UNREGISTERED:
            self.attempt.to(AttemptState.UNREGISTERED)
        if self._renewer is not None:  # the last lease's thread, if it still runs
            self._stop.set()
            self._renewer.join(timeout=self.round_timeout_s)
        try:
            self.lease = self.etcd.grant(self.ttl_s)
        except EtcdReset:  # noticed by this very request (_on_reset ran): the new etcd's
            self.lease = self.etcd.grant(self.ttl_s)
        self._notice_rounds_gone()
        if self._watches_stale:  # they would wait for the lost etcd's revisions
            self._restart_watches()
        self._claim_id()
        self.lost = None
        self.attempt.to(AttemptState.REGISTERED)
        # renewed from now on: creating the watches may take a while on a loaded host
        self._stop.clear()
        self._renewer = threading.Thread(target=self._renew, daemon=True,
                                         name="paddle_hsdp-ft-lease")
        self._renewer.start()
        if not self._watches:
            self._watch_job()

    def _notice_rounds_gone(self) -> None:
        """A group re-registering whose lease ended and whose rounds are gone too: etcd
        lost its data though its revision did not go back (a young job): the same
        recovery as a revision gone back (:meth:`_on_reset`)."""
        with self._cv:
            seen = max(self._records, default=-1)
        if seen >= 0 and not self._reset and self.etcd.get(self.keys.closed) is None and \
                self.etcd.get(self.keys.restart) is None:
            self._on_reset(f"etcd lost its data: {self.keys.closed} is gone, yet round "
                           f"{seen} closed (restarted on an empty data folder?)")

    def _restart_watches(self) -> None:
        """After etcd lost its data: the watches go (made anew by :meth:`_watch_job`)
        and this group's configurations are published again."""
        self._watches_stale = False
        self._stop_reporting()
        self._decides = -1  # (the rounds start anew)
        for watch in self._watches:
            watch.stop()
        self._watches = []
        for digest, text in self._configs.items():
            self.publish_config(digest, text)

    def _claim_id(self) -> None:
        """Create this group's key with its lease; a holder found in the way is either
        live (FaultToleranceError) or cleared (:meth:`_clear_holder`), and the claim
        tried again."""
        key = self.keys.group(self.replica)

        def claim() -> str:  # with the lease held at the time
            return self._sign(key, json.dumps({"token": self.token, "host": self.host,
                                               "lease": self.lease}))
        while not self.etcd.create(key, claim(), self.lease):
            self._clear_holder(key)

    def _clear_holder(self, key: str) -> None:
        """The group holding this group's id ``key``: refused if its lease is renewed,
        else its lease ended and its claim removed."""
        # the holder's lease as etcd keeps it (not as the value says: a value put
        # back or forged may name any)
        raw, revision, lease = self.etcd.get_lease(key)
        if raw is None:
            return  # it expired just now
        try:
            host = json.loads(self.signer.open(key, raw))["host"]
        except Forged as e:  # not a claim of this job's secret: logged; a group's
            self.signer.refused(e)  # (it has a lease) is taken for one below
            host = "unknown: its claim is not signed with this group's secret"
        if lease and self._renewed(lease):
            self.etcd.revoke(self.lease)
            self.attempt.to(AttemptState.STOPPED)
            raise FaultToleranceError(
                f"paddle_hsdp.ft: replica id {self.replica} is already running (its "
                f"leader on host {host}): a second launch with "
                f"PADDLE_HSDP_FT_REPLICA_ID={self.replica} is refused. Give this group "
                "an id no running group has, or stop the running one first.")
        # nothing renewed the holder's lease for a renewal interval: it died or hangs
        # (the restart of a crashed group), so end its lease now rather than wait
        # out the TTL; the others hear it as the group's death. A claim no lease
        # holds (forged, or an old one put back) is removed as a lease's end would
        if lease:
            self.etcd.revoke(lease)
        self.etcd.delete(key, revision)  # (no-op once the revoke deleted it)
        if self.etcd.keep_alive(self.lease) < 0:  # ours, meanwhile: a new one
            self.lease = self.etcd.grant(self.ttl_s)

    def _watch_job(self) -> None:
        """ONE watch (one stream: etcd's gateway speaks HTTP/1.1, a stream is a
        connection) of the keys under ctl/: the control keys, the shared values every
        group waits for (handed to the job store's waits: Etcd.listen) and the groups'
        deaths as the decider reports them (:class:`_Deaths`). Not ``groups/``: each
        group's registration there would reach every group (R events each at the
        start, and again after etcd lost its data)."""
        self._watches = [self.etcd.watch(self.keys.ctl, self._on_watched)]
        for watch in self._watches:
            if not watch.ready.wait(self.round_timeout_s):
                raise FaultToleranceError("paddle_hsdp.ft: etcd accepted no watch within "
                                          f"{self.round_timeout_s:g} s")
        self.etcd.relay_events(self.keys.ctl, prefix_end(self.keys.ctl))
        # what the watch, from now on, cannot tell: whether the job already finished
        self.finished = self.finished or self.signer.check(
            self.keys.finished, self.etcd.get(self.keys.finished)) is not None

    def _renewed(self, lease: int) -> bool:
        """Whether another launch keeps ``lease`` alive. etcd reports a lease's time to
        live in whole seconds: left alone it falls by the time watched (give or take
        one second); renewed, it is back near its granted TTL. So the lease is watched
        for one renewal interval and a bit (2.5 s at least, so that a short TTL's
        rounding cannot hide a renewal); one that already missed a renewal is dead."""
        def left() -> tuple[float, float]:
            try:
                result = self.etcd.call("kv/lease/timetolive", {"ID": lease})
            except EtcdRefused:  # "lease not found": it expired just now
                return -1.0, 0.0
            return float(result.get("TTL", -1)), float(result.get("grantedTTL", 0))
        (before, granted), start = left(), time.monotonic()
        interval = granted / RENEWALS_PER_TTL
        if before < 0 or before < granted - interval - 1.5:
            return False  # gone, or it already missed a renewal: no need to watch it
        time.sleep(max(interval + 2 * HEALTH_TICK_S, 2.5))
        after, _ = left()
        return after >= 0 and after >= before - (time.monotonic() - start) + 1

    def _renew(self) -> None:
        interval, due = self.ttl_s / RENEWALS_PER_TTL, 0.0
        lease = self.lease
        while not self._stop.wait(HEALTH_TICK_S):
            if lease != self.lease:  # registered anew: the new lease has its own thread
                return
            if not self._healthy():
                self._lose(lease, "a rank of this group stopped answering its mates (hung or "
                                  "dead): the group left the job")
                return
            if time.monotonic() < due:
                continue
            try:
                if self._kept.keep_alive(lease) < 0:
                    self._lose(0, f"its lease expired: nothing renewed it for {self.ttl_s} s "
                                  "(the leader was stopped or cut off from etcd)")
                    return
                due = time.monotonic() + interval
            except EtcdReset:
                return  # _on_reset told the group: it registers anew, with a new lease
            except EtcdRefused as e:  # "requested lease not found": it ended
                self._lose(0, f"its lease ended ({e})")
                return
            except EtcdUnavailable as e:  # the call waited the round timeout (said each 10 s)
                self._unreachable(str(e))
                return

    def _unreachable(self, why: str) -> None:
        """etcd stayed away longer than the round timeout: the group stops at its next
        step (every rank: EtcdUnavailable, Replica._arrive), not later at a round that
        could never form."""
        why = (f"paddle_hsdp.ft: replica {self.replica} stops: etcd stayed away longer than "
               f"the round timeout ({self.round_timeout_s:g} s, PADDLE_HSDP_FT_ROUND_TIMEOUT)"
               f": {why}")
        with self._cv:
            self.unavailable = self.unavailable or why
            self._cv.notify_all()
        logger.warning("%s", why)
        self._on_lost(why)

    def _on_reset(self, why: str) -> None:
        """etcd lost its data (any request of this group's can notice it first): this
        group's lease, every round's key and the watches' revisions are gone. What it
        read from the lost etcd is forgotten; its attempt fails, and its leader
        registers anew (:meth:`register`) and meets the others at one round
        (:meth:`restart_round`), each group with the step it holds."""
        with self._cv:
            self._reset = self._watches_stale = True
            self.lost = self.lost or why
            for seen in (self._records, self._record_revision, self._gone):
                seen.clear()
            for numbers in (self._failed, self._joins, self._decider_gone):
                numbers.clear()
            self._cv.notify_all()
        self._on_lost(why)

    def take_reset(self) -> bool:
        """Whether etcd lost its data since the last call (the caller meets the other
        groups at :meth:`restart_round`, with its own state, not as a fresh joiner)."""
        with self._cv:
            reset, self._reset = self._reset, False
        return reset

    def restart_round(self, proposal: int) -> int:
        """The round every group meets at after etcd lost its data: the first group's
        proposal (its next round; an etcd transaction picks it), read by the others. A
        group that comes after that round closed is left out of it and rejoins as any
        left-out group does."""
        key = self.keys.restart
        try:
            if self.etcd.create(key, self._sign(key, str(proposal))):
                self._restart_number = proposal
                return proposal
            text = self.signer.check(key, self.etcd.get(key))
        except EtcdReset:  # lost again meanwhile: the caller registers once more
            return proposal
        self._restart_number = int(text) if text is not None else proposal
        return self._restart_number

    def _lose(self, lease: int, why: str) -> None:
        self.lost = why  # before the others can hear of it
        if lease:
            try:
                self._kept.revoke(lease)
            except EtcdUnavailable:
                pass  # it expires by itself
        logger.warning("paddle_hsdp.ft: replica %d lost its place in the job: %s",
                       self.replica, why)
        with self._cv:
            self._cv.notify_all()
        self._on_lost(why)

    def close(self, revoke: bool = True) -> None:
        """Stop renewing and watching; ``revoke``: leave the job now (else the lease
        expires: what a killed group does)."""
        self._stop.set()
        self._to_announce.put(None)
        if self._renewer is not None:
            self._renewer.join(timeout=2)
        for watch in self._watches:
            watch.stop()
        self._watches = []
        self._stop_reporting()
        self.etcd.relay_events("", "")  # the job store's waits watch for themselves
        if revoke and self.lease and self.lost is None:
            try:
                self.etcd.revoke(self.lease)
            except EtcdUnavailable:
                pass
        if self.attempt.state is not AttemptState.STOPPED:
            self.attempt.to(AttemptState.STOPPED)

    # ------------------------------------------------------------ events
    def _on_watched(self, kind: str, key: str, value: str, revision: int) -> None:
        """An event of the group's one watch: a round's shared value (to the job
        store's waits), a group's death as reported, or a control key."""
        self.events_seen += 1
        what = self.keys.parse_ctl(key)[0]
        if what.startswith("kv/"):
            self.etcd.dispatch(kind, key, value, revision)
        elif what.startswith("gone/"):
            text = self.signer.check(key, value) if kind == "PUT" else None
            if text is not None:  # (its deletion with its round is no news)
                self._note_gone(int(what[len("gone/"):]), int(text))
        else:
            self._on_ctl(kind, key, value, revision)

    def _on_ctl(self, kind: str, key: str, value: str, revision: int) -> None:
        what, number = self.keys.parse_ctl(key)
        failed_now = gone = None
        with self._cv:
            text = self.signer.check(key, value) if kind == "PUT" and \
                what in ("record", "finished") else value
            if text is None:  # forged: refused (logged), the genuine one is awaited
                pass
            elif what == "record" and kind == "PUT":
                try:  # a delta against the round before's record, which members hold
                    self._records[number] = Round.from_delta(text, self._records.get(number - 1))
                except WrongBase:  # read from the snapshot if this group arrives there
                    self._unread[number] = text
                self._record_revision[number] = revision
                for old in [n for n in self._records if n < number - 2]:
                    del self._records[old]
                    self._record_revision.pop(old, None)
                for old in [n for n in self._unread if n < number - 2]:
                    del self._unread[old]
                for seen in (self._failed, self._joins, self._decider_gone):
                    seen.difference_update([n for n in seen if n < number - 2])
            elif what == "failed" and kind == "PUT":
                self._failed.add(number)
                failed_now = number if number == self.armed else None
            elif what == "join" and kind == "PUT":
                self._joins.add(number)
            elif what == "decider" and kind == "DELETE":
                self._decider_gone.add(number)
                gone = self._decider_died(number)
            elif what == "finished" and kind == "PUT":
                self.finished = True
            self._cv.notify_all()
        if failed_now is not None:
            self._on_failure(failed_now)
        if gone is not None:
            self._note_gone(gone, revision)
        if what == "record" and kind == "PUT":
            self._hand_over_reporting()

    def _decider_died(self, number: int) -> int | None:
        """The group whose decider key of round ``number`` was deleted, if that is its
        death (its lease's end: the decider does not report its own), not the clean-up
        of an old round (:meth:`_forget` deletes rounds up to the newest but two)."""
        record = self._records.get(number)
        newest = max(self._records, default=-1)
        return record.decider if record is not None and number >= newest - 1 and \
            record.decider >= 0 else None

    def _note_gone(self, replica: int, revision: int) -> None:
        """Group ``replica``'s key was deleted at ``revision`` (its lease ended: it died,
        hung or left): a round it is a member of fails."""
        now = time.time()
        with self._cv:
            if self._gone.get(replica, (0, 0.0))[0] == revision:
                return  # heard already (its decider key and the report both tell it)
            self._gone[replica] = (revision, now)
            self.deaths_seen.append((now, replica))
            failed = self.armed if self.armed is not None and replica in self.members \
                and replica != self.replica else None
            self._cv.notify_all()
        if failed is not None:
            self._on_failure(failed)

    def _report_deaths(self, number: int) -> None:
        """This group took round ``number``'s decider key: from now on it reports the
        groups' deaths (:class:`_Deaths`) since round ``number - 1``'s record, until a
        record of another decider's comes."""
        with self._cv:
            since = self._record_revision.get(number - 1)
        with self._reporting:
            self._decides = max(self._decides, number)
            if self._deaths is None:
                self._deaths = _Deaths(self, since + 1 if since else None)

    def _hand_over_reporting(self) -> None:
        """A record of another decider's came, newer than any round whose decider key
        this group took (it may have taken the next one's already): that decider
        reports from now on."""
        with self._cv:
            newest = self._records.get(max(self._records, default=-1))
        with self._reporting:  # (checked and taken at once: see _report_deaths)
            if self._deaths is None or newest is None or newest.decider == self.replica \
                    or newest.number < self._decides:
                return
            deaths, self._deaths = self._deaths, None
        deaths.stop()

    def _stop_reporting(self) -> None:
        with self._reporting:
            deaths, self._deaths = self._deaths, None
        if deaths is not None:
            deaths.stop()

    def newest_round(self) -> int:
        """The newest round whose record this group holds (-1: none)."""
        with self._cv:
            return max(self._records, default=-1)

    # ------------------------------------------------------------ the steps
    def join_waiting(self) -> bool:
        """Whether a joiner waits at the round after the one this group trains in."""
        return self.armed is not None and self.armed + 1 in self._joins

    def round_failed(self, number: int) -> bool:
        return number in self._failed

    def announce_failure(self, number: int) -> None:
        """Tell every member of round ``number`` that its attempt failed (the first
        writer creates the key: one event for everyone, whoever else fails too). It
        returns at once: a thread of its own writes the key, waiting up to the round
        timeout for an etcd that is away, so the group's own vote and the shut-down
        of its outer group never wait for etcd (a group's death while etcd is away
        must not time out its survivors' votes)."""
        with self._announcing:
            if number in self._failed:
                return
            self._failed.add(number)  # once: the watch confirms it for everyone
            if self._announcing_thread is None:
                self._announcing_thread = threading.Thread(
                    target=self._announce, daemon=True, name="paddle_hsdp-ft-announce")
                self._announcing_thread.start()
        self._to_announce.put((number, self._history.resets))

    def _announce(self) -> None:
        while (item := self._to_announce.get()) is not None:
            number, resets = item
            if resets != self._history.resets:
                continue  # a round of an etcd that lost its data since
            try:
                self._announcer.create(self.keys.failed(number), self.token)
            except (EtcdUnavailable, EtcdRefused, EtcdReset) as e:
                # the members learn it from their own collectives, or the lease's end
                logger.warning("paddle_hsdp.ft: replica %d could not announce round %d's "
                               "failure on etcd: %s", self.replica, number, e)

    def committed(self) -> None:
        self.attempt.to(AttemptState.TRAINING)

    def failed(self) -> None:
        self.attempt.to(AttemptState.FAILED)

    def finish(self) -> None:
        self.etcd.put(self.keys.finished, self._sign(self.keys.finished, "1"))

    def next_open(self) -> int:
        """The round a joiner arrives at: the one after the last closed one."""
        raw = self.etcd.get(self.keys.closed)
        closed = self.signer.check(self.keys.closed, raw)
        last = int(closed) if closed is not None else -1
        if raw is None:
            restart = self.etcd.get(self.keys.restart)
            if restart is not None:  # the groups meet there after etcd lost its data
                return int(self.signer.check(self.keys.restart, restart) or 0)
            with self._cv:
                seen = max(self._records, default=-1)
            if seen >= 0:  # no round closed, yet this group read one: etcd lost its data
                self._on_reset(f"etcd lost its data: {self.keys.closed} is gone, yet "
                               f"round {seen} closed (restarted on an empty data folder?)")
                raise self._lease_lost()
        if self.signer.authenticated or closed is None and raw is not None:
            # a forged value is refused, and one put back from an earlier round (signed,
            # but old) is outdone by the latest genuine record, which ``closed`` names
            found, _ = self.etcd.get_prefix(self.keys.ctl)
            genuine = [number for key, value in found.items()
                       for what, number in [self.keys.parse_ctl(key)]
                       if what == "record" and self.signer.check(key, value) is not None]
            if closed is None and raw is not None and not genuine:
                # rounds this group cannot verify, none it can: a job running with
                # another secret (or with one where this group has none). Arriving at
                # round 0 would start a job of its own beside it: refused
                raise FaultToleranceError(
                    f"paddle_hsdp.ft: replica {self.replica} cannot join: the job's rounds "
                    f"({self.keys.closed} and its records) are not signed with this "
                    f"group's {SECRET_ENV} ("
                    + ("they have another secret, or none" if self.signer.authenticated
                       else "none is set here")
                    + "). Set the same secret as the running replica groups. (If no job "
                    "runs, a writer without the secret wrote them: delete the job's keys, "
                    f"etcdctl del --prefix {self.keys.root})")
            last = max([last] + genuine)
        return last + 1

    def _sign(self, key: str, value: str) -> str:
        return self.signer.sign(key, value)

    def arrive(self, number: int, expected: list[int] | None, arrival: Arrival,
               needs_state: bool = False) -> Round | None:
        """Arrive at round ``number`` and return its record, or None if it closed without
        this group (it arrives at a later one, as a joiner). ``expected``: the last
        round's members (None: a joiner). LeaseLost once this group's lease ended (etcd
        that lost its data included); EtcdUnavailable once etcd stayed away longer than
        the round timeout."""
        try:
            return self._arrive(number, expected, arrival, needs_state)
        except EtcdReset:  # _on_reset ran: the group registers anew
            raise self._lease_lost() from None
        except EtcdRefused as e:
            if "lease" not in str(e):
                raise
            self.lost = self.lost or f"its lease ended ({e})"
            raise self._lease_lost() from None

    def _arrive(self, number: int, expected: list[int] | None, arrival: Arrival,
                needs_state: bool) -> Round | None:
        record = _RoundArrival(self, number, expected, arrival, needs_state).run()
        if self.replica in record.refused:
            self.attempt.to(AttemptState.STOPPED)
            raise FaultToleranceError(record.refused[self.replica])
        if self.replica not in record.members:
            self.attempt.to(AttemptState.LEFT_OUT)
            return None
        self.attempt.to(AttemptState.MEMBER)
        with self._cv:
            self.armed, self.members = number, record.replicas
            failed_already = number in self._failed or any(
                self._gone.get(r, (0, 0))[0] > self._record_revision.get(number, 0)
                for r in record.replicas if r != self.replica)
        if failed_already:  # a member died between the record and now
            self._on_failure(number)
        return record

    def _lease_lost(self) -> LeaseLost:
        return LeaseLost(f"paddle_hsdp.ft: replica {self.replica} lost its place in the "
                         f"job: {self.lost}")

    def _read_unread(self, number: int) -> Round:
        """Round ``number``'s record, which came as a delta against a round this group
        did not hold then (a joiner's first, a group's left out): read against that
        round if it holds it now, else read whole, once, from its snapshot
        (``Keys.snapshot``). If that is gone (the job went two rounds past this group)
        or forged: a record without this group, which joins anew."""
        with self._cv:
            text, base = self._unread.get(number, ""), self._records.get(number - 1)
        try:
            record = Round.from_delta(text, base) if text else None
        except WrongBase:
            record = None
        if record is None:
            key = self.keys.snapshot(number)
            whole = self.signer.check(key, self.etcd.get(key))
            if whole is None:
                logger.warning("paddle_hsdp.ft: replica %d cannot read round %d's members "
                               "(%s is gone or refused): it joins the next open round",
                               self.replica, number, key)
                return Round(number, {}, True)
            record = Round.from_json(whole)
        with self._cv:
            self._unread.pop(number, None)
            return self._records.setdefault(number, record)

    def _may_decide(self, number: int, expected: list[int] | None, arrived_at: float) -> bool:
        """Whether this group competes for round ``number``'s decider key: in round 0
        every group; later only members (a joiner does not know whom to wait for), and
        of them the last round's decider, unless it is gone or no record came within the
        join window (then every member; the key's transaction picks one)."""
        if expected is None:
            return number == 0
        with self._cv:
            last = self._records.get(number - 1)
        if last is None or last.decider in (-1, self.replica) or \
                self.clock() - arrived_at > self.rules.join_window_s:
            return True
        return self._dead_since(number - 1)(last.decider) is not None

    def _dead_since(self, number: int) -> Dead:
        """``dead(r)`` for the members of round ``number``: a reason if ``r``'s key was
        deleted after that round's record, else None."""
        since = self._record_revision.get(number, 0)

        def dead(replica: int) -> str | None:
            revision = self._gone.get(replica, (0, 0))[0]
            return "its lease ended (killed, hung or cut off)" if revision > since else None
        return dead

    def _patience(self, number: int) -> Rules:
        """The rules round ``number`` is decided by: right after etcd came back, or at
        the round every group meets at after it lost its data, the members are waited
        for a TTL (their leaders reach etcd again, or register anew, each at its own
        pace; a member's death may not be known yet), not only the join window."""
        back = max(c.came_back for c in (self.etcd, self._kept, self._announcer))
        if number == self._restart_number or time.monotonic() - back < self.ttl_s:
            return replace(self.rules, join_window_s=max(self.rules.join_window_s,
                                                         float(self.ttl_s)))
        return self.rules

    def _try_decide(self, number: int, expected: list[int] | None, arrivals: _Arrivals,
                    arrived_at: float, needs_state: bool) -> Round | None:
        present = arrivals.present()
        rules = self._patience(number)
        with self._cv:
            dead = self._dead_since(number - 1)
            last = self._records.get(number - 1)
            failures = (last.failures if last else 0) + (number - 1 in self._failed)
        if not may_close(number, present, expected, dead, self.clock() - arrived_at,
                         rules, needs_state):
            return None
        refused = self._refusals(present, expected)
        record = decide(number, present, expected, dead, rules, failures, refused,
                        decider=self.replica)
        key, closed, snapshot = self.keys.record(number), self.keys.closed, \
            self.keys.snapshot(number)
        # every group's watch gets the changes since the last record, which every member
        # holds; the whole record goes once, outside the watched keys, for the others
        also = {closed: self._sign(closed, str(number))}
        if last is not None:
            also[snapshot] = self._sign(snapshot, record.to_json())
        signed = self._sign(key, record.to_delta(last))
        revision = self.etcd.create(key, signed, also=also)
        if not revision:
            raw, at = self.etcd.get_revision(key)
            if raw is not None and self.signer.check(key, raw) is None:
                # forged, written before this one (refused by every group as it came):
                # the genuine record replaces it
                revision = self.etcd.create(key, signed, also=also, over=at)
        if not revision:
            return None  # another decider wrote it (this one's lease had lapsed): read it
        with self._cv:  # as the watch will tell it: what died after the record is news
            self._records.setdefault(number, record)
            self._record_revision.setdefault(number, revision)
        if number >= 2:  # what no group reads any more
            self._forget(number - 2)
        return record

    def _forget(self, last: int) -> None:
        """The decider of round ``last + 2``, once its record is written: delete every
        key of rounds up to ``last`` (arrivals, ``ctl/`` keys, the shared data's round
        keys: group-store addresses, rejoin metadata, transfer receipts), three range
        deletions whatever the number of groups; and drop etcd's history before round
        ``last``'s record. Nobody reads them any more: every member of round ``last + 2``
        arrived at ``last + 1`` and ``last + 2`` since (a group arrives at a round only
        once its attempt in the previous one is over), and a group still reading them
        was left out of two rounds (it comes back as a joiner, fed anew). A key a
        straggler writes late into such a round (a failure announced late) goes with
        the next round's deletion: every round from 0 is in the range."""
        keys, etcd = self.keys, self.etcd
        for first, end in ((keys.rounds(0), keys.rounds(last + 1)),
                           (keys.ctl_of(0), keys.ctl_of(last + 1)),
                           (keys.kv_round(0), keys.kv_round(last + 1))):
            etcd.delete_range(first, end)
        with self._cv:
            revision = self._record_revision.get(last)
        if revision:  # every member's watch delivered it (it took round last + 1's since)
            etcd.compact(revision)

    def _refusals(self, present: dict[int, Arrival],
                  expected: list[int] | None) -> dict[int, str]:
        """Groups whose configuration differs from the running groups' (the most common
        among the last round's members present, or in round 0 among all; the lowest id
        breaks a tie), each with why, naming the first difference."""
        if len({a.config for a in present.values() if a.config}) <= 1:
            return {}
        base = sorted(r for r in present if present[r].config
                      and (expected is None or r in expected)) or \
            sorted(r for r in present if present[r].config)
        reference = Counter(present[r].config for r in base).most_common(1)[0][0]
        # each configuration read once: a refusal names every present group's size
        configs = {a.config: self.read_config(a.config) for a in present.values() if a.config}
        ours = configs[reference]
        sizes = {r: c["ranks_per_group"] for r, a in present.items()
                 if (c := configs.get(a.config)) is not None}
        out = {}
        for r, arrival in present.items():
            if arrival.config and arrival.config != reference:
                why = first_difference(configs[arrival.config], ours, sizes, r)
                out[r] = (f"paddle_hsdp.ft: replica {r} cannot join the running replica "
                          f"groups: {why}"
                          ". Restart it with the same model, ranks per group "
                          "(--nproc_per_node), fsdp_outer_sharding and "
                          "PADDLE_HSDP_FT_START_REPLICAS / REDUNDANCY / MAX_GROUP_SIZE "
                          "as the others.")
                logger.warning("paddle_hsdp.ft: leaving replica %d out: %s", r, out[r])
        return out

    def publish_config(self, digest: str, text: str) -> None:
        self._configs[digest] = text
        key = self.keys.config(digest)
        self.etcd.create(key, self._sign(key, text))

    def read_config(self, digest: str) -> dict | None:
        key = self.keys.config(digest)
        text = self.signer.check(key, self.etcd.get(key)) if digest else None
        return json.loads(text) if text else None

    def _timeout_message(self, number: int, expected: list[int] | None) -> str:
        need = (f"the previous round's replicas {expected} (or their leases to end) and at "
                f"least {self.rules.min_replicas}" if expected is not None else
                f"{self.rules.start_replicas} replicas to start" if number == 0 else
                "the running replicas to reach a step boundary")
        return (f"paddle_hsdp.ft: replica {self.replica} waited {self.round_timeout_s:g} s for "
                f"round {number} to close: it needs {need}. Is the coordinator's address "
                "right, and are enough replica groups running? (PADDLE_HSDP_FT_ROUND_TIMEOUT "
                "sets the bound.)")


# ---------------------------------------------------------------- a group's arrival at a round
class ArrivalPhase(enum.Enum):
    #: writes its arrival (a joiner also its join key, which wakes the members)
    ARRIVING = "arriving"
    #: waits for the round's record, competing for its decider key where it may
    WAITING = "waiting"
    #: holds the decider key: watches the arrivals until the round may close
    DECIDING = "deciding"
    #: the round's record is in hand (written by this group or read)
    RECORDED = "recorded"


_A = ArrivalPhase
#: Every move between an arrival's phases :class:`_RoundArrival` may make.
ARRIVAL_TRANSITIONS: dict[ArrivalPhase, frozenset[ArrivalPhase]] = {
    _A.ARRIVING: frozenset({_A.WAITING}),
    _A.WAITING: frozenset({_A.WAITING, _A.DECIDING, _A.RECORDED}),  # (the decider key)
    _A.DECIDING: frozenset({_A.DECIDING, _A.RECORDED}),  # a decider keeps its key
    _A.RECORDED: frozenset(),
}


class _RoundArrival(PhaseMachine[ArrivalPhase]):
    """One replica group's arrival at round ``number`` (:meth:`GroupControl.arrive`),
    until it holds the round's record: one method per :class:`ArrivalPhase`, each a
    pass that returns the next phase, every move checked against
    :data:`ARRIVAL_TRANSITIONS`. Each pass of a waiting or deciding group waits one
    health tick at most, then checks it may still wait (its lease, etcd, the round
    timeout)."""

    transitions = ARRIVAL_TRANSITIONS
    what, table = "an arrival at a round", "ft/protocol.py ARRIVAL_TRANSITIONS"

    def __init__(self, control: GroupControl, number: int, expected: list[int] | None,
                 arrival: Arrival, needs_state: bool):
        self.control, self.number, self.expected = control, number, expected
        self.arrival, self.needs_state = arrival, needs_state
        self.phase = ArrivalPhase.ARRIVING
        self.arrived_at = self.deadline = self.next_word = 0.0
        self.decider: _Arrivals | None = None  # the watch of the arrivals, once deciding
        self.tried = False  # whether this group competed for the decider key
        self.record: Round | None = None

    def run(self) -> Round:
        phases = {_A.ARRIVING: self._arrive, _A.WAITING: self._wait,
                  _A.DECIDING: self._decide}
        try:
            self._run_phases(phases, _A.RECORDED)
        finally:
            if self.decider is not None:
                self.decider.stop()
        assert self.record is not None  # RECORDED is reached with it only
        return self.record

    def _arrive(self) -> ArrivalPhase:
        control, keys = self.control, self.control.keys
        self._check_still_in()
        control.attempt.to(AttemptState.ARRIVED)
        with control._cv:  # nothing is watched while a round forms
            control.armed, control.members = None, []
        try:
            at = keys.arrival(self.number, control.replica)
            control.etcd.put(at, control._sign(at, json.dumps(asdict(self.arrival))),
                             control.lease)
        except EtcdRefused as e:  # the lease ended just now ("requested lease not found")
            control.lost = control.lost or f"its lease ended ({e})"
            raise control._lease_lost() from None
        if self.expected is None and self.number > 0:
            control.etcd.create(keys.join(self.number), str(control.replica))  # wakes members
        self.arrived_at = control.clock()
        self.deadline = self.arrived_at + control.round_timeout_s
        self.next_word = self.arrived_at + WAIT_LOG_S
        return _A.WAITING

    def _wait(self) -> ArrivalPhase:
        """A pass of a group that does not decide: the record, if it came (else a tick's
        wait for it, unless it competes for the decider key now); the key, if it may
        compete (again once the last decider's key was freed)."""
        may_decide = self.control._may_decide(self.number, self.expected, self.arrived_at)
        retry = self._look_for_record(
            lambda retry: not may_decide or (self.tried and not retry))
        if self.record is not None:
            return _A.RECORDED
        self._check_still_in()
        if may_decide and (not self.tried or retry):
            self.tried = True
            if self._take_decider_key():
                return _A.DECIDING
        self._check_patience()
        return _A.WAITING

    def _decide(self) -> ArrivalPhase:
        """A pass of the decider: the record, if another decider wrote it (this one's
        lease lapsed); else the round's record written once it may close, or a tick's
        wait for arrivals."""
        self._look_for_record(lambda retry: False)  # (never idle: it waits on arrivals)
        if self.record is not None:
            return _A.RECORDED
        self._check_still_in()
        assert self.decider is not None  # DECIDING is reached with it only
        self.record = self.control._try_decide(self.number, self.expected, self.decider,
                                               self.arrived_at, self.needs_state)
        if self.record is not None:
            return _A.RECORDED
        self.decider.wait(HEALTH_TICK_S)
        self._check_patience()
        return _A.DECIDING

    def _look_for_record(self, idle: Callable[[bool], bool]) -> bool:
        """Take the round's record into ``self.record`` if it came (a delta against a
        round this group was not in is read whole); without it, wait a health tick for
        it if ``idle(retry)``. Whether the decider's key was freed since the last look
        (``retry``: it may be competed for again)."""
        control, number = self.control, self.number
        with control._cv:
            record = control._records.get(number)
            retry = number in control._decider_gone
            control._decider_gone.discard(number)
            if record is None and number not in control._unread and control.lost is None \
                    and idle(retry):
                control._cv.wait(HEALTH_TICK_S)
                record = control._records.get(number)
            unread = record is None and number in control._unread
        if unread:
            record = control._read_unread(number)
        self.record = record
        return retry

    def _take_decider_key(self) -> bool:
        """Whether this group took the round's decider key (then it watches the
        arrivals). A key in the way that no lease holds and no secret signed is a
        forger's (a decider's has its group's lease): deleted, its deletion a retry. A
        group's key this group cannot verify (another secret) stays: that group
        decides, and this one, refusing its record, times out rather than form a job of
        its own."""
        control, etcd = self.control, self.control.etcd
        at = control.keys.decider(self.number)
        if etcd.create(at, control._sign(at, control.token), control.lease):
            self.decider = _Arrivals(etcd, control.keys.rounds(self.number) + "arrivals/",
                                     control.signer)
            control._report_deaths(self.number)
            return True
        if control.signer.authenticated:
            raw, revision, lease = etcd.get_lease(at)
            if raw is not None and not lease and control.signer.check(at, raw) is None:
                etcd.delete(at, revision)
        return False

    def _check_still_in(self) -> None:
        """Raise if this group may no longer wait: etcd stayed away, its lease ended, or
        it is closing."""
        control = self.control
        if control.unavailable is not None:
            raise EtcdUnavailable(control.unavailable)
        if control.lost is not None:
            raise control._lease_lost()
        if self.phase is not _A.ARRIVING and control._stop.is_set():
            raise FaultToleranceError(f"paddle_hsdp.ft: replica {control.replica} left "
                                      "the job while it waited for a round")

    def _check_patience(self) -> None:
        """Raise once the round timeout passed (or, for a joiner, the job finished);
        say what it waits for every ``WAIT_LOG_S``."""
        control, now = self.control, self.control.clock()
        if now > self.deadline:
            raise FaultToleranceError(control._timeout_message(self.number, self.expected))
        if now > self.next_word:
            self.next_word += WAIT_LOG_S
            logger.warning("paddle_hsdp.ft: replica %d has waited %.0f s for round %d "
                           "(bound %g s)", control.replica, now - self.arrived_at,
                           self.number, control.round_timeout_s)
        if self.expected is None and control.finished:
            raise FaultToleranceError(
                f"paddle_hsdp.ft: replica {control.replica} cannot join: the job has "
                "finished (a replica group called Replica.finish())")


def first_difference(theirs: dict | None, ours: dict | None,
                     sizes: Mapping[int, int] | None = None, joiner: int = -1) -> str:
    """The first thing in which a joiner's configuration (``theirs``) differs from the
    members' (``ours``), in words; ``sizes`` (replica -> ranks per group of the groups
    present) names them all when the joiner's (``joiner``) differs."""
    if theirs is None or ours is None:
        return "its configuration could not be read"
    for name in ("ranks_per_group", "outer_sharding", "pieces", "layout_degree"):
        if theirs.get(name) != ours.get(name):
            text = (f"{name} {theirs.get(name)!r} where the running groups have "
                    f"{ours.get(name)!r}")  # (a key an older group did not record: None)
            sized = size_refusal(joiner, sizes, ours[name]) \
                if name == "ranks_per_group" and sizes and joiner in sizes else None
            return f"{text} ({sized})" if sized else text
    a, b = theirs["tensors"], ours["tensors"]
    for mine, other in zip(a, b, strict=False):
        if mine != other:
            return (f"parameter {mine[0]} {mine[1]} {mine[2]} where the running groups "
                    f"have {other[0]} {other[1]} {other[2]}")
    if len(a) != len(b):
        return f"{len(a)} sharded parameters where the running groups have {len(b)}"
    if theirs.get("outer_sync", []) != ours.get("outer_sync", []):
        return (f"the outer sync every H steps (unit, OuterSyncPolicy) "
                f"{theirs.get('outer_sync', [])} where the running groups have "
                f"{ours.get('outer_sync', [])}")
    return "no difference found"


class _Arrivals:
    """The decider's view of a round's arrivals: read once, then kept by a watch."""

    def __init__(self, etcd: Etcd, prefix: str, signer: Signer = UNSIGNED):
        self._cv = threading.Condition()
        self._present: dict[int, Arrival] = {}
        self._signer = signer
        found, revision = etcd.get_prefix(prefix)
        for key, value in found.items():
            text = signer.check(key, value)  # a forged arrival: refused (logged)
            if text is not None:
                self._present[int(key.rsplit("/", 1)[1])] = Arrival(**json.loads(text))
        self._watch = etcd.watch(prefix, self._on_event, start_revision=revision + 1)

    def _on_event(self, kind: str, key: str, value: str, revision: int) -> None:
        replica = int(key.rsplit("/", 1)[1])
        text = self._signer.check(key, value) if kind == "PUT" else None
        if kind == "PUT" and text is None:
            return  # forged (logged): the genuine arrival seen before, if any, stands
        with self._cv:
            if kind == "PUT" and text is not None:
                self._present[replica] = Arrival(**json.loads(text))
            else:
                self._present.pop(replica, None)
            self._cv.notify_all()

    def present(self) -> dict[int, Arrival]:
        with self._cv:
            return dict(self._present)

    def wait(self, timeout_s: float) -> None:
        with self._cv:
            self._cv.wait(timeout_s)

    def stop(self) -> None:
        self._watch.stop()


class _Deaths:
    """The groups' deaths, as the decider of the latest round reports them: it watches
    ``groups/`` for deletions only (etcd filters out the registrations), and writes
    each under its latest round's ``ctl/`` keys (:meth:`Keys.gone`), which every group's
    one watch carries: a death costs each group one event, and R registrations none
    (each group watching ``groups/`` itself heard every registration: R events per
    group at the start). The reporter's own death is its decider key's deletion
    (:meth:`GroupControl._decider_died`); a death meanwhile, before another group
    takes a round's decider key, is reported by it from the last record's revision."""

    def __init__(self, control: GroupControl, start_revision: int | None):
        self._control = control
        self._stopped = threading.Event()
        self._watch = control.etcd.watch(control.keys.groups, self._on_event,
                                         start_revision=start_revision, no_put=True)

    def _on_event(self, kind: str, key: str, value: str, revision: int) -> None:
        if kind == "DELETE":
            self.report(int(key.rsplit("/", 1)[1]), revision)

    def report(self, replica: int, revision: int) -> bool:
        """Write group ``replica``'s death (its key deleted at ``revision``): a write
        etcd refused is tried again, REPORT_TRIES times in all, REPORT_PAUSE_S apart and
        doubling (a few seconds: a refusal is etcd busy or electing a leader). One that
        finds etcd away waited for it already (up to the round timeout, inside the call),
        and one that finds etcd lost its data is moot (the rounds start anew): neither
        is tried again. Whether it was written; if not, it is logged."""
        control = self._control
        error: Exception | None = None
        for attempt in range(REPORT_TRIES):
            if attempt and self._stopped.wait(REPORT_PAUSE_S * 2 ** (attempt - 1)):
                return False  # no longer the reporter: the next one reports from history
            at = control.keys.gone(max(control.newest_round(), 0), replica)
            try:
                control._announcer.put(at, control._sign(at, str(revision)))
                return True
            except EtcdRefused as e:
                error = e
            except (EtcdUnavailable, EtcdReset) as e:
                error = e
                break
        logger.warning("paddle_hsdp.ft: replica %d could not report group %d's death "
                       "(tried %d times): %s", control.replica, replica, attempt + 1, error)
        return False

    def stop(self) -> None:
        self._stopped.set()
        self._watch.stop()
