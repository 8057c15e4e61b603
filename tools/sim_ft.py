"""The fault-tolerance control plane at scale, simulated on one machine.

    python tools/sim_ft.py --groups 512 [--ranks-per-group 8] [--churn] [--minutes 10] [--json]

R replica groups run the real protocol (paddle_hsdp/ft/protocol.py, its etcd client and
lease renewals, no Paddle: a group's training is a sleep per step and its outer group a
flag) against a real etcd (the embedded one unless --endpoints names another), spread
over a few processes (R/64). A process's leases are renewed by a process of its own,
earliest due first (:class:`Renewer`; a thread per group, the protocol's own, starved
one another at 512 groups on 2 cores), and the worker processes run at the lowest
priority (nice 19: their hundreds of threads outweighed etcd and the renewals at +5).
The groups start evenly over ``--start-over`` s (default R/50: a job's pods come up
over a while; the simulator's choice, the protocol takes any), and the steady stretch
begins ``--settle-s`` later, once round 0's set-up (each group's outer-store
addresses; the first transfer's metadata goes over the outer group, not etcd) is done. With ``--ranks-per-group G`` every group also has G ranks, each a
real client of the job's shared data as ``ft.init`` builds them (the leader's
``JobStore``; each other rank's ``RelayedStore``, through the group's own store,
simulated in memory, and the leader's ``Relay``), which after each round do what
``groups.connect`` and a rejoin's transfer do with it (addresses; as a handoff's, the
donor's metadata of ``--meta-kb`` per rank to its receiver, receipts); ``--churn`` adds ``--saves`` joint saves after the
rejoin (``ft/joint_save.py``'s records, count and outcome, every rank waiting for it).
After the first round and a quiet stretch it injects, one at a
time: a failed attempt (one group's collective fails: every group arrives at once), a
killed group (its lease is left to expire), a hung group (its leader sees a mate silent
for the heartbeat timeout and revokes the lease) and the killed group's restart (a
joiner), and keeps stepping to the end. It prints, measured:

* ``steady_req_per_s``: requests to etcd per second while nothing happens;
* ``round_s``: the failed attempt's round, from the first group's arrival to the last
  group holding the record (every group arrives within a few ms of the failure);
* ``rejoin_round_s``, ``first_round_s``: the same for the joiner's round and round 0;
* ``detect_dead_s`` / ``detect_hung_s``: from the kill / hang to the last group hearing
  of it (bounds: the lease TTL + 1 s, the heartbeat timeout + 1 s);
* ``false_deaths``: groups heard of as gone that nobody killed or hung, over the run,
  caused by the protocol; ``false_deaths_by_simulator``: those whose lease lapsed
  because a renewal went out late by the renewing process's own clock (the simulator
  was behind); ``renewal_sent_late_max_s``, the latest renewal sent, and
  ``renewal_answered_late_max_s``, the latest answered (etcd on the same cores);
* ``req_per_round``: requests the groups sent while forming a round, per round;
* ``left_out``: ``[round, groups]`` left out of a round (late past the join window:
  here such a group stops; a real one joins the next round);
* ``etcd_and_renewals_ahead``: whether etcd and the renewing processes ran at nice
  -10 (root or CAP_SYS_NICE; else the simulated groups can starve them);
* ``phases``: per phase (``steady``, ``first_round``, ``round``, ``set_up``,
  ``rejoin``, ``joint_save``; each the worst of its instances, a window from the
  first group's start to the last group's end): the peak requests/s to etcd over any
  second of it (and that second's requests by path, the renewals not counted), the most TCP connections the groups held open to etcd (counted in
  /proc/net/tcp, less ``connections_not_the_groups``: etcd's gateway's own and one per
  renewing process), the bytes of JSON the clients read per group and round;
  ``set_ups_done``: how many groups completed each phase of each round;
  ``keys_after``: the job's keys at the end;
* ``watch_events_per_group_at_start``: the most events a group's one watch delivered
  by the end of round 0's set-up (each group's registration once reached every group:
  R or more), and ``watch_bytes_per_group_per_round``: its keys' and values' bytes per
  round after that, for the groups that ran throughout.

With ``--json`` the last line is one JSON object of those figures.

    python tools/sim_ft.py --soak-rounds 2000 --groups 4 [--json]

is a soak instead (:func:`soak`): rounds back to back, a group's death and rejoin
every ``--rejoin-every`` rounds (with its metadata), a joint save every
``--save-every``, printing every ``--sample-every`` rounds the keys under the job's
prefix and its ``kv/``, and etcd's database size: flat when every key goes once no one
reads it (docs/fault-tolerance.md, "Keys that go away").
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
import multiprocessing as mp
import os
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
import types

import pythonpath  # (tools/ is on the path: python tools/sim_ft.py)


def _protocol():
    """The protocol and its etcd_server without Paddle (tools/pythonpath.py)."""
    return pythonpath.ft_without_paddle("protocol", "etcd_server")


class Renewer:
    """Every simulated group's lease renewals of one worker process, sent by a process of
    their own (:func:`_renew_leases`: one etcd client, earliest due first, at the
    worker's priority before it lowers its own) in place of a renewing thread per group,
    the protocol's own: at 512 groups on 2 cores those threads starved one another (and
    shared Python's lock with the groups parsing a round's values), and leases lapsed
    unrenewed. Here stays what the protocol's renewing thread also does each tick: a
    hung group's leader revokes its lease; a lease etcd found expired loses its group.
    Each renewal's lateness (answered after it was due: the simulator, or etcd on the
    same loaded cores, was behind) is kept per group, so a death it caused is told apart
    from one the protocol caused."""

    def __init__(self, protocol):
        self.p = protocol
        ctx = mp.get_context("fork")
        self._orders, self._reports = ctx.Queue(), ctx.Queue()
        self.sent = ctx.Value("q", 0)  # renewals sent (requests to etcd)
        self._process = ctx.Process(target=_renew_leases, args=(
            self._orders, self._reports, protocol.HEALTH_TICK_S, self.sent), daemon=True)
        self._process.start()
        self._controls: dict[int, object] = {}  # lease -> control
        self._lock = threading.Lock()
        # replica -> its worst renewal lateness, s: "sent" by this renewer's own clock
        # (it went out late: the simulator was behind), "answered" (etcd answered late)
        self.late: dict[str, dict[int, float]] = {"sent": {}, "answered": {}}
        self.lapsed: set[int] = set()  # replicas whose lease etcd found expired
        self._ended = threading.Event()
        threading.Thread(target=self._watch, daemon=True, name="sim-health").start()
        threading.Thread(target=self._hear, daemon=True, name="sim-lapsed").start()

    def add(self, control) -> None:
        with self._lock:
            self._controls[control.lease] = control
        self._orders.put(("add", control.replica, control.lease,
                          control.ttl_s / self.p.RENEWALS_PER_TTL))

    def drop(self, control) -> None:
        """Stop renewing ``control``'s lease (its group was killed: it expires)."""
        with self._lock:
            self._controls.pop(control.lease, None)
        self._orders.put(("drop", control.lease))

    def _watch(self) -> None:
        while True:
            time.sleep(self.p.HEALTH_TICK_S)
            with self._lock:
                controls = list(self._controls.values())
            for c in controls:
                if c._stop.is_set() or c.lost is not None:
                    self.drop(c)
                elif not c._healthy():
                    self.drop(c)
                    c._lose(c.lease, "a rank of this group stopped answering its mates "
                                     "(simulated hang)")

    def _hear(self) -> None:
        while True:
            report = self._reports.get()
            if report[0] == "late":
                self.late = report[1]
                self._ended.set()
                return
            _, replica, lease = report
            self.lapsed.add(replica)
            with self._lock:
                c = self._controls.pop(lease, None)
            if c is not None and c.lost is None:
                c._lose(0, "its lease expired (simulated)")

    def finish(self) -> None:
        """The renewals' lateness, each group's worst (those still due count as late
        as they are by now)."""
        self._orders.put(("end",))
        self._ended.wait(60)


