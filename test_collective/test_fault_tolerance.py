"""Fault-tolerant HSDP (paddle_hsdp.ft): replica groups of two ranks, each its own launch
job, around a coordinator; three start.

1. The coordinator (etcd) is killed while replica 2 is in the middle of step 4's
   backward; 3 s later replica 2 kills every one of its processes (SIGKILL), and 45 s
   after that etcd is started again on its data. Replicas 0 and 1 abandon the step
   (their in-group vote does not wait for etcd), wait for etcd, form a round without
   replica 2 and go on.
2. Once they have finished step 6, replica 2 is started again with the same command,
   and a new replica 3 with it. Both arrive to join and sit the round's step (8) out,
   their state handed over beside it (issue 63 item 4); replica 3's ranks die
   (SIGKILL) while they receive it, which fails that attempt (or, if their all-reduce
   was through, the next) for everyone; the next round goes on without replica 3, and
   replica 2 rejoins from a healthy replica's state, training from step 9. Replica 0's
   step at the rejoin is checked against its median and the round's group creation.
3. Before step 10, etcd is started again on an empty folder (its data lost): every
   group notices it, registers anew, and the three meet at one round with their own
   steps (step 10's first attempt fails).
4. Rank 1 of replica 1 hangs (SIGSTOP) in the middle of step 12's backward: replicas 0
   and 2 see its heartbeat stop (through the new etcd) and go on without replica 1.

With HFSDP (fsdp_outer_sharding="optim", redundancy 2), four replica groups of one
rank: each of the optimizer state's two pieces is held by two groups.

1. Replica 3 dies (SIGKILL) in step 3's backward: piece 1 is left with replica 1, and
   the next round re-cuts it: replica 0 takes piece 1 from replica 1 besides its own.
2. Replica 3 is started again; while replica 0, the round's donor, sends it the
   state, replica 0 dies: the others go on with replica 3, which takes the model and
   piece 1 from replica 1, while replica 1 takes piece 0 from replica 2 (the re-cut).
3. Replica 2, piece 0's other holder, dies in step 8's backward: replica 1 holds it,
   so the job goes on (before the re-cut: PieceLostError), replica 3 taking piece 0.
4. The coordinator (etcd) is killed and started again on its data, then replica 0
   is started again and rejoins: the model and its piece from replica 1.

In each scenario every rank's losses and every replica's final parameters must equal a single-process
reference that trains step t on the batches of the replicas live at step t
(workers/single_process_ft.py), and every process that should end exits 0, within a
bound. Replica 1's launch is not waited for: its other rank leaves through the watchdog
(PADDLE_HSDP_COLLECTIVE_TIMEOUT, 10 s here); the stopped one outlives its launch, and
the test ends it with every other process it started (each launch's process group).
"""

import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from launcher import HERE, ROOT, run_single

