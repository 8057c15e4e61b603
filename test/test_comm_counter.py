"""paddle_hsdp.comm bookkeeping: the counter, async handles and group labels."""

import paddle
import pytest

from paddle_hsdp.comm import collectives as comm


class FakeGroup:
    def __init__(self, gid):
        self.id = gid


def test_counter_accumulates_per_label_and_op():
    """record adds calls and bytes per (label, op); get of an unknown key is all zero."""
    c = comm.CommCounter()
    c.record("inner", "all_gather", 100, 50.0)
    c.record("inner", "all_gather", 300, 150.0)
    c.record("outer", "all_reduce", 8, 8.0)
    assert c.get("inner", "all_gather") == comm.OpStats(2, 400, 200.0)
    assert c.get("outer", "all_reduce") == comm.OpStats(1, 8, 8.0)
    assert c.get("inner", "all_reduce") == comm.OpStats()
    assert ("inner", "all_reduce") not in c.snapshot()  # get does not create entries


def test_counter_snapshot_is_a_copy_and_reset_clears():
    """A snapshot does not change with later records; reset empties the counter."""
    c = comm.CommCounter()
    c.record("g", "broadcast", 10, 5.0)
    snap = c.snapshot()
    c.get("g", "broadcast").calls = 99  # get returns a copy too
    c.record("g", "broadcast", 10, 5.0)
    assert snap == {("g", "broadcast"): comm.OpStats(1, 10, 5.0)}
    assert c.get("g", "broadcast") == comm.OpStats(2, 20, 10.0)
    c.reset()
    assert c.snapshot() == {} and c.get("g", "broadcast") == comm.OpStats()


def test_handle_wait_is_idempotent_and_finalizes_once():
    """wait() waits every task and runs finalize exactly once; None tasks are skipped."""
    events = []

    class Task:
        def wait(self):
            events.append("task")

    handle = comm.Handle([Task(), None, Task()], lambda: events.append("finalize"))
    assert not handle.is_completed()
    handle.wait()
    handle.wait()
    assert events == ["task", "task", "finalize"]
    assert handle.is_completed()
    empty = comm.Handle()
    empty.wait()
    assert empty.is_completed()


def test_group_label_first_name_wins(monkeypatch):
    """A group keeps its first label; unnamed groups are labelled by id."""
    monkeypatch.setattr(comm, "_group_labels", {})
    a, b = FakeGroup(7), FakeGroup(8)
    assert comm.group_label(a) == "group7"
    comm.name_group(a, "inner")
    comm.name_group(a, "expert_inner")
    comm.name_group(b, "outer")
    assert comm.group_label(a) == "inner"
    assert comm.group_label(FakeGroup(7)) == "inner"  # keyed by id, not object
    assert comm.group_label(b) == "outer"


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter", "all_reduce", "broadcast"])
def test_single_rank_group_counts_without_communicating(op, monkeypatch):
    """On a one-rank group each op is a local copy (or a no-op) and is still counted."""
    group = type("G", (), {"id": -1, "nranks": 1, "ranks": [0], "rank": 0})()
    monkeypatch.setattr(comm, "counter", comm.CommCounter())
    x = paddle.arange(4, dtype="float32")
    out = paddle.zeros([4]) if op in ("all_gather", "reduce_scatter") else x.clone()
    run = {"all_gather": lambda: comm.all_gather_into(out, x, group),
           "reduce_scatter": lambda: comm.reduce_scatter(out, x, group),
           "all_reduce": lambda: comm.all_reduce(out, group),
           "broadcast": lambda: comm.broadcast(out, 0, group)}[op]
    assert run() is None
    assert out.numpy().tolist() == [0.0, 1.0, 2.0, 3.0]
    assert comm.counter.get("group-1", op) == comm.OpStats(1, 16, 0.0)


def test_transferred_never_asks_the_backend():
    """``Handle.transferred()`` (the engine accumulates such reduce-scatters early, which
    may issue an outer sync): True once waited or when nothing was left in flight at
    the issue, and False for a task in flight even when the backend says it finished,
    so timing never makes ranks order their collectives differently."""

    class FinishedTask:
        def is_completed(self):
            return True

        def wait(self):
            return None

    at_issue = comm.Handle()  # exchanged at the issue (gloo's emulations)
    assert at_issue.transferred()
    at_issue.wait()  # (the engine waits every handle: an unwaited one warns)
    in_flight = comm.Handle([FinishedTask()])
    assert not in_flight.transferred()
    in_flight.wait()
    assert in_flight.transferred()


def test_every_verified_op_has_a_fingerprint_code():
    """Each collective that calls the fingerprint check (``_verify(op, ...)`` in
    comm/collectives.py) has its op in the fingerprint's table: the scatter of issue 61
    and the gather had none, and under check_collectives(True) they raised."""
    import inspect
    import re

    from paddle_hsdp.comm import collectives, fingerprint

    verified = set(re.findall(r'_verify\("(\w+)"', inspect.getsource(collectives)))
    assert verified >= {"all_gather", "reduce_scatter", "all_reduce", "broadcast",
                        "gather", "scatter"}, verified
    for op in verified:
        row = fingerprint._encode(op, 4, "float32", 1, "x")
        assert fingerprint._decode(row, {}).startswith(op), op