AHEAD_NICE = -10  # etcd's and the renewing processes' priority, where allowed


def _ahead() -> None:
    """Run this process (and the threads it starts) ahead of the simulated groups: in a
    job, etcd and each leader's renewals do not share 2 cores with a thousand other
    leaders, and here hundreds of runnable group threads (even at nice 19) starved etcd
    and the renewals until live leases lapsed. Needs root (or CAP_SYS_NICE); without it
    nothing changes, and the figures say so (``etcd_and_renewals_ahead``)."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, AHEAD_NICE)
    except OSError:
        pass


def _renew_leases(orders, reports, tick_s: float, sent) -> None:
    """The renewing process: ``("add", replica, lease, interval)`` starts renewing a lease
    every ``interval`` s, ``("drop", lease)`` stops, ``("end",)`` reports every
    replica's worst lateness, sent and answered, and ends; ``("lapsed", replica,
    lease)`` is reported for a lease etcd found expired."""
    import queue
    _ahead()
    etcd = None
    due: dict[int, tuple[float, int, float]] = {}  # lease -> (due, replica, interval)
    late: dict[str, dict[int, float]] = {"sent": {}, "answered": {}}

    def note(kind: str, replica: int, seconds: float) -> None:
        late[kind][replica] = max(late[kind].get(replica, 0.0), seconds)
    while True:
        try:
            while True:
                order = orders.get(timeout=tick_s / 5)
                if order[0] == "add":
                    _, replica, lease, interval = order
                    due[lease] = (time.monotonic() + interval, replica, interval)
                elif order[0] == "drop":
                    due.pop(order[1], None)
                else:
                    now = time.monotonic()
                    for at, replica, _ in due.values():
                        if now > at:
                            note("sent", replica, now - at)
                            note("answered", replica, now - at)
                    reports.put(("late", late))
                    return
        except queue.Empty:
            pass
        if etcd is None:
            from paddle_hsdp.ft.etcd import Etcd
            etcd = Etcd(SIM_ENDPOINTS[0])
        for lease, (at, replica, interval) in sorted(due.items(), key=lambda kv: kv[1][0]):
            if time.monotonic() < at:
                break
            note("sent", replica, time.monotonic() - at)
            try:
                sent.value += 1
                alive = etcd.keep_alive(lease) >= 0
            except Exception:  # noqa: BLE001 - etcd away: the next tick
                continue
            note("answered", replica, time.monotonic() - at)
            if alive:
                due[lease] = (time.monotonic() + interval, replica, interval)
            else:
                due.pop(lease, None)
                reports.put(("lapsed", replica, lease))


SIM_ENDPOINTS: list[str] = []  # the etcd the simulation runs against (set before forking)


class SimGroup:
    """One simulated replica group: the protocol's leader side, its ranks' clients of
    the job's shared data (the leader's JobStore; each other rank's RelayedStore,
    through the group's own store simulated in memory) and a step loop."""

    def __init__(self, args, replica: int, token: str, schedule: dict, t0: float,
                 renewer: Renewer, relays: list):
        protocol, _ = _protocol()
        from paddle_hsdp.ft.kv import JobStore
        from paddle_hsdp.ft.relay import MemoryChannel, Relay, RelayedStore
        self.p, self.args, self.replica, self.t0 = protocol, args, replica, t0
        self.schedule = schedule
        self.hung_at: float | None = None
        self._failure = threading.Event()
        # the leader's clients as ft.init makes them: its job store, and its protocol
        # sharing the store's connection (2 connections to etcd with the one watch)
        self.store = JobStore(args.endpoints, "sim", args.round_timeout)
        self.control = protocol.GroupControl(
            args.endpoints, "sim", replica, token, f"sim{replica}",
            protocol.Rules(start_replicas=args.groups, join_window_s=args.join_window),
            args.ttl, args.round_timeout, healthy=self._healthy,
            on_failure=lambda number: self._failure.set(), shared=self.store.etcd)
        self.control._renew = lambda: renewer.add(self.control)  # one renewer a process
        self.watch_bytes = 0  # keys and values its one watch delivered
        heard = self.control._on_watched

        def counted(kind: str, key: str, value: str, revision: int) -> None:
            self.watch_bytes += len(key) + len(value)
            heard(kind, key, value, revision)
        self.control._on_watched = counted
        self.renewer = renewer
        self.relay = None
        self.ranks = [self.store]
        if args.ranks_per_group > 1:
            # looked at by the process's one relay thread (_look_at_relays) when its
            # channel was written, not a thread per group polling it
            channel = MemoryChannel(on_write=lambda: relays.written(self.relay))
            self.relay = Relay(self.store, channel, looks=False)
            relays.append(self.relay)
            self.ranks += [RelayedStore(channel, "sim", args.round_timeout)
                           for _ in range(args.ranks_per_group - 1)]
        self._relays = relays
        self.rounds: dict[int, dict] = {}  # number -> arrived, held (wall times), requests
        self.phases: list[tuple[str, int, float, float]] = []  # (phase, round, from, to)
        self.errors: list[str] = []
        self.killed = False  # the simulated process is gone: the thread stops
        self.left_out: int | None = None  # the round it was left out of (it stops)
        self.step = 0
        self.saved: set[int] = set()  # the joint saves this group took part in

    @property
    def requests(self) -> int:
        return self.control.requests + self.store.etcd.requests

    def _healthy(self) -> bool:  # a hung rank is noticed by its leader after the timeout
        return self.hung_at is None or time.time() - self.hung_at < self.args.ttl

    def _arrive(self, number, expected, fresh, failed):
        before, t = self.control.etcd.requests, time.time()
        record = self.control.arrive(number, expected, self.p.Arrival(self.step, fresh, failed))
        self.rounds[number] = {"arrived": t, "held": time.time(),
                               "requests": self.control.etcd.requests - before,
                               "member": record is not None}
        if record is not None:
            self._set_up(record)
        return record

    def _set_up(self, record) -> None:
        """What every rank of the group does with the job's shared data once a round
        is formed (groups.connect, transfer.stream_state): the first member's ranks
        publish their outer groups' store addresses, the others' read theirs; in a
        rejoin the donor's ranks write their metadata, the receiver's read it and write
        their receipts, the other members' ranks wait for them."""
        if len(record.replicas) < 2 or self.args.ranks_per_group < 1:
            return
        p, n, started = self.p, record.number, time.time()
        ranks, timeout = self.ranks, self.args.round_timeout
        name = p.round_kv(n, "outer_store")
        try:
            for lr, rank in enumerate(ranks):
                if record.replicas[0] == self.replica:
                    rank.set_part(name, lr, len(ranks), f"127.0.0.1:{20000 + lr}")
                else:
                    rank.get_part(name, lr, timeout)
            self.phases.append(("set_up", n, started, time.time()))
            if not _transfer_plan(record)[0]:
                return
            started = time.time()
            metadata = "m" * (self.args.meta_kb * 1000)
            receivers, donor_of = _transfer_plan(record)
            donors = set(donor_of.values())
            # one donor feeding every other member broadcasts over the outer group:
            # its metadata goes with the tensors, nothing through etcd
            # (transfer._meta_over_link); otherwise point to point, as a handoff
            # (ft/handoff.py): the donor writes one value per receiver rank, the
            # receiver reads it and writes its receipts, bystanders await them
            if len(donors) == 1 and set(receivers) == set(record.replicas) - donors:
                self.phases.append(("first_transfer" if n == 0 else "rejoin", n, started,
                                    time.time()))
                return
            bystander = self.replica not in donors and self.replica not in receivers
            for receiver in receivers:
                donor = donor_of[receiver]
                receipts = p.round_kv(n, "received", receiver)
                for lr, rank in enumerate(ranks):
                    meta = p.round_kv(n, "state", lr, "model", donor)
                    if self.replica == donor:
                        rank.set(meta, metadata)
                    elif self.replica == receiver:
                        rank.get(meta, timeout)
                        rank.set_part(receipts, lr, len(ranks), "1")
                    elif bystander:
                        rank.get_part(receipts, lr, timeout)
            self.phases.append(("rejoin" if n else "first_transfer", n, started, time.time()))
        except Exception as e:  # noqa: BLE001 - reported with the figures
            self.errors.append(f"round {n} set-up: {type(e).__name__}: {e}")

    def _save(self, record, number: int) -> None:
        """A joint save's traffic (ft/joint_save.py's names and calls, JointSave.gather,
        announce and outcome): the leader puts its commit record; the lowest live group
        reads every record as it is written and announces the
        outcome, a value of the round (every group's one watch carries it); every other
        rank waits for the outcome (the mates through their leader)."""
        started, replicas = time.time(), record.replicas
        base = f"paddle_hsdp/ft/save/sim{number}"
        outcome = self.p.round_kv(record.number, "save", f"sim{number}", "outcome")
        try:
            lease = self.store.lease(3 * self.args.round_timeout)
            self.store.set(f"{base}/group/{self.replica}", json.dumps(
                {"file": f"group{self.replica}.json", "bytes": 1, "sha256": "0"}), lease)
            publisher = self.replica == replicas[0]  # the lowest live group
            if publisher:
                for r in replicas:
                    self.store.get(f"{base}/group/{r}", self.args.round_timeout)
                self.store.set(outcome, "", self.store.lease(3 * self.args.round_timeout))
            for rank in self.ranks[1 if publisher else 0:]:
                rank.get(outcome, 2 * self.args.round_timeout)
            self.phases.append(("joint_save", number, started, time.time()))
        except Exception as e:  # noqa: BLE001 - reported with the figures
            self.errors.append(f"save {number}: {type(e).__name__}: {e}")

    def run(self, joiner: bool, end: float, start_at: float = 0.0) -> None:
        try:
            time.sleep(max(0.0, start_at - time.time()))  # (a staggered start: --start-over)
            self._run(joiner, end)
        except Exception as e:  # noqa: BLE001 - a killed group's calls fail: it is gone
            if not self.killed:
                self.errors.append(f"{type(e).__name__}: {e}")

    def _run(self, joiner: bool, end: float) -> None:
        c, args = self.control, self.args
        try:
            c.register()
        except self.p.FaultToleranceError:
            return
        number, expected = (c.next_open(), None) if joiner else (0, None)
        while True:  # arrive until in a round
            record = self._arrive(number, expected, True, False)
            if record is not None:
                break
            number = max(number + 1, c.next_open())
        c.committed()
        while time.time() < end and c.lost is None and not self.killed:
            # the next step boundary (shared by every group, as an outer all-reduce is)
            k = int((time.time() - self.t0) / args.step_s) + 1
            boundary = self.t0 + k * args.step_s
            failed = self._failure.wait(max(0.0, boundary - time.time()))
            now = time.time()
            if self.replica == self.schedule.get("fail_by") and \
                    self.schedule["fail_at"] <= now < self.schedule["fail_at"] + args.step_s:
                self.schedule = {**self.schedule, "fail_by": None}
                c.announce_failure(record.number)  # as a failed collective would
                failed = True
            # each save once, at the first step boundary from its time on (a group
            # still in a rejoin's transfer then saves late, as a real one would at that
            # step: it missed the window before, and every other group waited for it)
            for i, at in enumerate(self.schedule.get("saves", [])):
                if at <= now and i not in self.saved and not failed:
                    self.saved.add(i)
                    self._save(record, i)
            # a real group's collective fails with the failed group's (every survivor
            # arrives "failed"), whether or not it heard the announcement first
            failed = failed or c.round_failed(record.number)
            if failed or c.join_waiting():
                self._failure.clear()
                if failed:
                    c.failed()
                got = self._arrive(record.number + 1, record.replicas, False, failed)
                if got is None:
                    self.left_out = record.number + 1  # (a real one would join the next)
                    return
                record = got
                c.committed()
                continue
            held = self.rounds[record.number]["held"]
            if any(held < t <= now for t in self.schedule.get("stops", [])):
                # a failure, kill or hang was injected since this round formed: a real
                # group's outer all-reduce fails or hangs there, so no step completes
                # until the next round (each survivor arrives with the same step)
                continue
            # the step is the boundary's number: a real job's groups take each step
            # together (the outer all-reduce waits for the slowest), so a group that
            # held round 0's record late does not arrive behind (with a step of its own
            # it did, and the next rounds moved state to it: spurious transfers)
            self.step = k
            c.committed()

    def stop(self) -> None:
        self.killed = True
        self.renewer.drop(self.control)  # its lease expires, as a killed group's does
        self.control.close(revoke=False)
        if self.relay is not None:
            self.relay.stop()
            if self.relay in self._relays:
                self._relays.remove(self.relay)


