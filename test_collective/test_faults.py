"""A rank that dies or hangs mid-step ends the job within a bound, with a message that
names the operation and the group (workers/worker_rank_death.py), on one host; the
two-host variant is in test_two_hosts.py."""

import glob
import os
import subprocess
import sys
import tempfile
import time

import pytest

from launcher import HERE, ROOT, part_of

BOUND_S = 90  # launch (~10 s here) + detection + the launcher's teardown


def launch_with_fault(mode: str, env_extra: dict, outer: int) -> tuple[int, float, dict]:
    log_dir = tempfile.mkdtemp(prefix=f"hsdp_fault_{mode}_")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.path.join(HERE, "workers"),
               GLOG_minloglevel="2", **env_extra)
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "4",
           "--log_dir", log_dir, os.path.join(HERE, "workers", "worker_rank_death.py"),
           "3", mode, str(outer)]
    start = time.time()
    proc = subprocess.run(cmd, env=env, cwd=log_dir, capture_output=True, text=True,
                          timeout=BOUND_S + 60)
    took = time.time() - start
    logs = {os.path.basename(p): open(p, errors="replace").read()
            for p in glob.glob(os.path.join(log_dir, "workerlog.*"))}
    return proc.returncode, took, logs


# fleet's 1 x 4 and 4 x 1 layouts (outer 1 and 4) are built here, their groups checked
# by init_fleet before the fault; their training parity runs as explicit meshes in the
# shared 2 x 2 launch (test_engine_parity)
@pytest.mark.parametrize("mode,outer", [("kill", 1), ("hang", 4)])
def test_a_failed_rank_ends_the_job_with_a_message(mode, outer):
    # hang: the watchdog bound is 5 s here (default 300 s)
    rc, took, logs = launch_with_fault(mode, {"PADDLE_HSDP_COLLECTIVE_TIMEOUT": "5"}, outer)
    assert rc != 0 and took < BOUND_S, (rc, took)
    assert "FAULT" in logs.get("workerlog.3", ""), logs.get("workerlog.3", "")[-2000:]
    survivors = [logs.get(f"workerlog.{r}", "") for r in range(3)]
    named = [t for t in survivors if ("on group '" in t and "ranks [" in t
                                      and ("failed" in t or "has not finished" in t))]
    assert named, "\n---\n".join(t[-1500:] for t in survivors)
    print(f"{mode}: job ended in {took:.1f} s (rc {rc}); {len(named)} survivor(s) named "
          "the operation and group")


def test_fingerprint_mode_catches_mismatched_collectives(hsdp_2x2_log):
    """workers/worker_fingerprint.py, in the shared 2 x 2 launch (conftest.py)."""
    log = hsdp_2x2_log
    assert "CAUGHT_UNITS rank 0" in log and "CAUGHT_ALL_REDUCE rank 0" in log, log[-3000:]
    assert "FINGERPRINT_OK" in log, log[-3000:]


def test_a_collective_call_on_one_rank_is_named_within_the_bound(hsdp_2x2_log):
    """workers/worker_one_rank_call.py, in the shared 2 x 2 launch: state_dict(),
    full_state_dict and save_checkpoint called on one rank raise CollectiveMismatchError
    there naming the call, after the bound; then the same calls on every rank work."""
    log = hsdp_2x2_log
    for name in ("state_dict() of a sharded", "full_state_dict(model)"):
        assert f"ONE_RANK_CALL_NAMED {name} rank 0" in log, log[-3000:]
    assert "ONE_RANK_CALLS_OK" in log, log[-3000:]


def test_the_environment_switches_fingerprint_mode_on_at_import():
    """PADDLE_HSDP_CHECK_COLLECTIVES=1 turns the check on for a whole run (the worker
    above switches it with check_collectives; this is the other way in)."""
    code = ("import paddle_hsdp; from paddle_hsdp.comm import fingerprint; "
            "print('ON' if fingerprint.enabled() else 'OFF')")
    results = {}
    for value in ("1", "0"):
        env = dict(os.environ, PYTHONPATH=ROOT, PADDLE_HSDP_CHECK_COLLECTIVES=value)
        results[value] = subprocess.run([sys.executable, "-c", code], env=env,
                                        capture_output=True, text=True).stdout.strip()
    assert results == {"1": "ON", "0": "OFF"}, results


def test_resume_after_a_crash_is_bit_exact(crashed_save, launch_4_log):
    """workers/worker_resume_after_fault.py: a launch that loses rank 3 in the middle of
    a save fails, the survivors' error naming the save (conftest.py: crashed_save); a
    new launch (the second 4-rank launch, conftest.py: launch_4_log, its own fleet.init
    of 2 x 2 there) resumes from the last complete checkpoint and reproduces the
    uninterrupted run bit for bit (losses of three separate runs, the crashed one in
    another process, and every parameter), and its next save sweeps the killed save's
    temporary directory."""
    work, rc, logs = crashed_save
    assert rc != 0
    assert "CRASH rank 3 in the save" in logs.get("workerlog.3", ""), logs.get("workerlog.3")
    survivors = [logs.get(f"workerlog.{r}", "") for r in range(3)]
    assert any("SAVE_FAILED_NAMED" in text for text in survivors), survivors[0][-3000:]
    log = part_of(launch_4_log, "worker_resume_after_fault.py")
    assert "RESUMED_BIT_EXACT" in log and "SWEPT_THE_KILLED_SAVE" in log, log[-3000:]
