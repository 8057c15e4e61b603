"""Workers exit cleanly: the gloo store servers paddle_hsdp starts are stopped (their
threads joined) while the interpreter is alive, so a peer closing its connection while
this process is in exit() cannot abort it (the SIGABRT/SIGSEGV after WORKER_OK seen
about once in 30 launches before). The mechanism is checked directly, and two launches
that end without a final barrier check the exit statuses (both 4-rank run_many.py
launches end with worker_exit.py); every other launch of this tier ends with a barrier
and checks its exit status too (tools/repeat_launch.py runs many more, for the 1-in-30
kind of failure a few launches cannot show)."""

from launcher import worker_sections


def test_stop_servers_joins_their_threads_and_the_launch_exits_zero(launch_4_log):
    """worker_exit.py's check mode ends the second 4-rank launch (conftest.py): it ran
    last, and the launch exited 0 with every rank's WORKER_OK, or the fixture failed."""
    last, log = worker_sections(launch_4_log)[-1]
    assert last == "worker_exit.py" and log.rstrip().endswith("WORKER_OK"), log[-2000:]


def test_a_launch_without_a_final_barrier_exits_zero(hsdp_2x2_log):
    """The shared 2 x 2 launch (conftest.py) ends with worker_exit.py's no_barrier mode:
    it exited 0 with every rank's WORKER_OK, or the fixture failed."""
    last, log = worker_sections(hsdp_2x2_log)[-1]
    assert last == "worker_exit.py" and log.rstrip().endswith("WORKER_OK"), log[-2000:]