_plans: dict[tuple, tuple[list[int], dict[int, int]]] = {}
_plans_lock = threading.Lock()


def _transfer_plan(record) -> tuple[list[int], dict[int, int]]:
    """A round's receivers and each one's donor, computed once per process (the record
    computes them anew at each call, O(R) each: the process's groups asking R times
    each took minutes of CPU at 128 groups)."""
    key = (record.number, tuple(record.replicas))
    with _plans_lock:
        if key not in _plans:
            receivers = list(record.receivers)
            _plans[key] = (receivers, {r: record.donor_of(r) for r in receivers})
        return _plans[key]


def _count_paths() -> Counter:
    """Count this process's requests to etcd by path (``kv/put``, ``lease/keepalive``,
    ...): which calls make a phase's peak."""
    from paddle_hsdp.ft import etcd
    paths: Counter = Counter()
    call = etcd.Etcd.call

    def counted(self, path, payload):
        paths[path] += 1
        return call(self, path, payload)
    etcd.Etcd.call = counted
    return paths


def _count_bytes() -> list[int]:
    """Count the bytes of JSON every etcd client of this process reads (unary answers
    and watch events' lines, as they come off the connection): [total]. (Counted as
    received, not encoded again: re-encoding every answer was 14% of a worker's CPU.)"""
    import requests
    read = [0]
    answer, lines = requests.Response.json, requests.Response.iter_lines

    def counted_json(self, **kwargs):
        read[0] += len(self.content)
        return answer(self, **kwargs)

    def counted_lines(self, *args, **kwargs):
        for line in lines(self, *args, **kwargs):
            read[0] += len(line)
            yield line
    requests.Response.json, requests.Response.iter_lines = counted_json, counted_lines
    return read


