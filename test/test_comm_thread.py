"""A gloo collective issued ``on_thread`` runs on paddle_hsdp's communication thread (issue 21 item 4).

gloo runs a collective in the calling thread until it is done and releases the GIL
while it waits; on a thread of its own an outer all-reduce overlaps the main thread's
work. What must hold, checked here with a fake group whose backend call is slow: the
caller is not blocked, the call runs on another thread, the group's calls keep their
issue order (a main-thread call on that group waits for the thread's queue), a
backend error surfaces at ``wait()`` as a CollectiveError naming the op, and the
handle keeps its tensor until then.
"""

import threading
import time

import paddle
import pytest

from paddle_hsdp.comm import collectives as comm


class Group:
    nranks, ranks, id, rank = 2, [0, 2], 9101, 0


@pytest.fixture
def slow_backend(monkeypatch):
    calls = []

    def all_reduce(tensor, op=None, group=None, sync_op=True):
        calls.append(("all_reduce", threading.current_thread().name, time.monotonic()))
        time.sleep(0.3)  # a peer that is late, or a slow link
        if getattr(tensor, "_fail", False):
            raise RuntimeError("Connection reset by peer")
        tensor.scale_(2.0)  # what a sum over two equal ranks gives

    def broadcast(tensor, src=None, group=None, sync_op=True):
        calls.append(("broadcast", threading.current_thread().name, time.monotonic()))

    monkeypatch.setattr(comm, "is_gloo", lambda group: True)
    monkeypatch.setattr(comm.dist.stream, "all_reduce", all_reduce)
    monkeypatch.setattr(comm.dist.stream, "broadcast", broadcast)
    yield calls
    comm.state.comm_thread = None


def test_on_thread_returns_at_once_and_keeps_the_groups_order(slow_backend):
    t = paddle.ones([4])
    start = time.monotonic()
    handle = comm.all_reduce(t, Group(), async_op=True, what="unit 0", on_thread=True)
    assert time.monotonic() - start < 0.15  # not blocked by the 0.3 s call
    comm.broadcast(paddle.ones([2]), src=0, group=Group())  # main thread, same group
    handle.wait()
    assert float(t.sum()) == 8.0
    (op1, thread1, t1), (op2, thread2, t2) = slow_backend
    assert (op1, op2) == ("all_reduce", "broadcast")
    assert thread1.startswith("paddle_hsdp-") and thread2 == threading.current_thread().name
    assert t2 - t1 >= 0.29  # the broadcast waited for the threaded all-reduce


def test_an_error_on_the_thread_is_raised_at_wait_naming_the_op(slow_backend):
    t = paddle.ones([4])
    t._fail = True
    handle = comm.all_reduce(t, Group(), async_op=True, what="unit 3", on_thread=True)
    with pytest.raises(comm.CollectiveError, match="all_reduce on group .* for unit 3"):
        handle.wait()


def test_without_async_op_or_off_gloo_it_runs_inline(slow_backend, monkeypatch):
    comm.all_reduce(paddle.ones([4]), Group(), async_op=False, on_thread=True)
    assert slow_backend[-1][1] == threading.current_thread().name
    monkeypatch.setattr(comm, "is_gloo", lambda group: False)

    class Task:
        def wait(self):
            return True
    monkeypatch.setattr(comm.dist.stream, "all_reduce",
                        lambda *a, **k: slow_backend.append(
                            ("nccl", threading.current_thread().name, 0)) or Task())
    comm.all_reduce(paddle.ones([4]), Group(), async_op=True, on_thread=True).wait()
    assert slow_backend[-1] == ("nccl", threading.current_thread().name, 0)


class OtherGroup:
    nranks, ranks, id, rank = 2, [0, 1], 9102, 0


def test_a_collective_on_another_group_waits_for_the_thread_too(slow_backend):
    """Paddle 3.3's gloo hangs when two threads of a process run collectives at once,
    even on groups with no rank in common: a main-thread collective on any group waits
    for the communication thread first."""
    handle = comm.all_reduce(paddle.ones([4]), Group(), async_op=True, on_thread=True)
    comm.broadcast(paddle.ones([2]), src=0, group=OtherGroup())
    handle.wait()
    (_, _, t1), (_, thread2, t2) = slow_backend
    assert thread2 == threading.current_thread().name and t2 - t1 >= 0.29


def test_threaded_reduce_scatter_exchanges_on_the_thread_and_lands_at_wait(monkeypatch):
    """gloo's two-rank reduce-scatter on the thread: only the exchange (a collective
    call) runs there; the add and the copy into the output run at ``wait()`` on the
    caller's thread (Paddle kernels stay on one thread)."""
    threads = []

    def all_gather(out, piece, group=None, sync_op=True):
        threads.append(threading.current_thread().name)
        time.sleep(0.2)
        paddle.assign(paddle.concat([piece, piece * 10]), output=out)  # peer sends x10
    monkeypatch.setattr(comm, "is_gloo", lambda group: True)
    monkeypatch.setattr(comm.dist.stream, "all_gather", all_gather)
    out = paddle.zeros([2])
    start = time.monotonic()
    handle = comm.reduce_scatter(out, paddle.to_tensor([1.0, 2.0, 3.0, 4.0]), Group(),
                                 async_op=True, on_thread=True)
    assert time.monotonic() - start < 0.15 and float(out.abs().sum()) == 0  # not landed
    handle.wait()
    comm.state.comm_thread = None
    assert threads[0].startswith("paddle_hsdp-")
    # rank 0 keeps slice 0 ([1, 2]) and gets the peer's slice 0 (x10 of what it sent: [3, 4])
    assert out.numpy().tolist() == [31.0, 42.0]
    assert handle.span() is not None


def test_paddles_gloo_collectives_wait_for_the_thread(monkeypatch):
    """Collectives that bypass paddle_hsdp.comm (a MoE layer's all-to-all, user code)
    go through ProcessGroupGloo's methods, which the patch makes wait first."""
    from paddle.base import core
    from paddle_hsdp.patches import gloo_groups
    drained = []
    monkeypatch.setattr(gloo_groups, "drain_comm_thread", lambda: drained.append(1))
    for name in ("all_reduce", "alltoall", "barrier", "broadcast", "send", "recv"):
        with pytest.raises(TypeError):  # not a real process group: after the wait
            getattr(core.ProcessGroupGloo, name)(object())
    assert len(drained) == 6
