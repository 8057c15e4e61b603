"""The watchdog's reach on NCCL (issue 24 item 2), on CPU: there ``wait()`` returns at
once and a dead peer blocks the next host read of the device instead. A fake group whose
collective "completes" at once, then a host read that never returns, inside
paddle_hsdp's host_sync: the process exits with the watchdog's status within the bound,
naming the read and the collective it was waiting for."""

import os
import subprocess
import sys
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
    import time
    import paddle
    import paddle.distributed as dist
    import paddle_hsdp
    from paddle_hsdp.comm import collectives as comm, watchdog

    class Task:  # an NCCL task: wait() orders streams and returns at once
        def wait(self):
            return True

    class Group:  # two ranks, the other one dead
        nranks, ranks, id, rank, name = 2, [0, 1], 77, 0, "outer"

    dist.stream.all_reduce = lambda *a, **k: Task()
    handle = comm.all_reduce(paddle.ones([4]), Group(), async_op=True,
                             what="unit 3 (blocks.1: 2 params)")
    handle.wait()
    print("WAIT_RETURNED", flush=True)
    with watchdog.host_sync("the step boundary's read of the all-gather tag flags"):
        time.sleep(120)  # the read that waits for the dead peer's collective
    print("UNBOUNDED", flush=True)
""")


def test_a_host_read_after_an_async_collective_is_bounded_and_names_it():
    env = dict(os.environ, PYTHONPATH=ROOT, PADDLE_HSDP_COLLECTIVE_TIMEOUT="1")
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                         text=True, timeout=120)
    took = time.monotonic() - start
    assert run.returncode == 124, run.stdout + run.stderr[-2000:]
    assert "WAIT_RETURNED" in run.stdout and "UNBOUNDED" not in run.stdout
    assert "the step boundary's read of the all-gather tag flags" in run.stderr, run.stderr
    assert "all_reduce on group" in run.stderr and "unit 3 (blocks.1" in run.stderr, run.stderr
    assert took < 60, took  # import (~5 s) + the 1 s bound + the watchdog's tick
