"""Rounds: which replica groups take part in the next attempt at a step.

A round is formed at the start, after an attempt at a step failed, and when a replica
waits to join (:mod:`.replica`); rounds are numbered from 0, and the members of round
``q`` all arrive at ``q + 1`` next. Arriving writes the replica's
:class:`Arrival` (its step count, whether its state is unknown, whether its attempt
failed) and takes a slot. A round *closes* once at least ``min_replicas`` are in
(round 0: ``start_replicas``) and every member of the previous round has arrived or is
gone (a watcher saw one of its ranks stop during the last round, or its heartbeats
stopped while this one waits), or ``PADDLE_HSDP_FT_JOIN_WINDOW`` seconds (default 3)
after this replica arrived: the survivors of a failure arrive together, and a member
missing then is dead or slow (a slow one is left out, and joins the next round with a
copy of the state). The first replica to see that takes the round's
one closer ticket (an atomic ``add``) and writes the record: the replicas that
arrived by then. Every other replica reads that record, so all agree on it even when
their views of the heartbeats differ; a replica that arrived too late finds itself
out and arrives at the next round as a joiner.

A replica started later (or left out) is a *joiner*: it arrives at the round after
the last closed one and waits; it never closes a round after round 0 (only members
know whom to wait for), so it is taken in by the next round its members close.

A restarted coordinator holds nothing: a replica waiting for a round arrives again
(its store client tells it: ``generation``), and the members' watchers write the next
round's number (``round_floor``), which a joiner takes when it is above the closed
rounds' count (which restarts at 0).
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

from . import config
from .store import CoordinatorRestarted, count, key

logger = logging.getLogger("paddle_hsdp.ft")
WAIT_LOG_S = 10.0  # how often a waiting replica says what it waits for


class FaultToleranceError(RuntimeError):
    """A round could not be formed (too few replicas, the coordinator gone)."""


@dataclass(frozen=True)
class Arrival:
    step: int  # optimizer steps this replica has taken
    fresh: bool = False  # its state matches no replica's (just started, or left out)
    failed: bool = False  # its last attempt failed: the outer groups are rebuilt
    config: str = ""  # hash of what it must share with the others (ft/config.py)


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
    replicas: list[int] = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "replicas", sorted(self.members))

    @property
    def step(self) -> int:
        """The step the round trains: the furthest step of a replica whose state is
        known, and with pieces the furthest at which a replica holds each piece (one
        that committed a step its piece-mates failed is taken back to theirs)."""
        known = {r: a.step for r, a in self.members.items() if not a.fresh}
        steps = sorted(set(known.values()), reverse=True)
        for step in steps:
            if all(any(t == step and r % self.pieces == q for r, t in known.items())
                   for q in range(self.pieces)):
                return step
        return steps[0] if steps else 0

    @property
    def donor(self) -> int:
        """The replica the others' state is copied from: the lowest id at the round's step
        (in the very first round, where every state is fresh, the lowest id)."""
        known = [r for r in self.replicas
                 if not self.members[r].fresh and self.members[r].step == self.step]
        return min(known) if known else self.replicas[0]

    @property
    def receivers(self) -> list[int]:
        """Replicas whose state is replaced by the donor's before the attempt."""
        return [r for r in self.replicas if r != self.donor and
                (self.members[r].fresh or self.members[r].step != self.step)]

    def to_json(self) -> str:
        return json.dumps({"number": self.number, "rebuild": self.rebuild,
                           "failures": self.failures, "pieces": self.pieces,
                           "members": {str(r): asdict(a) for r, a in self.members.items()},
                           "left": {str(r): why for r, why in self.left.items()}})

    @staticmethod
    def from_json(text: str) -> "Round":
        data = json.loads(text)
        return Round(data["number"], {int(r): Arrival(**a) for r, a in data["members"].items()},
                     data["rebuild"], data["failures"], data.get("pieces", 1),
                     {int(r): why for r, why in data.get("left", {}).items()})


def _generation(store) -> int:
    """How many times ``store`` reconnected to a restarted coordinator."""
    return getattr(store, "generation", 0)


