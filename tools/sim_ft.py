"""The fault-tolerance control plane at scale, simulated on one machine.

    python tools/sim_ft.py --groups 512 [--minutes 10] [--json]

R replica groups run the real protocol (paddle_hsdp/ft/protocol.py, its etcd client and
lease renewals, no Paddle: a group's training is a sleep per step and its outer group a
flag) against a real etcd (the embedded one unless --endpoints names another), spread
over a few processes. After the first round and a quiet stretch it injects, one at a
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
* ``false_deaths``: groups heard of as gone that nobody killed or hung, over the run;
* ``req_per_round``: requests the groups sent while forming a round, per round.

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
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _protocol():
    """paddle_hsdp.ft.protocol without paddle_hsdp's __init__ (which imports Paddle):
    the protocol and its etcd client import nothing of Paddle."""
    for name, path in (("paddle_hsdp", "paddle_hsdp"), ("paddle_hsdp.ft", "paddle_hsdp/ft")):
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = [os.path.join(ROOT, path)]
            sys.modules[name] = module
    from paddle_hsdp.ft import etcd_server, protocol
    return protocol, etcd_server


class SimGroup:
    """One simulated replica group: the protocol's leader side and a step loop."""

    def __init__(self, args, replica: int, token: str, schedule: dict, t0: float):
        protocol, _ = _protocol()
        self.p, self.args, self.replica, self.t0 = protocol, args, replica, t0
        self.schedule = schedule
        self.hung_at: float | None = None
        self._failure = threading.Event()
        self.control = protocol.GroupControl(
            args.endpoints, "sim", replica, token, f"sim{replica}",
            protocol.Rules(start_replicas=args.groups, join_window_s=args.join_window),
            args.ttl, args.round_timeout, healthy=self._healthy,
            on_failure=lambda number: self._failure.set())
        self.rounds: dict[int, dict] = {}  # number -> arrived, held (wall times), requests
        self.killed = False  # the simulated process is gone: the thread stops
        self.step = 0

    def _healthy(self) -> bool:  # a hung rank is noticed by its leader after the timeout
        return self.hung_at is None or time.time() - self.hung_at < self.args.ttl

    def _arrive(self, number, expected, fresh, failed):
        before, t = self.control.etcd.requests, time.time()
        record = self.control.arrive(number, expected, self.p.Arrival(self.step, fresh, failed))
        self.rounds[number] = {"arrived": t, "held": time.time(),
                               "requests": self.control.etcd.requests - before,
                               "member": record is not None}
        return record

    def run(self, joiner: bool, end: float) -> None:
        try:
            self._run(joiner, end)
        except Exception as e:  # noqa: BLE001 - a killed group's calls fail: it is gone
            if not self.killed:
                print(f"sim_ft: group {self.replica}: {type(e).__name__}: {e}", file=sys.stderr)

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
            if self.replica == self.schedule.get("fail_by") and \
                    self.schedule["fail_at"] <= time.time() < self.schedule["fail_at"] + args.step_s:
                self.schedule = {}
                c.announce_failure(record.number)  # as a failed collective would
                failed = True
            if failed or c.round_failed(record.number) or c.join_waiting():
                self._failure.clear()
                if failed or c.round_failed(record.number):
                    c.failed()
                got = self._arrive(record.number + 1, record.replicas, False, failed)
                if got is None:
                    return  # left out (a slow group): not what this simulation studies
                record = got
                c.committed()
                continue
            self.step += 1
            c.committed()


def _worker(args, replicas, schedule, t0, end, queue):
    protocol, _ = _protocol()
    groups = {r: SimGroup(args, r, f"t{r}", schedule, t0) for r in replicas}
    threads = {r: threading.Thread(target=g.run, args=(False, end), daemon=True)
               for r, g in groups.items()}
    for thread in threads.values():
        thread.start()
    samples, events = {}, sorted(schedule.get("events", []))
    for when, what, replica in events:
        time.sleep(max(0.0, when - time.time()))
        if what == "sample":
            samples[replica] = sum(g.control.requests for g in groups.values())
        elif replica in groups and what == "kill":
            groups[replica].killed = True
            groups[replica].control.close(revoke=False)
        elif replica in groups and what == "hang":
            groups[replica].hung_at = time.time()
        elif replica in groups and what == "rejoin":
            old = groups[replica]
            groups[replica] = SimGroup(args, replica, f"t{replica}b", {}, t0)
            groups[replica].old = old
            threads[replica] = threading.Thread(target=groups[replica].run, args=(True, end),
                                                daemon=True)
            threads[replica].start()
    time.sleep(max(0.0, end - time.time()))
    every = list(groups.values()) + [g.old for g in groups.values() if hasattr(g, "old")]
    for g in every:  # a group waiting for a round the others left stops waiting
        g.killed = True
        g.control.close(revoke=False)
    for thread in threads.values():
        thread.join(timeout=5)
    queue.put({"samples": samples,
               "rounds": [{**v, "replica": g.replica, "number": n}
                          for g in every for n, v in g.rounds.items()],
               "deaths": [(t, r, g.replica) for g in every for t, r in g.control.deaths_seen],
               "lost": [g.replica for g in every if g.control.lost is not None],
               "requests": sum(g.control.requests for g in every)})