class _Relays(list):
    """A process's simulated groups' relays, and which of them had their channel
    written since the last look (:func:`_look_at_relays`)."""

    def __init__(self) -> None:
        super().__init__()
        self._written: set = set()
        self._woken = threading.Condition(threading.Lock())

    def written(self, relay) -> None:
        with self._woken:
            self._written.add(relay)
            self._woken.notify()

    def take_written(self, timeout_s: float) -> set:
        with self._woken:
            self._woken.wait_for(lambda: self._written, timeout_s)
            taken, self._written = self._written, set()
            return taken


def _look_at_relays(relays: _Relays, end: float) -> None:
    """Every simulated group's relay, looked at by one thread of the process as each
    leader's relay thread would, but only once its channel was written (a mate's
    request or cancellation; a real relay polls Paddle's store, which tells no
    changes), and every relay once a second: a polling thread per group, then one
    thread polling every relay every 2-50 ms, starved 2 cores at 1,024 groups."""
    every_s, last_all = 1.0, time.time()
    while time.time() < end:
        batch = relays.take_written(every_s)
        if time.time() - last_all >= every_s:
            batch, last_all = set(relays), time.time()
        for relay in batch:
            if relay is not None:
                relay.look()


def _worker(args, replicas, schedule, t0, end, queue):
    import faulthandler
    import signal
    faulthandler.register(signal.SIGUSR1)  # kill -USR1 <worker>: every thread's stack
    protocol, _ = _protocol()
    renewer = Renewer(protocol)  # (forked before this process lowers its priority)
    # the lowest priority: CFS weighs each runnable thread, and a worker's hundreds of
    # threads at +5 outweighed etcd's and the renewing process's few (renewals went out
    # 13 s late at 1,024 groups); the simulated clients wait, not etcd or the renewals
    os.nice(19)
    # a leader's relay waits (one per mate's request) call their abort() every 0.05 s;
    # 1,024 leaders' in one machine every 0.5 s (cancellation heard later; nothing else)
    from paddle_hsdp.ft import kv
    kv.ABORT_TICK_S = 0.5
    # a thread waiting for Python's lock wakes every switch interval (5 ms) to ask for
    # it: with 64 groups' threads woken together (a record on every watch) that convoy
    # kept hundreds of threads runnable on 2 cores; a real leader has a few threads
    sys.setswitchinterval(0.1)
    read, paths = _count_bytes(), _count_paths()
    relays = _Relays()
    groups = {r: SimGroup(args, r, f"t{r}", schedule, t0, renewer, relays) for r in replicas}
    threading.Thread(target=_look_at_relays, args=(relays, end + 3 * args.round_timeout),
                     daemon=True, name="sim-relays").start()
    # group r starts at r / R of --start-over (a job's pods come up over a while)
    threads = {r: threading.Thread(target=g.run, daemon=True, args=(
        False, end, t0 + args.start_over * r / args.groups)) for r, g in groups.items()}
    for thread in threads.values():
        thread.start()
    every = list(groups.values())
    series: list[tuple[int, int, int, dict]] = []  # (tick, requests, bytes read, by path)

    def sample() -> None:
        tick = int((time.time() - t0) / SAMPLE_S)
        while time.time() < end:
            tick += 1
            time.sleep(max(0.0, t0 + tick * SAMPLE_S - time.time()))
            series.append((tick, sum(g.requests for g in every) + renewer.sent.value,
                           read[0], dict(paths)))
    threading.Thread(target=sample, daemon=True, name="sim-sampler").start()
    samples, events = {}, sorted(schedule.get("events", []))
    watched: dict[int, tuple[int, int, int]] = {}
    for when, what, replica in events:
        time.sleep(max(0.0, when - time.time()))
        if what == "sample":
            samples[replica] = sum(g.requests for g in every) + renewer.sent.value
            if replica == "from":
                watched = {id(g): _watched(g) for g in groups.values()}
        elif replica in groups and what == "kill":
            groups[replica].stop()
        elif replica in groups and what == "hang":
            groups[replica].hung_at = time.time()
        elif replica in groups and what == "rejoin":
            groups[replica] = SimGroup(args, replica, f"t{replica}b",
                                       {**schedule, "fail_by": None}, t0, renewer, relays)
            every.append(groups[replica])
            threads[replica] = threading.Thread(target=groups[replica].run, args=(True, end),
                                                daemon=True)
            threads[replica].start()
    time.sleep(max(0.0, end - time.time()))
    # what the one watch of each group that ran throughout delivered: at the steady
    # stretch's start (round 0 and its set-up) and, per round since, to the end
    watch = [(*watched[id(g)], *_watched(g)) for g in groups.values()
             if id(g) in watched and g.control.lost is None and not g.killed]
    renewer.finish()
    for g in every:  # a group waiting for a round the others left stops waiting
        try:
            g.stop()
        except Exception as e:  # noqa: BLE001 - (a watch's stream closing twice): the
            g.errors.append(f"stop: {type(e).__name__}: {e}")  # figures still go back
    gone_by = time.time() + 10  # (a rank's wait of a round timeout is not waited out)
    for thread in threads.values():
        thread.join(timeout=max(0.0, gone_by - time.time()))
    queue.put({"samples": samples, "series": series, "watch": watch,
               "rounds": [{**v, "replica": g.replica, "number": n}
                          for g in every for n, v in g.rounds.items()],
               "phases": [(ph, n, a, b, g.replica) for g in every for ph, n, a, b in g.phases],
               "deaths": [(t, r, g.replica) for g in every for t, r in g.control.deaths_seen],
               "lost": [g.replica for g in every if g.control.lost is not None],
               "left_out": [(g.replica, g.left_out) for g in every if g.left_out is not None],
               "late": renewer.late, "lapsed": sorted(renewer.lapsed),
               "errors": [f"group {g.replica}: {e}" for g in every for e in g.errors],
               "requests": sum(g.requests for g in every) + renewer.sent.value})


