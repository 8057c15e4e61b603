"""The arrival check of collective entry points (paddle_hsdp/comm/arrival.py, issue 51):
every rank makes a bounded number of store requests per call, whatever the group's
size and however long it waits (nothing polls), and a rank left alone raises within the
bound and takes its arrival back. One process: the ranks are threads on a fake store."""

import threading

import pytest

from paddle_hsdp.comm import arrival
from paddle_hsdp.comm.gather_tags import CollectiveMismatchError


class FakeStore:
    """Paddle's TCPStore's add / set / wait over a dict, counting requests."""

    def __init__(self):
        self.values, self.requests = {}, 0
        self.changed = threading.Condition()

    def add(self, key, n):
        with self.changed:
            self.requests += 1
            self.values[key] = int(self.values.get(key, 0)) + n
            self.changed.notify_all()
            return self.values[key]

    def set(self, key, value):
        with self.changed:
            self.requests += 1
            self.values[key] = value
            self.changed.notify_all()

    def wait(self, key):
        with self.changed:
            self.requests += 1
            self.changed.wait_for(lambda: key in self.values)


class Group:
    def __init__(self, n):
        self.ranks, self.id = list(range(n)), 7


@pytest.fixture
def store(monkeypatch):
    fake = FakeStore()
    monkeypatch.setattr(arrival, "_store", lambda: fake)
    monkeypatch.setattr(arrival, "_waiting_client", lambda limit: fake)
    monkeypatch.setattr(arrival.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(arrival.watchdog, "timeout_s", lambda: 5.0)
    monkeypatch.setattr(arrival, "_calls", arrival.defaultdict(int))
    return fake


def test_each_rank_makes_two_requests_per_call_however_many_wait(store):
    n = 64
    errors = []

    def rank():
        try:
            arrival.expect_everyone(Group(n), "a call")
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    threads = [threading.Thread(target=rank) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors and not any(t.is_alive() for t in threads)
    # an add each, a wait each but the last's, its mark
    assert store.requests == 2 * n, store.requests
    assert arrival._calls[7] == 1


def test_a_rank_alone_raises_within_the_bound_and_takes_its_arrival_back(store, monkeypatch):
    monkeypatch.setattr(arrival.watchdog, "timeout_s", lambda: 0.2)
    with pytest.raises(CollectiveMismatchError, match="only 1 of them"):
        arrival.expect_everyone(Group(4), "state_dict()")
    assert store.values[f"{arrival._KEY}/7/0"] == 0 and store.requests == 3
    assert arrival._calls[7] == 0  # the next agreed call reuses the key


def test_a_rank_whose_bound_passed_as_the_last_arrived_goes_on(store, monkeypatch):
    """The last rank came between this rank's bound and its take-back (and went into
    the collective): this rank goes on too instead of raising."""
    def late(key, limit, done):
        store.add(f"{arrival._KEY}/7/0", 1)  # the other rank arrives just now
        return False
    monkeypatch.setattr(arrival, "_await_key", late)
    arrival.expect_everyone(Group(2), "a call")
    assert store.values[f"{arrival._KEY}/7/0"] == 2 and arrival._calls[7] == 1