def arrived(store, number: int) -> list[int]:
    """The replicas that have arrived at round ``number`` so far."""
    out = []
    for slot in range(1, count(store, key("r", number, "slots")) + 1):
        if count(store, key("r", number, "slot_set", slot)):
            out.append(int(store.get(key("r", number, "slot", slot)).decode()))
    return out


class Rounds:
    """One replica's side of the round protocol (its leader runs it)."""

    def __init__(self, store, replica: int, start_replicas: int, min_replicas: int,
                 liveness, timeout_s: float, join_window_s: float, poll_s: float = 0.002,
                 clock=time.monotonic, pieces: int = 1):
        self.store, self.replica = store, replica
        self.pieces = pieces  # of the optimizer state (HFSDP with redundancy), or 1
        self.join_window_s, self._arrived_at = join_window_s, 0.0
        self.start_replicas, self.min_replicas = start_replicas, min_replicas
        self.liveness, self.timeout_s, self.poll_s, self.clock = liveness, timeout_s, poll_s, clock
        self._needs_state, self._fresh = False, {}  # of the round being formed

    def next_open(self) -> int:
        """The round a joiner arrives at: the one after the last closed round (or after
        a restart of the coordinator, the members' next one)."""
        floor = int(self.store.get(key("round_floor"))) \
            if count(self.store, key("round_floor_set")) else 0
        return max(count(self.store, key("closed_rounds")), floor)

    def form(self, number: int, expected: list[int] | None, arrival: Arrival,
             needs_state: bool = False) -> Round | None:
        """Arrive at round ``number`` and return its record, or None if it closed without
        this replica. ``expected``: the previous round's members (None: a joiner).
        ``needs_state``: the job has trained (the previous round had a member whose
        state is known), so the round closes only once such a member is in: a round of
        fresh groups alone would train the job again from their initial models."""
        store = self.store
        self._needs_state, self._fresh = needs_state, {}
        generation = self._arrive_at(number, arrival)
        deadline = self._arrived_at + self.timeout_s
        pause = self.poll_s  # grows to 50 ms: a joiner may wait here for many steps
        next_word = self._arrived_at + WAIT_LOG_S
        while True:
            if self.clock() > next_word:  # a wait that says what it waits for
                next_word += WAIT_LOG_S
                self._log_wait(number, expected)
            if _generation(store) != generation:  # a restarted coordinator: arrive again
                generation = self._arrive_at(number, arrival)
                continue
            try:
                if count(store, key("r", number, "closed")):
                    text = store.get(key("r", number, "record"))
                    break
                # what _may_close saw must be this store's, and so must the ticket
                if self._may_close(number, expected) and _generation(store) == generation \
                        and store.add(key("r", number, "closer"), 1, retry=False) == 1:
                    text = self._close(number, expected, generation)
                    if text is not None:
                        break
                    continue
            except CoordinatorRestarted:
                continue
            if self.clock() > deadline:
                raise FaultToleranceError(self._timeout_message(number, expected))
            if expected is None:
                if count(store, key("finished")):
                    raise FaultToleranceError(
                        f"paddle_hsdp.ft: replica {self.replica} cannot join: the job has "
                        "finished (a replica group called Replica.finish())")
                # the members have gone past it (a restart): unless it closed just now
                # (the count of closed rounds follows the flag), it never will
                if self.next_open() > number and \
                        not count(store, key("r", number, "closed")):
                    return None
            time.sleep(pause)
            pause = min(2 * pause, max(self.poll_s, 0.05))
        record = Round.from_json(text.decode() if isinstance(text, bytes) else text)
        if self.replica not in record.members and \
                count(store, key("r", number, "refused_set", self.replica)):
            why = store.get(key("r", number, "refused", self.replica))
            raise FaultToleranceError(why.decode() if isinstance(why, bytes) else why)
        return record if self.replica in record.members else None

    def _arrive_at(self, number: int, arrival: Arrival) -> int:
        """Write this replica's arrival and take a slot; the store's generation then."""
        store = self.store
        generation = _generation(store)
        store.set(key("r", number, "arrival", self.replica), json.dumps(asdict(arrival)))
        slot = store.add(key("r", number, "slots"), 1)
        store.set(key("r", number, "slot", slot), str(self.replica))
        store.add(key("r", number, "slot_set", slot), 1)
        self._arrived_at = self.clock()
        return generation

    def arrived(self, number: int) -> list[int]:
        return arrived(self.store, number)

    def _may_close(self, number: int, expected: list[int] | None) -> bool:
        present = set(self.arrived(number))
        if expected is None:  # a joiner closes only the very first round
            return number == 0 and len(present) >= self.start_replicas
        if len(present) < self.min_replicas:
            return False
        if self._needs_state and self._pieces_without_state(number, present, expected):
            return False  # the job's state is elsewhere: wait for a group that holds it
        if self.clock() - self._arrived_at > self.join_window_s:
            return True  # the missing ones are dead or slow: a slow one joins next round
        return all(r in present or self._dead(number - 1, r) for r in expected)

    def _pieces_without_state(self, number: int, present, expected) -> list[int]:
        """The pieces of the state (HSDP: the one piece, 0) that no present group holds
        a known copy of. HSDP waits for a holder until the round timeout. With HFSDP's
        pieces, only while a holder of the last round may still come: with every holder
        dead the round closes and every rank stops with PieceLostError naming it."""
        held = {r % self.pieces for r in present if not self._is_fresh(number, r)}
        if self.pieces == 1:
            return [] if held else [0]
        return [q for q in range(self.pieces) if q not in held and any(
            r % self.pieces == q and r not in present and not self._dead(number - 1, r)
            for r in expected or [])]

    def _is_fresh(self, number: int, replica: int) -> bool:
        """Whether ``replica`` arrived at round ``number`` without a known state. Only
        "fresh" is kept: a group that held state can die and arrive again, fresh, at the
        same round (a restart), while a fresh group stays fresh until it receives."""
        if self._fresh.get(replica):
            return True
        arrival = json.loads(self.store.get(key("r", number, "arrival", replica)))
        self._fresh[replica] = bool(arrival.get("fresh"))
        return self._fresh[replica]

    def _dead(self, last_round: int, replica: int) -> bool:
        """A member of the last round is gone: a watcher saw a rank of it stop, or its
        heartbeats stopped while this round waited."""
        return bool(count(self.store, key("r", last_round, "dead", replica))) or \
            self.liveness.dead(replica)

    def _close(self, number: int, expected: list[int] | None, generation: int) -> str | None:
        """Write round ``number``'s record and close it (this replica holds its closer
        ticket, taken in store ``generation``). None if the coordinator restarted before
        the record was written: nothing goes to the new store, where the round is
        formed again. Once written, the record is the round's: a restart after that
        writes it again into the new store, for replicas that had not read it."""
        store = self.store
        members = {r: Arrival(**json.loads(store.get(key("r", number, "arrival", r))))
                   for r in self.arrived(number)}
        members = self._leave_out_other_configs(number, members, expected)
        rebuild = (expected is None or sorted(members) != sorted(expected)
                   or any(a.fresh or a.failed for a in members.values()))
        text = Round(number, members, rebuild, count(store, key("failures")),
                     self.pieces, self._why_left(number, expected or [], members)).to_json()
        if _generation(store) != generation:  # what it read came from two stores
            return None
        try:  # the record before the flag, in one store
            store.set(key("r", number, "record"), text, retry=False)
            store.add(key("r", number, "closed"), 1, retry=False)
        except CoordinatorRestarted:
            return None
        while True:
            try:
                # rounds closed: number + 1 (one closer at a time; a restarted
                # coordinator's count starts at 0)
                closed = count(store, key("closed_rounds"), retry=False)
                store.add(key("closed_rounds"), max(0, number + 1 - closed), retry=False)
                return text
            except CoordinatorRestarted:  # the record again, then the count
                store.set(key("r", number, "record"), text)
                store.add(key("r", number, "closed"), 1)

    def _why_left(self, number: int, expected: list[int], members: dict) -> dict[int, str]:
        """Why each of the previous round's members is not in round ``number``."""
        why, present = {}, None
        for r in expected:
            if r in members:
                continue
            present = self.arrived(number) if present is None else present
            if count(self.store, key("r", number, "refused_set", r)):
                why[r] = "refused: another configuration"
            elif count(self.store, key("r", number - 1, "dead", r)):
                why[r] = "a watcher saw a rank of it stop (killed or hung)"
            elif self.liveness.dead(r):
                why[r] = "its heartbeats stopped (killed or hung)"
            elif r in present:
                why[r] = "arrived after the round closed (it joins the next one)"
            else:
                why[r] = (f"not arrived within the join window ({self.join_window_s:g} s; "
                          "a slow group joins the next round)")
        return why

    def _leave_out_other_configs(self, number: int, members: dict, expected) -> dict:
        """``members`` without the replicas whose configuration (ranks per group, outer
        sharding, pieces, model) differs from the running groups' (the most common among
        the previous round's members, or in round 0 among all, the lowest id breaking a
        tie): each is told why (``refused``, read by it in :meth:`form`) and logged, so
        a misconfigured restart is refused once, before any group is created for it,
        and the members' training goes on."""
        if len({a.config for a in members.values() if a.config}) <= 1:
            return members
        base = sorted(r for r in members if members[r].config
                      and (expected is None or r in expected)) or \
            sorted(r for r in members if members[r].config)
        tally = Counter(members[r].config for r in base)  # ties: the lowest id first
        reference = tally.most_common(1)[0][0]
        ours = config.read(self.store, reference)
        kept = {}
        for r, arrival in members.items():
            if not arrival.config or arrival.config == reference:
                kept[r] = arrival
                continue
            why = (f"paddle_hsdp.ft: replica {r} cannot join the running replica groups: "
                   f"{config.first_difference(config.read(self.store, arrival.config), ours)}"
                   ". Restart it with the same model, ranks per group (--nproc_per_node), "
                   "fsdp_outer_sharding and PADDLE_HSDP_FT_START_REPLICAS / REDUNDANCY as "
                   "the others.")
            logger.warning("paddle_hsdp.ft: round %d leaves replica %d out: %s", number, r, why)
            self.store.set(key("r", number, "refused", r), why)
            self.store.add(key("r", number, "refused_set", r), 1)
        return kept

    def _log_wait(self, number: int, expected) -> None:
        """One line per ``WAIT_LOG_S`` while a round waits: how long, who is in, whom
        it waits for."""
        present = self.arrived(number)
        missing = [r for r in expected or [] if r not in present]
        logger.warning("paddle_hsdp.ft: replica %d has waited %.0f s for round %d (bound "
                       "%g s): arrived %s%s", self.replica, self.clock() - self._arrived_at,
                       number, self.timeout_s, present,
                       f", waiting for {missing}" if missing else
                       f", {self.start_replicas} needed to start" if number == 0 and
                       expected is None else ", waiting for the members to close it")

    def _timeout_message(self, number: int, expected) -> str:
        need = (f"the previous round's replicas {expected} (or their heartbeats to stop) "
                f"and at least {self.min_replicas}" if expected is not None else
                f"{self.start_replicas} replicas to start" if number == 0 else
                "the running replicas to reach a step boundary")
        present = self.arrived(number)
        missing = self._pieces_without_state(number, present, expected) \
            if self._needs_state and present else []
        if missing:
            which = f" (pieces {missing})" if self.pieces > 1 else ""
            need = (f"a replica group that holds the job's state{which} (the groups in hold "
                    "fresh states: the groups that held it are gone or late; restart from "
                    "the last checkpoint if they are gone)")
        return (f"paddle_hsdp.ft: replica {self.replica} waited {self.timeout_s:g} s for round "
                f"{number} to close: it needs {need}; arrived: {present}. "
                "Is the coordinator's address right, and are enough replica groups running? "
                "(PADDLE_HSDP_FT_ROUND_TIMEOUT sets the bound.)")