def _watched(group: SimGroup) -> tuple[int, int, int]:
    """A group's watch so far: (events, bytes of keys and values, its newest round)."""
    return group.control.events_seen, group.watch_bytes, group.control.newest_round()


SAMPLE_S = 0.5  # requests and bytes are sampled this often (phase peaks: per second)


def _etcd_connections(port: int) -> int:
    """Established TCP connections to ``port`` from this host's clients (Linux)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    if fields[3] == "01" and int(fields[2].rsplit(":", 1)[1], 16) == port:
                        count += 1
        except OSError:
            continue
    return count


def simulate(args) -> dict:
    t0 = time.time() + 3.0 + args.groups / 200  # every process set up by then
    # round 0's set-up and first transfer done (the groups start over --start-over
    # from t0; each group's outer-store addresses: --settle-s)
    steady_from = t0 + args.start_over + 10.0 + args.groups / 100 + args.settle_s
    steady_to = steady_from + args.steady_s
    gap = args.ttl + 2 * args.join_window + 5
    fail_at, kill_at = steady_to + 1, steady_to + 1 + gap
    hang_at, rejoin_at = kill_at + gap, kill_at + 2 * gap
    saves = [rejoin_at + gap + i * 4 * args.step_s for i in range(args.saves)] \
        if args.churn else []
    last = saves[-1] + gap if saves else rejoin_at + gap
    end = t0 + max(args.minutes * 60, last - t0)
    victims = {"fail_by": 1, "kill": 2, "hang": 3}
    events = [(steady_from, "sample", "from"), (steady_to, "sample", "to"),
              (kill_at, "kill", victims["kill"]), (hang_at, "hang", victims["hang"]),
              (rejoin_at, "rejoin", victims["kill"])]
    schedule = {"fail_by": victims["fail_by"], "fail_at": fail_at, "events": events,
                "stops": [fail_at, kill_at, hang_at],
                "saves": saves}
    procs = max(1, min(args.processes or max(1, args.groups // 64), args.groups))
    port = int(args.endpoints.rsplit(":", 1)[1])
    SIM_ENDPOINTS[:] = [args.endpoints]
    # not the groups': etcd's gateway's own (to its gRPC server), and one per renewing
    # process (the groups' renewals, which a real leader sends over its requests' one)
    others = _etcd_connections(port) + procs
    queue = mp.get_context("fork").Queue()
    workers = [mp.get_context("fork").Process(
        target=_worker, args=(args, list(range(i, args.groups, procs)), schedule, t0, end, queue))
        for i in range(procs)]
    for w in workers:
        w.start()
    connections: list[tuple[float, int]] = []
    while time.time() < end:
        connections.append((time.time(), _etcd_connections(port)))
        time.sleep(SAMPLE_S)
    results = []
    for _ in workers:  # a worker that died reports nothing: the others' figures still
        try:
            results.append(queue.get(timeout=max(0.0, end - time.time()) + 90))
        except Exception:  # noqa: BLE001 - (queue.Empty) counted below
            break
    for w in workers:
        w.join(timeout=30)
    keys = _key_count(args.endpoints)
    figures = _figures(args, results, t0, steady_from, steady_to, fail_at, kill_at, hang_at,
                       rejoin_at, victims)
    figures.update(_phases(args, results, t0, steady_from, steady_to,
                           [(t, n - others) for t, n in connections]))
    figures["connections_not_the_groups"] = others
    figures["keys_after"] = keys
    figures["workers_reported"] = f"{len(results)} of {len(workers)}"
    figures["load_average_1m"] = os.getloadavg()[0]  # others' work on the same cores
    return figures


def _key_count(endpoints: str) -> int:
    protocol, _ = _protocol()
    from paddle_hsdp.ft.etcd import Etcd
    return Etcd(endpoints).count_prefix(protocol.Keys("sim").root)


def _phases(args, results, t0, steady_from, steady_to, connections) -> dict:
    """Per phase: its window (the first group's start to the last group's end), the
    peak requests/s to etcd over any second of it, the most connections open to etcd,
    and the bytes read per group (JSON as the clients parse it) per round."""
    totals: dict[int, list[int]] = {}
    by_path: dict[int, Counter] = {}  # the groups' requests (renewals not) by path
    for res in results:
        for tick, requests, read, paths in res["series"]:
            row = totals.setdefault(tick, [0, 0])
            row[0] += requests
            row[1] += read
            by_path.setdefault(tick, Counter()).update(paths)
    ticks = sorted(totals)
    per_s = 1 / SAMPLE_S

    def window_figures(start: float, stop: float, rounds: int) -> dict:
        inside = [t for t in ticks if start - SAMPLE_S <= t0 + t * SAMPLE_S <= stop + 2 * SAMPLE_S]
        rates = [(totals[b][0] - totals[a][0]) * per_s for a, b in zip(inside, inside[1:], strict=False)]
        peaks = [(sum(rates[i:i + int(per_s)]) / int(per_s), i)
                 for i in range(max(1, len(rates) - int(per_s) + 1))]
        peak, at = max(peaks, default=(0.0, 0))
        top = {}  # the peak second's requests by path, the most frequent first
        if len(inside) > at + int(per_s):
            a, b = inside[at], inside[at + int(per_s)]
            top = dict((by_path[b] - by_path[a]).most_common(4))
        read = totals[inside[-1]][1] - totals[inside[0]][1] if len(inside) > 1 else 0
        conns = [n for t, n in connections if start - SAMPLE_S <= t <= stop + SAMPLE_S]
        return {"from_s": round(start - t0, 1), "seconds": round(stop - start, 2),
                "peak_req_per_s": round(peak, 1), "peak_by_path": top,
                "connections": max(conns, default=None),
                "bytes_read_per_group_per_round": round(read / args.groups / max(1, rounds))}
    out: dict = {"phases": {"steady": window_figures(steady_from, steady_to, 1)}}
    out["phases"]["steady"]["bytes_read_per_group_per_round"] = None  # (no round)
    spans: dict[tuple[str, int], list[float]] = {}
    for res in results:
        for phase, number, start, stop, _ in res["phases"]:
            span = spans.setdefault((phase, number), [start, stop])
            span[0], span[1] = min(span[0], start), max(span[1], stop)
        for r in res["rounds"]:  # a round: its first arrival to its last holder
            span = spans.setdefault(("round", r["number"]), [r["arrived"], r["held"]])
            span[0], span[1] = min(span[0], r["arrived"]), max(span[1], r["held"])
    kinds: dict[str, list[dict]] = {}
    for (phase, number), (start, stop) in sorted(spans.items(), key=lambda kv: kv[1][0]):
        kind = "first_round" if phase == "round" and number == 0 else \
            "first_set_up" if phase == "set_up" and number == 0 else phase
        kinds.setdefault(kind, []).append(window_figures(start, stop, 1))
    for kind, rows in kinds.items():  # the worst of each phase's instances
        out["phases"][kind] = {"count": len(rows), **{
            name: max((r[name] for r in rows if r[name] is not None), default=None)
            for name in ("seconds", "peak_req_per_s", "connections",
                         "bytes_read_per_group_per_round")},
            "peak_by_path": max(rows, key=lambda r: r["peak_req_per_s"])["peak_by_path"]}
    out["set_ups_done"] = {f"{phase} {number}": count for (phase, number), count in sorted(
        Counter((ph, n) for res in results for ph, n, _, _, _ in res["phases"]).items())}
    out["peak_connections"] = max((n for _, n in connections), default=None)
    for kind in ("sent", "answered"):  # the simulator's lateness; etcd's answers'
        out[f"renewal_{kind}_late_max_s"] = round(max(
            (v for res in results for v in res["late"][kind].values()), default=0.0), 2)
    # each group's errors, by kind (numbers left out), the most frequent first
    kinds_of_error: dict[str, int] = {}
    for res in results:
        for e in res["errors"]:
            text = re.sub(r"\d+", "N", e.split(": ", 1)[-1])[:160]
            kinds_of_error[text] = kinds_of_error.get(text, 0) + 1
    out["errors"] = sorted(kinds_of_error.items(), key=lambda kv: -kv[1])[:6]
    return out


def _round_s(rounds, number, since: str = "first") -> float | None:
    """Round ``number``: from its first arrival (``since="first"``) or its last to the
    last group holding its record; ``since="spread"``: first arrival to last."""
    rows = [r for r in rounds if r["number"] == number]
    if not rows:
        return None
    first, last = min(r["arrived"] for r in rows), max(r["arrived"] for r in rows)
    if since == "spread":
        return round(last - first, 3)
    return round(max(r["held"] for r in rows) - (first if since == "first" else last), 3)


def _figures(args, results, t0, steady_from, steady_to, fail_at, kill_at, hang_at, rejoin_at,
             victims) -> dict:
    rounds = [r for res in results for r in res["rounds"]]
    deaths = [d for res in results for d in res["deaths"]]
    steady = sum(res["samples"].get("to", 0) - res["samples"].get("from", 0) for res in results)
    first_arrival = {}
    for r in rounds:
        first_arrival[r["number"]] = min(first_arrival.get(r["number"], 1e18), r["arrived"])
    after = lambda when: min((n for n, t in first_arrival.items() if t >= when), default=None)
    fail_round, rejoin_round = after(fail_at), after(rejoin_at)

    def detected(victim, since, first=False):
        """From ``since`` to the last group (``first``: the first) hearing of it."""
        seen = [t for t, who, observer in deaths if who == victim and t >= since
                and observer != victim]
        return round((min(seen) if first else max(seen)) - since, 3) if seen else None

    injected = {victims["kill"], victims["hang"]}
    numbers = sorted(first_arrival)
    per_round = [sum(r["requests"] for r in rounds if r["number"] == n) for n in numbers]
    return {
        "groups": args.groups, "ttl_s": args.ttl, "minutes": round((time.time() - t0) / 60, 1),
        "steady_req_per_s": round(steady / (steady_to - steady_from), 1),
        "first_round_s": _round_s(rounds, 0),
        # (the groups start over --start-over: round 0 closes once the last arrived)
        "first_round_after_last_arrival_s": _round_s(rounds, 0, "last"),
        "round_s": _round_s(rounds, fail_round) if fail_round is not None else None,
        "round_arrivals_spread_s": _round_s(rounds, fail_round, "spread")
        if fail_round is not None else None,
        "round_after_last_arrival_s": _round_s(rounds, fail_round, "last")
        if fail_round is not None else None,
        "rejoin_round_s": _round_s(rounds, rejoin_round) if rejoin_round is not None else None,
        "detect_dead_s": detected(victims["kill"], kill_at),
        "detect_hung_s": detected(victims["hang"], hang_at),
        "detect_dead_first_s": detected(victims["kill"], kill_at, first=True),
        "detect_hung_first_s": detected(victims["hang"], hang_at, first=True),
        # a group heard of as gone, or that lost its lease, that nobody killed or hung:
        # the simulator's if one of its renewals went out late enough for the lease to
        # lapse (this process was behind), else the protocol's
        **_false_deaths(args, results, deaths, injected),
        "req_per_round": round(statistics.mean(per_round), 1) if per_round else None,
        "rounds": len(numbers),
        "requests_total": sum(res["requests"] for res in results),
        # groups left out of a round (late past the join window): a real one joins the
        # next round; here it stops, so a count above 0 shrinks the job from then on
        "left_out": sorted(Counter(n for res in results for _, n in res["left_out"]).items()),
        **_watch_figures(results),
    }


def _watch_figures(results) -> dict:
    """Per group, what its one watch delivered: events by the end of round 0's set-up
    (the start: R registrations once reached every group), and bytes per round after."""
    rows = [w for res in results for w in res["watch"]]
    per_round = [(b1 - b0) / (n1 - n0) for _, b0, n0, _, b1, n1 in rows if n1 > n0]
    return {"watch_events_per_group_at_start": max((e0 for e0, *_ in rows), default=None),
            "watch_bytes_per_group_per_round": round(statistics.mean(per_round))
            if per_round else None}


def _false_deaths(args, results, deaths, injected) -> dict:
    falsely = {who for _, who, _ in deaths if who not in injected} | \
        {r for res in results for r in res["lost"] if r not in injected}
    sent_late: dict[int, float] = {}  # by the renewer's own clock
    for res in results:
        for replica, seconds in res["late"]["sent"].items():
            sent_late[replica] = max(sent_late.get(replica, 0.0), seconds)
    slack = args.ttl - max(2, round(args.ttl)) / 3  # a renewal this late lets it lapse
    # the simulator's: a renewal of the group went out late enough (by its own clock)
    # for the lease to lapse; the rest (renewals sent in time, yet the lease ended or
    # the group was heard gone: etcd answered late, or the protocol) the protocol's
    by_simulator = {r for r in falsely if sent_late.get(r, 0.0) >= slack - 1}
    return {"false_deaths": len(falsely - by_simulator),
            "false_deaths_by_simulator": len(by_simulator)}


# ---------------------------------------------------------------- the soak
def soak(endpoints: str, rounds: int, groups: int = 4, ranks: int = 2,
         rejoin_every: int = 5, save_every: int = 25, meta_kb: int = 200,
         sample_every: int = 100, round_timeout: float = 5.0, job: str = "soak",
         ttl: float = 10.0, log=print) -> list[dict]:
    """Rounds back to back, as many as ``rounds``, of ``groups`` replica groups in this
    process (a thread each per round), against the etcd at ``endpoints``: every round
    the groups arrive (the real protocol: arrivals, the decider key, the record and, two
    rounds later, the decider's deletion of what no group reads); each round's outer
    group store address is published per local rank (``ranks``), as the first member's
    ranks do; every ``rejoin_every`` rounds the last group dies (its lease revoked), and
    at the next round registers anew and rejoins: its donor's ranks write the rejoin's
    metadata (``meta_kb`` KB each, under the name the transfer writes it), the
    joiner's ranks read it and write their receipts; every ``save_every`` rounds the
    groups save jointly (the real :class:`~paddle_hsdp.ft.joint_save.JointSave`'s
    gather, announce and outcome: its commit records, counter and outcome, on leases).
    Every ``sample_every`` rounds (and at the end) a sample: the round, the keys under
    the job's prefix and under its ``kv/``, and etcd's database size (``dbSize``, the
    file; ``dbSizeInUse``, what holds data), from its maintenance API; the last
    sample also counts the groups a round left out (late: they rejoin at the next)."""
    protocol, _ = _protocol()
    from paddle_hsdp.ft.etcd import Etcd
    from paddle_hsdp.ft.kv import JobStore
    joint_save = None
    if save_every:
        from paddle_hsdp.ft import joint_save  # imports Paddle (its store module)
    keys, probe = protocol.Keys(job), Etcd(endpoints)
    # a round closes once every member is in; the window matters only for a late one
    rules = protocol.Rules(start_replicas=groups, join_window_s=round_timeout / 2)
    stores = {}  # replica -> JobStore (its leader's: its ranks' calls go through it)

    def control(replica: int, generation: int):
        c = protocol.GroupControl(endpoints, job, replica, f"t{replica}.{generation}",
                                  f"soak{replica}", rules, ttl, round_timeout)
        c.register()
        return c

    def store(replica: int) -> JobStore:
        if replica not in stores:
            stores[replica] = JobStore(endpoints, job, round_timeout)
        return stores[replica]

    def together(calls) -> list:
        out, errors = [None] * len(calls), []

        def go(i, call):
            try:
                out[i] = call()
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)
        threads = [threading.Thread(target=go, args=(i, c)) for i, c in enumerate(calls)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(3 * round_timeout)
        if errors:
            raise errors[0]
        return out

    controls = {r: control(r, 0) for r in range(groups)}
    generation, steps, samples = 0, 0, []
    metadata = "x" * (meta_kb * 1000)
    record = together([lambda c=c: c.arrive(0, None, protocol.Arrival(0, True))
                       for c in controls.values()])[0]
    number = 0
    for c in controls.values():
        c.committed()

    def sample() -> None:
        status = probe.status()
        row = {"round": number, "keys": probe.count_prefix(keys.root),
               "kv_keys": probe.count_prefix(keys.kv),
               "db_mb": round(int(status["dbSize"]) / 2 ** 20, 2),
               "db_in_use_mb": round(int(status.get("dbSizeInUse", 0)) / 2 ** 20, 2),
               "s": round(time.time() - started, 1)}
        samples.append(row)
        log(" ".join(f"{k}={v}" for k, v in row.items()))

    started = time.time()
    sample()
    victim, left_out, left_out_total = groups - 1, [], 0
    while number < rounds:
        number += 1
        steps += 1
        dying = rejoin_every and number % rejoin_every == 0
        if dying and victim in controls:
            controls.pop(victim).close()  # its lease revoked: the others hear it left
        expected = record.replicas
        # left out of the last round (late, on a loaded host): they come back as joiners
        joiners = [r for r in left_out if r in controls]
        if rejoin_every and number % rejoin_every == 1 and number > 1:
            generation += 1  # the dead group registers anew
            controls[victim] = control(victim, generation)
            joiners.append(victim)
        waiting, got = [], {}
        for r in sorted(set(joiners)):  # they arrive first, so the round takes them in
            c = controls[r]
            if c.next_open() != number:
                raise RuntimeError(f"soak: a joiner would arrive at round {c.next_open()}, "
                                   f"not {number}")
            waiting.append(threading.Thread(
                target=lambda r=r, c=c, n=number, into=got: into.__setitem__(
                    r, c.arrive(n, None, protocol.Arrival(0, True)))))
            waiting[-1].start()
            deadline = time.time() + round_timeout
            while c.etcd.get(keys.join(number)) is None and time.time() < deadline:
                time.sleep(0.002)
        members = {r: c for r, c in sorted(controls.items()) if r not in joiners}
        results = dict(zip(members, together([lambda c=c, n=number, e=expected, k=steps:
                                              c.arrive(n, e, protocol.Arrival(k))
                                              for c in members.values()]), strict=True))
        for thread in waiting:
            thread.join(3 * round_timeout)
        results.update(got)
        record = next(r for r in results.values() if r is not None)
        left_out = [r for r in controls if results.get(r) is None]
        left_out_total += len(left_out)
        for r, c in controls.items():
            if r not in left_out:
                c.committed()  # the step trained
        first = record.replicas[0]
        for lr in range(ranks):  # make_group_store's addresses: parts of one value
            store(first).set_part(protocol.round_kv(number, "outer_store"), lr, ranks,
                                  "127.0.0.1:1")
        for receiver in record.receivers:  # the rejoin's metadata, read, and receipts
            donor = record.donor_of(receiver)
            for lr in range(ranks):
                name = protocol.round_kv(number, "state", lr, "model", donor)
                store(donor).set(name, metadata)
                store(receiver).get(name)
                store(receiver).set_part(protocol.round_kv(number, "received", receiver),
                                         lr, ranks, "1")
        if save_every and number % save_every == 0:
            _soak_save(joint_save, record, steps, round_timeout,
                       {r: store(r) for r in record.replicas}, together)
        if number % sample_every == 0 or number == rounds:
            sample()
    for c in controls.values():
        c.close()
    samples[-1]["left_out"] = left_out_total
    return samples


def _soak_save(joint_save, record, step: int, round_timeout: float, stores: dict,
               together) -> None:
    """One joint save's etcd traffic, as the live groups' leaders make it (no files):
    each group's commit record and count, the publisher's outcome, the others' wait."""
    def one(replica: int) -> None:
        view = types.SimpleNamespace(round_timeout_s=round_timeout, step=step,
                                     round=record, outer=None, store=stores[replica],
                                     replica_id=replica)
        save = joint_save.JointSave(view)
        save.begin("/soak/checkpoint")
        if save.gather({"file": f"group{replica}.json", "bytes": 1, "sha256": "0"}) is None:
            if save.outcome():
                raise RuntimeError("soak: a joint save failed")
        else:
            save.announce("")
    together([lambda r=r: one(r) for r in record.replicas])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=16, help="replica groups (R)")
    parser.add_argument("--minutes", type=float, default=0, help="run at least this long")
    parser.add_argument("--ranks-per-group", type=int, default=1,
                        help="ranks per group (G): each a client of the job's shared data "
                             "in every round's set-up, rejoin and joint save (the leader's "
                             "JobStore; the others' RelayedStore, through the group's own "
                             "store, simulated in memory)")
    parser.add_argument("--churn", action="store_true",
                        help="also joint saves (--saves of them) after the rejoin, and "
                             "per-phase figures (in the JSON: phases)")
    parser.add_argument("--saves", type=int, default=2, help="joint saves with --churn")
    parser.add_argument("--processes", type=int, default=0,
                        help="processes the groups are spread over (default R/64: more starved"
                             " the leases' renewals on this 2-core machine)")
    parser.add_argument("--start-over", type=float, default=None,
                        help="s over which the groups start (register), evenly, as a job's "
                             "pods come up; default R/50 (20 s at 1,024 groups): the "
                             "simulator's choice, not the protocol's, which takes any")
    parser.add_argument("--settle-s", type=float, default=None,
                        help="s more before the steady stretch, for round 0's set-up "
                             "(each group's outer-store addresses); default 10")
    parser.add_argument("--ttl", type=float, default=10.0,
                        help="lease TTL = heartbeat timeout, s (PADDLE_HSDP_FT_HEARTBEAT_TIMEOUT)")
    parser.add_argument("--join-window", type=float, default=None,
                        help="s a round waits for a late member (PADDLE_HSDP_FT_JOIN_WINDOW);"
                             " default max(3, R/128): the simulated groups' arrivals "
                             "spread ~4 s at 1,024 on 2 cores, a real cluster's by ms")
    parser.add_argument("--round-timeout", type=float, default=120.0,
                        help="s (the soak uses at most 5: a joint save's keys live 3 of them)")
    parser.add_argument("--step-s", type=float, default=1.0, help="one training step, s")
    parser.add_argument("--steady-s", type=float, default=30.0,
                        help="the quiet stretch the steady load is measured over, s")
    parser.add_argument("--endpoints", default="",
                        help="an etcd to use (etcd://h:p[,...]); default: start the embedded one")
    parser.add_argument("--json", action="store_true", help="last line: the figures as JSON")
    parser.add_argument("--soak-rounds", type=int, default=0,
                        help="instead: a soak of this many rounds back to back (a rejoin "
                             "every --rejoin-every, a joint save every --save-every), "
                             "printing the job's key count and etcd's database size")
    parser.add_argument("--rejoin-every", type=int, default=5, help="soak: rounds per rejoin")
    parser.add_argument("--save-every", type=int, default=25,
                        help="soak: rounds per joint save (0: none)")
    parser.add_argument("--meta-kb", type=int, default=200,
                        help="KB of a rejoin's metadata per rank (a handoff's: through "
                             "etcd, to its one receiver)")
    parser.add_argument("--sample-every", type=int, default=100,
                        help="soak: rounds per sample printed")
    args = parser.parse_args(argv)
    if args.soak_rounds:
        return _main_soak(args, parser)
    if args.groups < 4:
        parser.error(f"--groups must be >= 4 (a failing, a killed and a hung group, and "
                     f"one that sees them), got {args.groups}")
    if args.start_over is None:
        args.start_over = args.groups / 50
    if args.join_window is None:
        args.join_window = max(3.0, args.groups / 128)
    if args.settle_s is None:  # round 0's set-up: addresses only (no metadata on etcd)
        args.settle_s = 10.0
    if args.start_over < 0 or args.settle_s < 0:
        parser.error(f"--start-over and --settle-s must be >= 0 s, got {args.start_over} "
                     f"and {args.settle_s}")
    if args.ranks_per_group < 1 or args.saves < 0:
        parser.error(f"--ranks-per-group must be >= 1 and --saves >= 0, got "
                     f"{args.ranks_per_group} and {args.saves}")
    _, etcd_server = _protocol()
    server = None
    if not args.endpoints:
        data = tempfile.mkdtemp(prefix="sim_ft_etcd_")
        port = 23000 + os.getpid() % 1000 * 2
        server = etcd_server.start("127.0.0.1", port, data, preexec_fn=_ahead)
        args.endpoints = f"etcd://127.0.0.1:{port}"
    try:
        figures = simulate(args)
        figures["etcd_and_renewals_ahead"] = server is not None and \
            os.getpriority(os.PRIO_PROCESS, server.pid) == AHEAD_NICE
    finally:
        if server is not None:
            server.terminate()
            server.wait()
            shutil.rmtree(data, ignore_errors=True)
    for name, value in figures.items():
        if name == "phases":
            for phase, row in value.items():
                print(f"{phase:>18}: " + " ".join(f"{k}={v}" for k, v in row.items()))
        else:
            print(f"{name:>18}: {value}")
    if args.json:
        print(json.dumps(figures))
    return 0


