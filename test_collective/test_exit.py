"""Workers exit cleanly: the gloo store servers paddle_hsdp starts are stopped (their
threads joined) while the interpreter is alive, so a peer closing its connection while
this process is in exit() cannot abort it (the SIGABRT/SIGSEGV after WORKER_OK seen
about once in 30 launches before). The mechanism is checked directly, and two short
launches without a final barrier check the exit statuses; every other launch of this
tier ends with a barrier and checks its exit status too (tools/repeat_launch.py runs
many more, for the 1-in-30 kind of failure a few launches cannot show)."""

from launcher import launch


def test_stop_servers_joins_their_threads_and_the_launch_exits_zero():
    launch(4, "worker_exit.py", "check", timeout=300)


def test_short_launch_without_a_final_barrier_exits_zero():
    launch(4, "worker_exit.py", "no_barrier", timeout=300)