def simulate(args) -> dict:
    t0 = time.time() + 3.0 + args.groups / 200  # every process set up by then
    steady_from = t0 + 10.0
    steady_to = steady_from + args.steady_s
    gap = args.ttl + 2 * args.join_window + 5
    fail_at, kill_at = steady_to + 1, steady_to + 1 + gap
    hang_at, rejoin_at = kill_at + gap, kill_at + 2 * gap
    end = t0 + max(args.minutes * 60, rejoin_at + gap - t0)
    victims = {"fail_by": 1, "kill": 2, "hang": 3}
    events = [(steady_from, "sample", "from"), (steady_to, "sample", "to"),
              (kill_at, "kill", victims["kill"]), (hang_at, "hang", victims["hang"]),
              (rejoin_at, "rejoin", victims["kill"])]
    schedule = {"fail_by": victims["fail_by"], "fail_at": fail_at, "events": events}
    procs = max(1, min(args.processes or max(1, args.groups // 64), args.groups))
    queue = mp.get_context("fork").Queue()
    workers = [mp.get_context("fork").Process(
        target=_worker, args=(args, list(range(i, args.groups, procs)), schedule, t0, end, queue))
        for i in range(procs)]
    for w in workers:
        w.start()
    results = [queue.get(timeout=end - time.time() + 3 * args.round_timeout) for _ in workers]
    for w in workers:
        w.join(timeout=30)
    return _figures(args, results, t0, steady_from, steady_to, fail_at, kill_at, hang_at,
                    rejoin_at, victims)


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
        "false_deaths": len({who for _, who, _ in deaths if who not in injected}) +
        len([r for res in results for r in res["lost"] if r not in injected]),
        "req_per_round": round(statistics.mean(per_round), 1) if per_round else None,
        "rounds": len(numbers),
        "requests_total": sum(res["requests"] for res in results),
    }


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
    stores = {}  # (replica, local rank) -> JobStore (one client per rank, as in a job)

    def control(replica: int, generation: int):
        c = protocol.GroupControl(endpoints, job, replica, f"t{replica}.{generation}",
                                  f"soak{replica}", rules, ttl, round_timeout)
        c.register()
        return c

    def store(replica: int, local_rank: int) -> JobStore:
        if (replica, local_rank) not in stores:
            stores[replica, local_rank] = JobStore(endpoints, job, round_timeout)
        return stores[replica, local_rank]

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
        for lr in range(ranks):  # make_group_store's address, by the first member's ranks
            store(first, lr).set(protocol.round_kv(number, "outer_store", lr), "127.0.0.1:1")
        for receiver in record.receivers:  # the rejoin's metadata, read, and receipts
            donor = record.donor_of(receiver)
            for lr in range(ranks):
                name = protocol.round_kv(number, "state", lr, "model", donor)
                store(donor, lr).set(name, metadata)
                store(receiver, lr).get(name)
                store(receiver, lr).set(protocol.round_kv(number, "received", lr, receiver),
                                        "1")
        if save_every and number % save_every == 0:
            _soak_save(joint_save, record, steps, round_timeout,
                       {r: store(r, 0) for r in record.replicas}, together)
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
    parser.add_argument("--processes", type=int, default=0,
                        help="processes the groups are spread over (default R/64: more starved"
                             " the leases' renewals on this 2-core machine)")
    parser.add_argument("--ttl", type=float, default=10.0,
                        help="lease TTL = heartbeat timeout, s (PADDLE_HSDP_FT_HEARTBEAT_TIMEOUT)")
    parser.add_argument("--join-window", type=float, default=3.0)
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
                        help="soak: KB of rejoin metadata per rank and rejoin")
    parser.add_argument("--sample-every", type=int, default=100,
                        help="soak: rounds per sample printed")
    args = parser.parse_args(argv)
    if args.soak_rounds:
        return _main_soak(args, parser)
    if args.groups < 4:
        parser.error(f"--groups must be >= 4 (a failing, a killed and a hung group, and "
                     f"one that sees them), got {args.groups}")
    _, etcd_server = _protocol()
    server = None
    if not args.endpoints:
        data = tempfile.mkdtemp(prefix="sim_ft_etcd_")
        port = 23000 + os.getpid() % 1000 * 2
        server = etcd_server.start("127.0.0.1", port, data)
        args.endpoints = f"etcd://127.0.0.1:{port}"
    try:
        figures = simulate(args)
    finally:
        if server is not None:
            server.terminate()
            server.wait()
    for name, value in figures.items():
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
    if args.json:
        print(json.dumps(samples))
    return 0


if __name__ == "__main__":
    sys.exit(main())