def _main_soak(args, parser) -> int:
    if args.soak_rounds < 1 or args.groups < 2:
        parser.error(f"--soak-rounds must be >= 1 and --groups >= 2 (a joiner and a donor), "
                     f"got {args.soak_rounds} and {args.groups}")
    for name in ("rejoin_every", "save_every", "sample_every", "meta_kb"):
        if getattr(args, name) < (1 if name == "sample_every" else 0):
            parser.error(f"--{name.replace('_', '-')} must be >= "
                         f"{1 if name == 'sample_every' else 0}, got {getattr(args, name)}")
    if args.rejoin_every == 1:
        parser.error("--rejoin-every must be 0 (none) or >= 2 (a group dies at one round "
                     "and rejoins at the next), got 1")
    _, etcd_server = _protocol()
    server = None
    if not args.endpoints:
        data = tempfile.mkdtemp(prefix="sim_ft_etcd_")
        port = 23000 + os.getpid() % 1000 * 2
        server = etcd_server.start("127.0.0.1", port, data)
        args.endpoints = f"etcd://127.0.0.1:{port}"
    try:
        samples = soak(args.endpoints, args.soak_rounds, args.groups,
                       rejoin_every=args.rejoin_every, save_every=args.save_every,
                       meta_kb=args.meta_kb, sample_every=args.sample_every,
                       round_timeout=min(args.round_timeout, 5.0), ttl=args.ttl,
                       log=lambda line: print(line, flush=True))
    finally:
        if server is not None:
            server.terminate()
            server.wait()
            shutil.rmtree(data, ignore_errors=True)
    if args.json:
        print(json.dumps(samples))
    return 0


if __name__ == "__main__":
    sys.exit(main())