STEPS = 15
KILL_AT = 4  # replica 2 dies in the middle of this step's backward
RESTART_AFTER = 6  # ... is started again after this step, with replica 3 (which dies)
WIPE_AT = 10  # etcd restarted on an empty folder before this step
STOP_AT = 12  # rank 1 of replica 1 hangs in the middle of this step's backward
# the job's secret (issue 62, item 7): the kill and HFSDP scenarios run with every
# record, arrival, store address and rejoin metadata signed and every transfer tensor
# checked by HMAC; the others run unsigned, as a job without the secret does
SECRET = {"PADDLE_HSDP_FT_SECRET": "the-fault-tolerance-tests-secret"}
BOUND_S = 300  # the whole scenario: five launches, a restart, a rejoin
ETCD_AWAY_S = 48  # etcd killed, replica 2 killed 3 s later, etcd back 45 s after that


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class FaultTolerantJob:
    """A coordinator and replica-group launches in one scratch folder; ``stop()`` kills
    whatever still runs (a failed test leaves nothing behind)."""

    def __init__(self, replicas: int, ranks: int = 2, steps: int = STEPS):
        self.work = tempfile.mkdtemp(prefix="hsdp_ft_")
        self.env = dict(os.environ, GLOG_minloglevel="2",
                        PYTHONPATH=os.pathsep.join([ROOT, os.path.join(HERE, "workers")]))
        port = self.port = _free_port()
        self.peer_port = _free_port()
        self.coordinator = self._start_coordinator()
        # for the suite's time: a hung rank is declared after 5 s (default 10), and a
        # round waits 1.5 s for a missing member (default 3; survivors of a failure
        # arrive within a fraction of a second of each other)
        self.env.update(PADDLE_HSDP_FT_COORDINATOR=f"etcd://127.0.0.1:{port}",
                        PADDLE_HSDP_FT_START_REPLICAS=str(replicas),
                        PADDLE_HSDP_FT_HEARTBEAT_TIMEOUT="5", PADDLE_HSDP_FT_JOIN_WINDOW="1.5")
        self.launches: list[tuple[str, subprocess.Popen]] = []
        self.ranks, self.steps = ranks, steps

    def _start_coordinator(self) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-m", "paddle_hsdp.ft.coordinator", "--host", "127.0.0.1",
             "--port", str(self.port), "--peer-port", str(self.peer_port), "--data-dir",
             os.path.join(self.work, "etcd")], env=self.env, stdout=subprocess.PIPE,
            stderr=open(os.path.join(self.work, "coordinator.err"), "a"), text=True)
        assert "etcd://" in proc.stdout.readline()
        return proc

    def restart_coordinator(self, away_s: float = 0.0, wipe: bool = False) -> None:
        """Kill the coordinator (SIGKILL: its etcd goes with it) and start it again with
        the same command (etcd's data folder keeps every lease and round; ``wipe``:
        deleted, as on a replaced host), ``away_s`` later, times this folder's
        ``etcd_down`` and ``etcd_back`` files record (``etcd_wiped_down``, ...)."""
        tag = "_wiped" if wipe else ""
        self.coordinator.kill()
        self.coordinator.wait(timeout=10)
        if wipe:
            shutil.rmtree(os.path.join(self.work, "etcd"))
        down = time.time()
        with open(os.path.join(self.work, f"etcd{tag}_down"), "w") as f:
            f.write(str(down))
        time.sleep(max(0.0, down + away_s - time.time()))
        self.coordinator = self._start_coordinator()
        with open(os.path.join(self.work, f"etcd{tag}_back"), "w") as f:
            f.write(str(time.time()))

    def start(self, replica: int, name: str, ranks: int | None = None, **env) -> subprocess.Popen:
        log_dir = os.path.join(self.work, name)
        proc = subprocess.Popen(
            [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node",
             str(ranks or self.ranks), "--log_dir", log_dir,
             os.path.join(HERE, "workers", "worker_ft.py"), self.work, str(self.steps)],
            env=dict(self.env, PADDLE_HSDP_FT_REPLICA_ID=str(replica), **env),
            cwd=self.work, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.launches.append((log_dir, proc))
        return proc

    def steps_done(self, replica: int) -> int:
        try:
            with open(os.path.join(self.work, f"progress{replica}")) as f:
                return int(f.read() or 0)
        except (OSError, ValueError):
            return 0

    def full_logs(self) -> str:
        """Every worker log of every launch, whole."""
        return "\n".join(open(p, errors="replace").read() for log_dir, _ in self.launches
                         for p in sorted(glob.glob(os.path.join(log_dir, "workerlog.*"))))

    def logs(self) -> str:
        return "\n".join(f"--- {p} ---\n" + "\n".join(open(p, errors="replace")
                                                       .read().splitlines()[-25:])
                         for log_dir, _ in self.launches
                         for p in sorted(glob.glob(os.path.join(log_dir, "workerlog.*"))))

    def stop(self) -> None:
        """End every process the job started: the launches and their workers (the
        launcher starts each worker in a session of its own, so a killed launcher
        leaves them running, and a stopped one outlives its launch): every process
        whose command line names this job's folder."""
        for _, proc in self.launches:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
        for pid in _pids_naming(self.work):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended meanwhile
                pass
        self.coordinator.terminate()
        self.coordinator.wait(timeout=10)


def _pids_naming(text: str) -> list[int]:
    """This machine's processes whose command line contains ``text`` (Linux /proc)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        pids.append(int(entry))
            except OSError:  # ended meanwhile
                continue
    return pids


def _log(job: FaultTolerantJob, name: str) -> str:
    """The leader's (rank 0's) log of launch ``name``."""
    try:
        return open(os.path.join(job.work, name, "workerlog.0"), errors="replace").read()
    except OSError:
        return ""


def _wait(condition, deadline: float, job: FaultTolerantJob, what: str) -> None:
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}\n{job.logs()}"
        time.sleep(0.2)


def test_a_killed_replica_leaves_the_others_training_and_rejoins():
    job = FaultTolerantJob(replicas=3)
    # a 3 s join window: a survivor whose failed collective ends in gloo's timeout (10 s
    # for replica 1) rather than a reset arrives later than the others; under the suite's
    # load that was 1.8 s once, past 1.5 s: it was left out, rejoined, and the script's
    # pauses no longer matched (2026-12-08)
    job.env.update(SECRET, PADDLE_HSDP_FT_JOIN_WINDOW="3")
    start = time.time()
    deadline = start + BOUND_S
    try:
        waits = f"2@{RESTART_AFTER + 1},3@{RESTART_AFTER + 1}"
        pause = str(WIPE_AT)
        first = job.start(0, "replica0", FT_TEST_WAIT_JOIN=waits, FT_TEST_SAVE="1",
                          FT_TEST_PAUSE_AT=pause)
        hung = job.start(1, "replica1", FT_TEST_WAIT_JOIN=waits, FT_TEST_PAUSE_AT=pause,
                         FT_TEST_STOP_AT=f"{STOP_AT}@1", PADDLE_HSDP_COLLECTIVE_TIMEOUT="10")
        doomed = job.start(2, "replica2", FT_TEST_KILL_AT=str(KILL_AT),
                           FT_TEST_KILL_AFTER_ETCD="1")
        _wait(lambda: glob.glob(os.path.join(job.work, "dying2_rank*")), deadline, job,
              "replica 2 to reach step 4's backward")
        job.restart_coordinator(away_s=ETCD_AWAY_S)  # replica 2 dies meanwhile
        _wait(lambda: doomed.poll() is not None, deadline, job, "replica 2 to die")
        assert doomed.returncode != 0
        _wait(lambda: min(job.steps_done(0), job.steps_done(1)) >= RESTART_AFTER, deadline,
              job, f"replicas 0 and 1 to finish step {RESTART_AFTER}")
        # the two groups alive at the end save one checkpoint together (issue 62: each
        # group's two ranks send their manifests as files, the groups commit by record)
        rejoined = job.start(2, "replica2_again", FT_TEST_SAVE="1", FT_TEST_PAUSE_AT=pause)
        newcomer = job.start(3, "replica3", FT_TEST_DIE_IN_TRANSFER="3")
        # etcd loses its data while the three groups wait before step 10; they go on
        # once each leader noticed it
        _wait(lambda: len(glob.glob(os.path.join(job.work, "paused*"))) == 6, deadline, job,
              f"replicas 0-2 to wait before step {WIPE_AT}")
        job.restart_coordinator(wipe=True)
        _wait(lambda: all("etcd lost its data" in _log(job, name) for name in
                          ("replica0", "replica1", "replica2_again")), deadline, job,
              "every leader to notice that etcd lost its data")
        open(os.path.join(job.work, f"go{WIPE_AT}"), "w").close()
        for proc in (first, rejoined, newcomer):
            _wait(lambda: proc.poll() is not None, deadline, job, "replicas 0 and 2 to end")
        assert [first.returncode, rejoined.returncode] == [0, 0], job.logs()
        assert newcomer.returncode != 0
        assert glob.glob(os.path.join(job.work, "died_in_transfer_rank*")), job.logs()
        assert hung.poll() != 0, "replica 1 hung, yet its launch exited 0"
    finally:
        job.stop()
    took = time.time() - start
    # signed and checked everywhere, and no genuine value refused
    logs = job.full_logs()
    unsigned = "PADDLE_HSDP_FT_SECRET is not set"
    assert "refused a value read from etcd" not in logs and unsigned not in logs, \
        [line for line in logs.splitlines() if "refused a value" in line or unsigned in line]

    out = run_single("single_process_ft.py", job.work, str(STEPS))
    assert "FT_PARITY_OK" in out and "FT_CHECKPOINT_OK" in out, out[-2000:]
    members = json.loads(out.split("MEMBERS ", 1)[1].splitlines()[0])
    # replica 2's round is at the step after the one it arrived before (the others' vote
    # of that step calls it), which it sits out; it trains the next; replica 3 never got
    # through the handoff
    rejoined_at = next(t for t in range(KILL_AT, STEPS + 1) if 2 in members[str(t)])
    assert rejoined_at == RESTART_AFTER + 3, members
    expected = {t: [0, 1, 2] if t < KILL_AT else [0, 1] if t < rejoined_at
                else [0, 1, 2] if t < STOP_AT else [0, 2] for t in range(1, STEPS + 1)}
    assert members == {str(t): m for t, m in expected.items()}, members

    # what it cost: from the kill to replica 0's next committed step, and the rejoin
    runs = [json.load(open(p)) for p in glob.glob(os.path.join(job.work, "replica*.json"))]
    killed_at = min(float(open(p).read()) for p in glob.glob(os.path.join(job.work, "killed2_*")))
    etcd_down, etcd_back, wiped_back = (float(open(os.path.join(job.work, name)).read())
                                        for name in ("etcd_down", "etcd_back", "etcd_wiped_back"))
    assert etcd_down + 2.5 < killed_at < etcd_back - 40, (etcd_down, killed_at, etcd_back)
    leader = next(r for r in runs if r["replica"] == 0 and r["rank"] == 0)
    resumed = min(e["time"] for e in leader["history"]
                  if e["kind"] == "step" and e["step"] >= KILL_AT)
    joiner = next(r for r in runs if r["replica"] == 2 and r["rank"] == 0)
    rejoin = [e for e in joiner["history"] if e["kind"] == "sat out"][-1]
    # the others saw replica 3 die in the handoff's attempt (or the next), and went on
    failed = [e for e in leader["history"] if e["kind"] == "failed" and 3 in e["replicas"]]
    assert failed, leader["history"]
    # the two joiners were fed each by its own donor; replica 2 then from replica 0
    assert any(e.get("donors") == {"2": 0, "3": 1} for e in leader["history"]), \
        leader["history"]
    assert rejoin["sat_out"][0] == 2 and rejoin["donors"]["2"] == 0, rejoin
    # the outer all-reduces run during backward from step 2 on, as in plain HSDP; after
    # a round that changed who trains every member records the order anew (that step
    # syncs at the step), then overlaps again: the joiner too, from its second step
    buffers = leader["early_syncs"]["2"]
    assert buffers > 0 and all(leader["early_syncs"][str(t)] % buffers == 0
                               for t in range(2, STEPS + 1)), leader["early_syncs"]
    # (the joiner's first train_step holds the step it sat out, which syncs at its end,
    # and the next, which overlaps, or, where replica 3's death failed it, is redone in
    # a new round and syncs at its end: a count of the failed attempt's at most)
    assert joiner["early_syncs"][str(rejoined_at)] <= buffers, joiner["early_syncs"]
    assert joiner["early_syncs"][str(rejoined_at + 1)] == buffers, joiner["early_syncs"]
    assert leader["early_syncs"][str(rejoined_at + 1)] == buffers, leader["early_syncs"]
    stall, after, creation = _check_stall(leader, rejoin)
    stopped_at = float(open(os.path.join(job.work, "stopped1_rank1")).read())
    after_hang = min(e["time"] for e in leader["history"]
                     if e["kind"] == "step" and e["step"] >= STOP_AT)
    assert resumed > etcd_back  # the round waited for etcd: the survivors lived through
    # after etcd lost its data: step 10's first attempt failed, and the three groups met
    # at one round with their own steps (no state moved), the round after the last
    met = [e for e in leader["history"] if e["kind"] == "step" and e["step"] == WIPE_AT]
    assert met and met[0]["replicas"] == [0, 1, 2] and met[0]["receivers"] == [], met
    wiped = [e for e in leader["history"] if e["kind"] == "failed" and e["step"] == WIPE_AT - 1]
    assert wiped and met[0]["round"] == wiped[-1]["round"] + 1, (wiped, met)
    go = os.path.getmtime(os.path.join(job.work, f"go{WIPE_AT}"))
    print(f"fault tolerance: etcd away {etcd_back - etcd_down:.0f} s, replica 2 killed "
          f"{killed_at - etcd_down:.1f} s after it went; from etcd's return to the next step "
          f"{resumed - etcd_back:.1f} s; etcd wiped: every leader noticed it "
          f"{go - wiped_back:.1f} s after it was back, step {WIPE_AT} committed "
          f"{met[0]['time'] - go:.1f} s after the groups went on; from the hang "
          f"{after_hang - stopped_at:.1f} s; replica 0's step at the rejoin "
          f"{stall['seconds']:.2f} s against its median {stall['median_s']:.2f} s (round "
          f"{stall['round_s']:.2f} s, creation {creation:.2f} s, "
          f"{stall['snapshot_bytes'] / 2 ** 10:.0f} KiB handed over), the next "
          f"{after['seconds']:.2f} s; the joiner waited {rejoin['handoff_wait_s']:.3f} s "
          f"for it after its all-reduce; rejoin "
          f"set-up {rejoin['set_up_s']:.2f} s (round {rejoin['round_s']:.2f} s); scenario "
          f"{took:.0f} s")


def test_a_misconfigured_joiner_and_a_second_launch_of_a_live_id_are_refused():
    """Issue 49: a group restarted with another --nproc_per_node, and a second launch
    with the id of a running group, each took the running job down or trained alone.
    Now: the second launch of id 0 is refused at ft.init (its holder's lease moves),
    the 1-rank group is left out of the round that would take it in (its ranks per
    group differ), each stops with a message naming why on every rank, and replica 0
    trains to the end."""
    job = FaultTolerantJob(replicas=1, steps=8)
    deadline = time.time() + BOUND_S
    try:
        # replica 0 waits before step 3 until the misfit has arrived (so it runs while
        # the duplicate starts, and is in a round when the misfit arrives)
        running = job.start(0, "replica0", FT_TEST_WAIT_JOIN="1@3")
        _wait(lambda: job.steps_done(0) >= 1, deadline, job, "replica 0's first step")
        duplicate = job.start(0, "replica0_twice")
        _wait(lambda: duplicate.poll() is not None, deadline, job, "the duplicate to end")
        misfit = job.start(1, "replica1_one_rank", ranks=1)
        for proc in (running, misfit):
            _wait(lambda: proc.poll() is not None, deadline, job, "the three launches to end")
        assert running.returncode == 0, job.logs()
        assert misfit.returncode != 0 and duplicate.returncode != 0, job.logs()
        logs = {name: "\n".join(open(p, errors="replace").read() for p in sorted(
            glob.glob(os.path.join(job.work, name, "workerlog.*"))))
            for name in ("replica0", "replica1_one_rank", "replica0_twice")}
        assert logs["replica0_twice"].count("replica id 0 is already running") == 2, \
            logs["replica0_twice"][-3000:]  # on both of its ranks
        refusal = "replica 1 cannot join the running replica groups: ranks_per_group 1 " \
                  "where the running groups have 2"
        assert refusal in logs["replica1_one_rank"], logs["replica1_one_rank"][-3000:]
        # issue 63, item 3: the refusal names every present group's size and the allowed one
        sizes = ("PADDLE_HSDP_FT group sizes present: 2 ranks: replica 0; 1 rank: replica 1; "
                 "allowed: 2, the running groups' size")
        assert sizes in logs["replica1_one_rank"], logs["replica1_one_rank"][-3000:]
        assert sizes in logs["replica0"], logs["replica0"][-3000:]
        assert refusal in logs["replica0"], logs["replica0"][-3000:]  # the closer's log
        # without the job's secret the leader says once that nothing is authenticated
        # (issue 62, item 7; the kill scenario runs with it and asserts no such line)
        assert logs["replica0"].count("PADDLE_HSDP_FT_SECRET is not set") == 1, \
            logs["replica0"][-3000:]
    finally:
        job.stop()
    result = _result(job, 0)
    assert len(result["losses"]) == 8 and all(e["replicas"] == [0] for e in result["history"]
                                              if e["kind"] == "step"), result["history"]


def test_the_outer_all_reduce_spans_groups_of_two_sizes_exactly(hsdp_2x2_log):
    """Issue 63, item 3: workers/worker_outer_degrees.py, in the shared 2 x 2 launch: a
    group of 2 ranks and two of 1 rank all-reduce over 2 outer groups (ft/degrees.py),
    the 1-rank groups in both; every rank holds exactly the mean's rows (float64)."""
    # (rank 0's log; a rank whose rows differ fails the launch, and so this test)
    assert "OUTER_DEGREES_OK rank 0 (replica 0 rank 0 of 2, outer groups [0])" in \
        hsdp_2x2_log, hsdp_2x2_log[-3000:]


REBUILD_STEPS = 24


def test_twenty_rebuilds_leave_no_sockets_behind_and_train_as_one_process():
    """Issue 50, item 4: every round that rebuilt the outer groups kept the old process
    groups' rendezvous stores for the whole job: 3 sockets a rebuild here (measured).
    Two groups of one rank; every step's first attempt fails on replica 0, so each step
    is a round that rebuilds the groups (23 rebuilds): what a rank keeps is at most
    gloo's pair socket per peer of each group (Paddle holds every process group it
    created until exit: ft/groups.py, LiveOuterGroup._free), and the training equals
    one process's."""
    job = FaultTolerantJob(replicas=2, ranks=1, steps=REBUILD_STEPS)
    deadline = time.time() + BOUND_S
    try:
        procs = [job.start(0, "replica0", FT_TEST_FAIL_EACH_STEP="1"), job.start(1, "replica1")]
        for proc in procs:
            _wait(lambda: proc.poll() is not None, deadline, job, "both groups to end")
        assert [p.returncode for p in procs] == [0, 0], job.logs()
    finally:
        job.stop()
    out = run_single("single_process_ft.py", job.work, str(REBUILD_STEPS), "1")
    assert "FT_PARITY_OK" in out, out[-2000:]
    assert set(map(tuple, _members(out).values())) == {(0, 1)}
    for replica in (0, 1):
        result = _result(job, replica)
        rebuilds = [e for e in result["history"] if e.get("rebuild")]
        assert len(rebuilds) >= 20, len(rebuilds)
        sockets = result["sockets"]
        print(f"replica {replica}: {len(rebuilds)} rebuilds, {result['groups_freed']} retired "
              f"groups' stores destroyed; open sockets after steps 3, 12, {REBUILD_STEPS}: "
              f"{sockets[2]}, {sockets[11]}, {sockets[-1]}")
        # one pair socket per rebuild (one peer), 2 for an HTTP connection that may come
        assert sockets[-1] - sockets[2] <= REBUILD_STEPS - 3 + 2, sockets
        assert result["groups_freed"] >= len(rebuilds) - 3, result["groups_freed"]


def _result(job: FaultTolerantJob, replica: int) -> dict:
    """Rank 0's results of ``replica`` (its one start that wrote them)."""
    runs = [json.load(open(p)) for p in
            glob.glob(os.path.join(job.work, f"replica{replica}_rank0_*.json"))]
    assert len(runs) == 1, f"replica {replica}: {len(runs)} result files"
    return runs[0]


def _history(job: FaultTolerantJob, replica: int) -> list:
    return _result(job, replica)["history"]


def _members(out: str) -> dict:
    return {int(t): m for t, m in json.loads(out.split("MEMBERS ", 1)[1].splitlines()[0])
            .items()}


# A death in a rejoin round's set-up (tools/sweep_ft_deaths.py sweeps who and where)
SETUP_STEPS, SETUP_KILL_AT, SETUP_RESTART_AFTER, SETUP_JOIN_AT = 10, 3, 5, 7
VICTIMS = {"donor": 0, "member": 1, "joiner": 2, "first-donor": 0}


def _check_stall(leader: dict, rejoin: dict) -> tuple[dict, dict, float]:
    """Issue 63 item 4: replica 0, a healthy group (the donor of the joiner's rank 0),
    at the rejoin's round: nothing moved in its set-up but the copy it hands over
    beside the step, to the joiner that sat the step out. Returns that step, the next
    and the round's group creation (the slower of its and the joiner's: the step's
    first all-reduce waits for both), which the test prints: wall clock is
    measured (`tools/demo_ft.sh --compare`, docs/fault-tolerance.md), not asserted (a
    freshly started joiner's first step, on a loaded machine, once took 1.8 s more)."""
    stall = _stall(leader["history"], rejoin["round"])
    after = next(e for e in leader["history"]
                 if e["kind"] == "step" and e["step"] == stall["step"] + 1)
    assert "state_bytes" not in stall and stall["snapshot_bytes"] == rejoin["state_bytes"] \
        > 0 and 2 in stall["sat_out"], (stall, rejoin)
    return stall, after, max(stall["creation_s"], rejoin["creation_s"])


def _death_env(point: str, armed_at: int) -> dict:
    where, _, value = point.partition(":")
    if where == "connect":
        return {"FT_TEST_DIE_IN_CONNECT": f"{value}@{armed_at}"}
    if where == "transfer":
        return {"FT_TEST_DIE_IN_TRANSFER": f"{value}@{armed_at}"}
    raise ValueError(f"point {point!r} is not connect:<seconds> or transfer:<n>")


def run_with_a_death_in_set_up(victim: str, point: str, bound_s: float = 240,
                               optimizer: str = "adamw") -> dict:
    """Three replica groups of 2 ranks (HSDP). ``victim`` "first-donor": replica 0 dies
    at ``point`` of the first round's set-up (the initial copy of its state to the
    others). Otherwise replica 2 dies at step 3 and is started again after step 5; the
    others wait for it before step 7, so the round after step 7 takes it in, with
    replica 0 as the donor, and ``victim`` (the donor, the other member, or the
    joiner) dies at ``point`` of that round's set-up: ``connect:<d>`` d s into the
    creation of the outer groups, ``transfer:<n>`` at the n-th state tensor. Returns
    the exit codes, whether the survivors ended well and equal the reference, the
    members per step, and the slowest attempts. ``optimizer``: workers/ft_common.py's
    (``muon``: each matrix owned by one rank of its group, its momentum moved with it)."""
    job = FaultTolerantJob(replicas=3, steps=SETUP_STEPS)
    job.env["FT_TEST_OPTIMIZER"] = optimizer
    dead = VICTIMS[victim]
    env = {r: {} for r in (0, 1, 2)}
    if victim == "first-donor":
        env[0] = _death_env(point, 0)
    else:
        env[0] = env[1] = {"FT_TEST_WAIT_JOIN": f"2@{SETUP_JOIN_AT}"}
        if victim in ("donor", "member"):
            env[dead] = dict(env[dead], **_death_env(point, SETUP_JOIN_AT - 1))
    started, outcome = time.time(), {"victim": victim, "point": point}
    deadline = started + bound_s
    try:
        procs = {r: job.start(r, f"replica{r}", **env[r]) for r in (0, 1)}
        if victim == "first-donor":
            procs[2] = job.start(2, "replica2")
        else:
            doomed = job.start(2, "replica2", FT_TEST_KILL_AT=str(SETUP_KILL_AT))
            _wait(lambda: doomed.poll() is not None and min(job.steps_done(0), job.steps_done(
                1)) >= SETUP_RESTART_AFTER, deadline, job, "replica 2's death, then step 5")
            procs[2] = job.start(2, "replica2_again",
                                 **(_death_env(point, 0) if victim == "joiner" else {}))
        for proc in procs.values():
            _wait(lambda: proc.poll() is not None, deadline, job, "every group to end")
        codes = {r: p.poll() for r, p in procs.items()}
        outcome.update(exit_codes=codes, victim_died=codes[dead] != 0,
                       survivors_ok=all(c == 0 for r, c in codes.items() if r != dead))
    except AssertionError as e:  # timed out: a result too
        outcome.update(survivors_ok=False, error=str(e)[:300])
    finally:
        job.stop()
    if not outcome["survivors_ok"]:
        outcome["logs"] = job.logs()[-4000:]
    outcome["slowest"] = _slowest_attempts(job.work)
    if outcome["survivors_ok"]:
        out = run_single("single_process_ft.py", job.work, str(SETUP_STEPS))
        outcome["parity_ok"] = f"FT_PARITY_OK ({optimizer})" in out
        outcome["members"] = _members(out)
    outcome["seconds"] = round(time.time() - started, 1)
    return outcome


def _slowest_attempts(work: str, top: int = 3) -> list:
    """The longest attempts the surviving ranks recorded: (replica, kind, step,
    seconds, error)."""
    entries = []
    for path in glob.glob(os.path.join(work, "replica*_rank*.json")):
        with open(path) as f:
            run = json.load(f)
        entries += [(run["replica"], e["kind"], e["step"], round(e["seconds"], 1),
                     e.get("error", "")[:160]) for e in run["history"]]
    return sorted(entries, key=lambda e: -e[3])[:top]


def test_a_donor_that_dies_while_a_rejoin_rounds_groups_are_created_fails_that_round_only():
    """Issue 49: a donor killed while the round that takes a joiner in creates its
    outer groups crashed healthy groups (a ValueError from ProcessGroupGloo.create the
    set-up did not catch), and one that died before publishing its group store's
    address held every member for the round timeout (120 s). Now that round fails in
    about a heartbeat timeout (a watcher announces the death; 5 s here), or, where the
    death is heard before the set-up begins, the round forms without the donor; either
    way no attempt nears the round timeout and the next goes on without the donor: replica 1 gives the joiner its state. The groups train
    with Muon, each matrix owned by one rank (issue 53): the joiner's owners take the
    momentum of the donor's, and the run equals one process."""
    run = run_with_a_death_in_set_up("donor", "connect:0.05", optimizer="muon")
    assert run["survivors_ok"] and run["victim_died"], run
    assert run["parity_ok"], run
    members = run["members"]
    # replica 2 sits its round's first step out (replica 1 trains it alone), then trains
    back = min(t for t in members if t >= SETUP_KILL_AT and 2 in members[t])
    assert back > SETUP_JOIN_AT and all(
        members[t] == ([0, 1, 2] if t < SETUP_KILL_AT else [0, 1] if t < back - 1 else
                       [1] if t == back - 1 else [1, 2]) for t in members), members
    # no attempt waited anywhere near the round timeout (120 s): the set-up the donor
    # died in failed within about a heartbeat timeout, or (its death heard before the
    # set-up began, now that a round's waits are its leader's watches) the round formed
    # without it at once
    slowest = run["slowest"][0]
    assert slowest[3] < 60, run["slowest"]
    print(f"a donor's death in set-up: slowest attempt {slowest[3]:.1f} s ({slowest[1]}), "
          f"run {run['seconds']} s")


HFSDP_STEPS = 14
PENALTY = "0.01"


def test_hfsdp_with_redundancy_survives_a_dead_donor_and_rejoins_each_piece():
    """[module docstring, HFSDP] replicas 0-3, pieces {0, 2} and {1, 3}."""
    job = FaultTolerantJob(replicas=4, ranks=1, steps=HFSDP_STEPS)
    # a penalty on model.parameters(): a term each group computes on its own piece
    # only, so not while a piece has no group holding it as its own (2 groups left)
    job.env.update(FT_TEST_OPTIM="1", PADDLE_HSDP_FT_REDUNDANCY="2", FT_TEST_PENALTY=PENALTY,
                   FT_TEST_PENALTY_MIN_GROUPS="3", FT_TEST_SAVE="1", **SECRET)
    deadline = time.time() + BOUND_S
    try:
        waits = "3@6,0@10"  # replica 3 is back before step 6, replica 0 before step 10
        donor = job.start(0, "replica0", FT_TEST_WAIT_JOIN=waits, FT_TEST_DIE_IN_TRANSFER="3@5")
        survivors = [job.start(1, "replica1", FT_TEST_WAIT_JOIN=waits)]
        co_holder = job.start(2, "replica2", FT_TEST_WAIT_JOIN=waits, FT_TEST_KILL_AT="8")
        doomed = job.start(3, "replica3", FT_TEST_KILL_AT="3")
        _wait(lambda: doomed.poll() is not None, deadline, job, "replica 3 to die")
        _wait(lambda: min(job.steps_done(r) for r in (0, 1, 2)) >= 5, deadline, job,
              "replicas 0-2 to finish step 5")
        survivors.append(job.start(3, "replica3_again", FT_TEST_WAIT_JOIN="0@10"))
        _wait(lambda: donor.poll() is not None, deadline, job, "replica 0 to die as donor")
        _wait(lambda: co_holder.poll() is not None, deadline, job, "replica 2 to die")
        _wait(lambda: min(job.steps_done(r) for r in (1, 3)) >= 9, deadline, job,
              "replicas 1 and 3 to finish step 9")
        job.restart_coordinator()
        survivors.append(job.start(0, "replica0_again"))
        for proc in survivors:
            _wait(lambda: proc.poll() is not None, deadline, job, "replicas to end")
        assert [p.returncode for p in survivors] == [0, 0, 0], job.logs()
        assert donor.returncode != 0 and doomed.returncode != 0 and co_holder.returncode != 0
        assert glob.glob(os.path.join(job.work, "died_in_transfer_rank0")), job.logs()
    finally:
        job.stop()

    out = run_single("single_process_ft.py", job.work, str(HFSDP_STEPS), "1", PENALTY, "3")
    assert "FT_PARITY_OK" in out and "FT_CHECKPOINT_OK" in out, out[-2000:]
    expected = {t: [0, 1, 2, 3] if t < 3 else [0, 1, 2] if t < 7 else [1, 2, 3] if t < 8
                else [1, 3] if t < 11 else [0, 1, 3] for t in range(1, HFSDP_STEPS + 1)}
    assert _members(out) == expected, _members(out)
    _check_re_cut(job)
    # who sent what: replica 0 rejoined with the model and its piece (0) from replica 1
    # (piece 0's holders were 1 and 3, both besides their own); 3's extra holding went
    rejoin = next(e for e in _history(job, 0) if e["kind"] == "step" and "receivers" in e)
    assert rejoin["receivers"] == [0] and rejoin["donor"] == 1 and \
        rejoin["piece_donors"] == {"0": 1, "1": 1} and \
        rejoin["piece_copies"] == [[0, 1, 0]] and \
        rejoin["piece_holders"] == {"0": [0, 1], "1": [1, 3]}, rejoin
    # point to point: replica 3, neither donor nor receiver, moved nothing and went
    # straight to its step (what it waited for is the donors' transfer)
    assert rejoin["point_to_point"] and rejoin["donors"] == {"0": 1}, rejoin
    stall = _stall(_history(job, 3), rejoin["round"])
    assert stall["state_bytes"] == 0, stall
    # the restarted coordinator lost nothing: the rejoin's round (formed after the
    # restart) follows the rounds before it, as every member recorded them
    rounds = [e["round"] for e in _history(job, 1)]
    assert rounds == sorted(rounds) and rejoin["round"] == rounds[-1], rounds
    died = float(open(os.path.join(job.work, "died_in_transfer_rank0")).read())
    resumed = min(e["time"] for e in _history(job, 1) if e["kind"] == "step" and e["time"] > died)
    print(f"hfsdp fault tolerance: from the donor's death to the next step {resumed - died:.1f} s;"
          f" rejoin set-up {rejoin['set_up_s']:.2f} s (round {rejoin['round_s']:.2f} s); "
          f"a bystander's step at the rejoin {stall['seconds']:.2f} s (set-up "
          f"{stall['set_up_s']:.2f} s) against {stall['median_s']:.2f} s")


def _check_re_cut(job: FaultTolerantJob) -> None:
    """[module docstring, HFSDP] after each death, the next round's holders: every piece
    with two live holders again (as replica 1, alive throughout, recorded each round)."""
    rounds = {e["round"]: e for e in _history(job, 1) if "piece_holders" in e}
    for entry in rounds.values():
        assert all(len(h) == 2 for h in entry["piece_holders"].values()), entry
    copies = [c for e in sorted(rounds.values(), key=lambda e: e["round"])
              for c in e["piece_copies"]]
    # 3 died: 0 took piece 1 from 1; 0 died: 3 took its own piece from 1, 1 took piece
    # 0 from 2; 2 died: 3 took piece 0 from 1; 0 rejoined: its piece from 1
    for copy in ([1, 1, 0], [1, 1, 3], [0, 2, 1], [0, 1, 3], [0, 1, 0]):
        assert copy in copies, (copy, copies)


def _stall(history: list, round_number: int) -> dict:
    """A group's step at round ``round_number`` beside the median of its steps that
    formed no round: what a rejoin cost a group that neither sent nor took state."""
    at = next(e for e in history if e["kind"] == "step" and e["round"] == round_number)
    plain = sorted(e["seconds"] for e in history if e["kind"] == "step" and "round_s" not in e)
    return dict(at, median_s=plain[len(plain) // 2])


# The whole job stops and resumes from its joint checkpoint (issue 63, item 1)
RESUME_SAVE_AT, RESUME_STEPS = 6, 12


def _bytes_in_files(checkpoint: str) -> int:
    """The tensor bytes a checkpoint's files hold (every listed piece), from its
    metadata (the test's process imports no Paddle)."""
    with open(os.path.join(checkpoint, "metadata.json")) as f:
        tensors = json.load(f)["tensors"]
    itemsize = {"float64": 8, "float32": 4, "int64": 8, "int32": 4}
    total = 0
    for entry in tensors.values():
        assert not entry.get("rules"), "a ruled tensor: count its rules' rows too"
        for piece in entry["pieces"]:
            if "file" in piece:
                count = 1
                for d in piece["shape"]:
                    count *= d
                total += count * itemsize[entry["dtype"]]
    return total


def stop_and_resume(groups: int, ranks: int, resumed_groups: int, **env) -> dict:
    """``groups`` replica groups of ``ranks`` ranks train to step RESUME_SAVE_AT, save
    one checkpoint together, and every one of them dies (SIGKILL) in the next step's
    backward: the whole job stopped. Then ``resumed_groups`` groups start again
    (another job name on the same coordinator: the stopped job's rounds are its own),
    each calls replica.load_checkpoint, and they train to RESUME_STEPS. Returns the
    reference's output, each resumed rank's results, and the checkpoint's tensor bytes."""
    job = FaultTolerantJob(replicas=groups, ranks=ranks, steps=RESUME_STEPS)
    job.env.update(env)
    deadline = time.time() + BOUND_S
    try:
        stopped = [job.start(r, f"replica{r}", FT_TEST_SAVE_AT=str(RESUME_SAVE_AT),
                             FT_TEST_KILL_AT=str(RESUME_SAVE_AT + 1)) for r in range(groups)]
        for proc in stopped:
            _wait(lambda: proc.poll() is not None, deadline, job, "every group to die")
        assert all(p.returncode != 0 for p in stopped), job.logs()
        checkpoint = os.path.join(job.work, "ckpt")
        assert os.path.isfile(os.path.join(checkpoint, "metadata.json")), job.logs()
        resumed = [job.start(r, f"resumed{r}", PADDLE_HSDP_FT_JOB="resumed",
                             PADDLE_HSDP_FT_START_REPLICAS=str(resumed_groups),
                             FT_TEST_RESUME="1") for r in range(resumed_groups)]
        for proc in resumed:
            _wait(lambda: proc.poll() is not None, deadline, job, "the resumed groups to end")
        assert [p.returncode for p in resumed] == [0] * resumed_groups, job.logs()
    finally:
        job.stop()
    out = run_single("single_process_ft.py", job.work, str(RESUME_STEPS), str(ranks),
                     env.get("FT_TEST_PENALTY", "0"))
    assert "FT_PARITY_OK" in out and "FT_CHECKPOINT_OK" in out, out[-2000:]
    runs = [json.load(open(p)) for p in glob.glob(os.path.join(job.work, "replica*.json"))]
    return {"out": out, "saved": [r for r in runs if r["params_step"] == RESUME_SAVE_AT],
            "resumed": [r for r in runs if r["rng_resumed"] is not None],
            "bytes": _bytes_in_files(checkpoint)}


def _check_resume(run: dict, groups: int, resumed_groups: int, ranks: int) -> float:
    """What every resume must show: the members per step, nothing moved between groups
    at the resume, the RNG each rank resumed with the saving group's (replica 0's)
    rank's, and the bytes the job read about the checkpoint's size. Returns the ratio."""
    members = _members(run["out"])
    assert members == {t: list(range(groups if t <= RESUME_SAVE_AT else resumed_groups))
                       for t in range(1, RESUME_STEPS + 1)}, members
    resumed = run["resumed"]
    assert len(resumed) == resumed_groups * ranks, [(r["replica"], r["rank"]) for r in resumed]
    saved_rng = {r["rank"]: r["rng"] for r in run["saved"] if r["replica"] == 0}
    read = 0
    for r in resumed:
        assert r["rng_resumed"] == saved_rng[r["rank"]], (r["replica"], r["rank"])
        first = r["history"][0]
        # every group arrived with the checkpoint's step: the first round moved no state
        assert first["step"] == RESUME_SAVE_AT + 1 and first["receivers"] == [] and \
            first.get("state_bytes", 0) == 0, first
        read += first["resume_bytes"]
    ratio = read / run["bytes"]
    assert ratio <= 1.05, (read, run["bytes"])
    return ratio


def test_a_stopped_hsdp_job_resumes_from_its_joint_checkpoint_as_if_uninterrupted():
    """Issue 63, item 1: three HSDP groups of two ranks save at step 6 and all die in
    step 7; started again, each loads the joint checkpoint (the model, the optimizer,
    the scheduler, the RNG, the step and the loader's position) and they train to step
    12: every loss and parameter equals one process trained on the live groups'
    batches throughout, and the groups read the checkpoint once between them. Issue 63
    item 3: every group lays its buffers out as a 4-rank group would
    (PADDLE_HSDP_FT_MAX_GROUP_SIZE=4: each rank holds 2 of its segments), in training,
    the joint save and the resume (worker_ft.py checks every buffer's layout)."""
    started = time.time()
    run = stop_and_resume(3, 2, 3, PADDLE_HSDP_FT_MAX_GROUP_SIZE="4", **SECRET)
    ratio = _check_resume(run, 3, 3, 2)
    assert {r["layout_degree"] for r in run["saved"] + run["resumed"]} == {4}
    print(f"resume (HSDP, 3 groups of 2 ranks): the job read {ratio:.3f}x the checkpoint's "
          f"{run['bytes']} tensor bytes; scenario {time.time() - started:.0f} s")


def test_a_stopped_hfsdp_job_resumes_into_fewer_groups():
    """Issue 63, item 1: four HFSDP groups with redundancy 2 (the optimizer state in two
    pieces, each held twice) save at step 6 and all die; the job resumes into two
    groups (one piece: another outer sharding), which read the checkpoint's boxes by
    their own layout, once between them, and train as one process would."""
    started = time.time()
    run = stop_and_resume(4, 1, 2, FT_TEST_OPTIM="1", PADDLE_HSDP_FT_REDUNDANCY="2",
                          FT_TEST_PENALTY=PENALTY)
    ratio = _check_resume(run, 4, 2, 1)
    print(f"resume (HFSDP, 4 groups into 2): the job read {ratio:.3f}x the checkpoint's "
          f"{run['bytes']} tensor bytes; scenario {time.time() - started:.0f} s")


# DiLoCo on replica groups: syncs owed after steps 3, 6, 9 (run by steps 4, 7, 10)
DILOCO_EVERY, DILOCO_STEPS, DILOCO_KILL_AT, DILOCO_JOIN_AT = 3, 11, 7, 8


def test_diloco_groups_lose_nothing_synced_when_one_dies_mid_interval_and_rejoins():
    """Issue 66, item 3: three groups of one rank sync every 3 steps (DiLoCo, the outer
    state whole on every group). Replica 2 dies in step 7's backward, after that
    attempt ran the sync step 6 owed over the three: the others' attempt fails, the
    sync is undone and run again over the two (their mean); replica 2 is started again
    and joins at step 9, mid-interval: it takes the last synced model (the anchor), the
    outer momentum and position and a donor's AdamW state, trains step 9, and the sync
    at step 10 is the three groups' mean. Every rank's losses and every group's final
    params equal one process that trains a model per live group
    (workers/reference_ft_diloco.py). A launch of its own: every other scenario's
    reference is one model over the live groups' batches (plain HSDP); its groups
    have one rank, so it is the cheapest of them."""
    job = FaultTolerantJob(replicas=3, ranks=1, steps=DILOCO_STEPS)
    job.env["FT_TEST_DILOCO"] = str(DILOCO_EVERY)
    deadline = time.time() + 180
    started = time.time()
    try:
        wait = {"FT_TEST_WAIT_JOIN": f"2@{DILOCO_JOIN_AT}"}
        procs = [job.start(r, f"replica{r}", **wait) for r in (0, 1)]
        doomed = job.start(2, "replica2", FT_TEST_KILL_AT=str(DILOCO_KILL_AT))
        _wait(lambda: doomed.poll() is not None and min(
            job.steps_done(0), job.steps_done(1)) >= DILOCO_KILL_AT, deadline, job,
            f"replica 2's death, then step {DILOCO_KILL_AT}")
        procs.append(job.start(2, "replica2_again"))
        for proc in procs:
            _wait(lambda: proc.poll() is not None, deadline, job, "every group to end")
        assert [p.returncode for p in procs] == [0, 0, 0], job.logs()
    finally:
        job.stop()
    out = run_single("single_process_ft.py", job.work, str(DILOCO_STEPS), "1")
    assert "FT_PARITY_OK (diloco every 3)" in out, out[-2000:]
    members = _members(out)
    assert members == {t: [0, 1, 2] if t < DILOCO_KILL_AT or t > DILOCO_JOIN_AT else [0, 1]
                       for t in range(1, DILOCO_STEPS + 1)}, members
    # the step-7 attempt that the death failed had run the sync over three groups
    failed = [e for e in _history(job, 0) if e["kind"] == "failed"
              and e["step"] == DILOCO_KILL_AT - 1]
    assert failed and failed[0]["replicas"] == [0, 1, 2], _history(job, 0)
    worst = [json.loads(line.split(" ", 1)[1])["measured"] for line in out.splitlines()
             if line.startswith("PARITY_CHECK") and "ft diloco" in line]
    apart = [line for line in out.splitlines() if line.startswith("FT_DILOCO_APART")]
    assert len(apart) == 2, out[-2000:]  # the rules it must not follow are far from it
    print(f"DiLoCo on replica groups: losses, params {worst}; {apart}; scenario "
          f"{time.time() - started:.0f} s")
