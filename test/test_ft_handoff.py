"""paddle_hsdp.ft.handoff: a rejoin's state handed over on a socket beside the step
(issue 63 item 4), in one process: the stream and its keyed checks (a torn, changed,
forged or misplaced stream is refused), the donor's copy and the receiver's install
(the optimizer's state and the model's tensors exactly the donor's), and which round's
receivers sit its step out."""

import json
import socket
import threading
import time
import types

import numpy as np
import paddle
import pytest

from paddle_hsdp.ft import handoff
from paddle_hsdp.ft.protocol import FaultToleranceError
from paddle_hsdp.ft.trust import Signer

SIGNER = Signer("the-handoff-tests-secret")
WHERE = (7, "handoff", 0, 2, 1)


def _stream(blob, into, sender=SIGNER, where=WHERE, tamper=None, expected=WHERE):
    """``blob`` sent by ``sender`` for ``where`` and received into ``into`` for
    ``expected`` over a socket pair (``tamper(bytes) -> bytes`` between them: all the
    sender wrote, then what the receiver reads); the receiver's error, or None."""
    a, b = socket.socketpair()
    if tamper is not None:
        written = []
        with a, b:
            threading.Thread(target=lambda: (handoff.send_state(a, blob, sender, where),
                                             a.shutdown(socket.SHUT_WR))).start()
            while chunk := b.recv(1 << 16):
                written.append(chunk)
        a, b = socket.socketpair()
        a.sendall(tamper(b"".join(written)))
        a.close()
    else:
        threading.Thread(target=lambda: handoff.send_state(a, blob, sender, where)).start()
    try:
        with b:
            handoff.receive_state(b, into, SIGNER, expected)
    except FaultToleranceError as e:
        return e
    finally:
        a.close()
    return None


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(handoff, "CHUNK_BYTES", 1000)  # the blob below: 5 chunks


def _blob():
    return np.random.default_rng(0).integers(0, 256, 4321, dtype=np.uint8)


def test_a_stream_arrives_whole_and_checked(small_chunks):
    blob, into = _blob(), np.zeros(4321, dtype=np.uint8)
    assert _stream(blob, into) is None and np.array_equal(blob, into)
    empty = np.zeros(0, dtype=np.uint8)  # a rank with nothing to send: its checks alone
    assert _stream(empty, np.zeros(0, dtype=np.uint8)) is None


def test_a_torn_changed_forged_or_misplaced_stream_is_refused(small_chunks):
    blob = _blob()
    cases = {
        "cut short": dict(tamper=lambda data: data[:2500]),
        "a byte changed": dict(tamper=lambda data: data[:3001] + bytes([data[3001] ^ 1])
                               + data[3002:]),
        # a peer without the secret: its own data, with checks that match it unkeyed
        "forged": dict(sender=Signer(None)),
        "another round's": dict(expected=(8, *WHERE[1:])),  # sent for round 7
        "another receiver's": dict(expected=(*WHERE[:3], 3, WHERE[4])),
    }
    errors = {name: str(_stream(blob, np.zeros(4321, dtype=np.uint8), **case))
              for name, case in cases.items()}
    assert "ended in chunk 2 of 5, after 500 of its 1000" in errors["cut short"], errors
    assert "1 of the 5 checks" in errors["a byte changed"] and "chunk 3" in \
        errors["a byte changed"], errors
    assert "5 of the 5 checks" in errors["forged"], errors
    assert "5 of the 5 checks" in errors["another round's"], errors
    assert "5 of the 5 checks" in errors["another receiver's"], errors


class _Store:
    """The job's shared data as the handoff uses it: set/get of signed JSON (a get
    waits for the value: the donor's thread writes it)."""

    def __init__(self, refuse=False):
        self.values, self.timeout_s, self.signer = {}, 5.0, SIGNER
        self.refuse = refuse  # every set raises (etcd away)

    def failed(self, number):
        return False

    def set(self, name, value, lease=0):
        if self.refuse:
            raise TimeoutError("etcd is away")
        self.values[name] = value

    def get(self, name, timeout_s=None, abort=None):
        deadline = time.monotonic() + self.timeout_s
        while name not in self.values:
            assert time.monotonic() < deadline, f"{name} never written"
            time.sleep(0.01)
        return self.values[name]

    def first(self):
        """The first value written, once it is."""
        deadline = time.monotonic() + self.timeout_s
        while not self.values:
            assert time.monotonic() < deadline, "nothing written"
            time.sleep(0.01)
        return json.loads(self.values[next(iter(self.values))])


def _trained(seed):
    """A small model and its AdamW after a step (the state a donor holds)."""
    paddle.seed(seed)
    with paddle.utils.unique_name.guard():  # one program's names, as in two groups
        model = paddle.nn.Linear(60, 30)
        opt = paddle.optimizer.AdamW(parameters=model.parameters(), learning_rate=0.1)
        model(paddle.randn([4, 60])).square().mean().backward()
        opt.step()
        opt.clear_grad()
    return model, opt


def _shards_are_parameters(monkeypatch):
    monkeypatch.setattr(handoff.replication, "state_tensors",
                        lambda model: [(n, p) for n, p in model.named_parameters()])
    monkeypatch.setattr(handoff.replication, "state_replaced", lambda model: None)


def test_a_donor_serves_its_copy_and_the_receiver_installs_it_exactly(monkeypatch,
                                                                       small_chunks):
    """The donor copies its state when the handoff starts (what it changes after is not
    sent), serves it to the receiver it feeds, then the plain state its backward left
    (the first handed over: a later step's is not the bytes'); the receiver's model and
    optimizer then hold the donor's state exactly, and a second step of both agrees bit
    for bit."""
    _shards_are_parameters(monkeypatch)
    store, record = _Store(), types.SimpleNamespace(number=7)
    donor_model, donor_opt = _trained(1)
    taker_model, taker_opt = _trained(2)
    sent = {n: p.numpy().copy() for n, p in donor_model.named_parameters()}
    group = types.SimpleNamespace(replica=0, local_rank=1)
    # the receiver starts first: its set-up waits for nothing of the donor's
    receipt = handoff.Receipt(store, record, types.SimpleNamespace(replica=2, local_rank=1),
                              taker_model, donor=0)
    donation = handoff.Donation(store, record, group, donor_model, donor_opt, [2])
    assert donation.bytes > 4 * 1000  # (several chunks)
    for p in donor_model.parameters():  # its step goes on: the copy is what it had
        p.set_value(p.numpy() + 1)
    # a stray connection (the port, a receiver's id, not the signed metadata's token)
    # gets nothing and takes no receiver's place
    address = tuple(store.first()["address"])
    with socket.create_connection(address, timeout=5) as stray:
        stray.sendall(handoff._HELLO.pack(2, bytes(16)))
        assert stray.recv(1) == b""  # closed on it, nothing sent
    assert donation.awaits_plain_state
    donation.stepped({"step": 5, "position": np.int64(9)})  # (numpy scalars as JSON)
    donation.stepped({"step": 6})  # a later step's: not sent
    assert not donation.awaits_plain_state
    assert receipt.install(taker_model, taker_opt) == donation.bytes
    assert receipt.extra == {"step": 5, "position": 9}
    assert donation.join(5)
    for name, p in taker_model.named_parameters():
        assert np.array_equal(p.numpy(), sent[name]), name
    for p, want in zip(donor_model.parameters(), sent.values()):
        p.set_value(want)
    mine, theirs = taker_opt.state_dict(), donor_opt.state_dict()
    for key, value in theirs.items():
        if isinstance(value, paddle.Tensor):
            assert np.array_equal(mine[key].numpy(), value.numpy()), key
    x = paddle.randn([4, 60])
    for model, opt in ((donor_model, donor_opt), (taker_model, taker_opt)):
        model(x).square().mean().backward()
        opt.step()
    for (name, a), b in zip(donor_model.named_parameters(), taker_model.parameters()):
        assert np.array_equal(a.numpy(), b.numpy()), name
    meta = store.first()
    assert meta["address"][1] > 0 and meta["bytes"] == donation.bytes and "extra" not in meta


def test_a_changed_plain_state_is_refused_and_an_unwritten_donation_is_announced(
        monkeypatch):
    """The plain state's check binds it to its place; a donor whose metadata cannot be
    written says so (its group announces a failure of the round) instead of leaving
    its receiver to wait a round timeout."""
    a, b = socket.socketpair()
    with a, b:
        handoff.send_plain(a, b'{"step": 5}', SIGNER, WHERE)
        assert handoff.receive_plain(b, SIGNER, WHERE) == {"step": 5}
        handoff.send_plain(a, b'{"step": 6}', SIGNER, WHERE)
        with pytest.raises(FaultToleranceError, match="plain state .* differs"):
            handoff.receive_plain(b, SIGNER, (8, *WHERE[1:]))  # another round's
        head = handoff._PLAIN.pack(1 << 40, 0)
        a.sendall(head)
        with pytest.raises(FaultToleranceError, match="refused"):
            handoff.receive_plain(b, SIGNER, WHERE)
    _shards_are_parameters(monkeypatch)
    model, opt = _trained(1)
    announced = threading.Event()
    donation = handoff.Donation(_Store(refuse=True), types.SimpleNamespace(number=3),
                                types.SimpleNamespace(replica=0, local_rank=0), model, opt,
                                [2], announced.set)
    assert announced.wait(5) and donation.join(5)
    assert not donation.awaits_plain_state  # closed: the step hands nothing over


def test_a_plain_state_that_is_not_json_fails_the_receiver_not_the_donors_step(
        monkeypatch, small_chunks):
    """Made mid-step (after the donor's backward), a plain state JSON cannot carry must
    not raise out of the donor's step (its group would miss the all-reduce): the
    receiver's stream ends naming it, and the donor goes on."""
    _shards_are_parameters(monkeypatch)
    store, record = _Store(), types.SimpleNamespace(number=7)
    donor_model, donor_opt = _trained(1)
    taker_model, taker_opt = _trained(2)
    receipt = handoff.Receipt(store, record, types.SimpleNamespace(replica=2, local_rank=1),
                              taker_model, donor=0)
    donation = handoff.Donation(store, record, types.SimpleNamespace(replica=0, local_rank=1),
                                donor_model, donor_opt, [2])
    donation.stepped({"step": 5, "lr": np.ones(2)})  # an array: not JSON; no raise here
    assert not donation.awaits_plain_state
    with pytest.raises(FaultToleranceError):
        receipt.install(taker_model, taker_opt)
    donation.close()  # (the next round's, as the replica does)
    assert donation.join(5)


def test_a_receiver_whose_donor_is_gone_fails_within_its_bound(monkeypatch):
    """No donor listening (it died): the receiver's wait ends with an error, no hang."""
    monkeypatch.setattr(handoff.replication, "state_tensors", lambda model: [])
    store, record = _Store(), types.SimpleNamespace(number=3)
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
    store.values["x"] = None
    meta = {"address": ["127.0.0.1", port], "bytes": 10, "model": [], "tensors": [],
            "rest": {}, "extra": {}, "token": "00" * 16}
    monkeypatch.setattr(handoff, "_exchange_meta", lambda *args: meta)
    receipt = handoff.Receipt(store, record, types.SimpleNamespace(replica=2, local_rank=0),
                              None, donor=0)
    with pytest.raises(FaultToleranceError, match="not handed over: ConnectionRefused"):
        receipt.wait()


def test_who_sits_a_rounds_step_out():
    round_of = lambda receivers, up_to_date: types.SimpleNamespace(  # noqa: E731
        receivers=receivers, up_to_date=up_to_date)
    hfsdp = types.SimpleNamespace(parts=2)
    assert handoff.sits_out(round_of([2], [0, 1]), None) == [2]
    assert handoff.sits_out(round_of([2, 3], [0]), types.SimpleNamespace(parts=1)) == [2, 3]
    assert handoff.sits_out(round_of([1, 2], []), None) == []  # the first round
    assert handoff.sits_out(round_of([2], [0, 1]), hfsdp) == []  # pieces: in the set-up
    # DiLoCo: a step between syncs has no all-reduced grads for a sitting-out group
    assert handoff.sits_out(round_of([2], [0, 1]), None, syncs_apart=True) == []
    assert handoff.sits_out(round_of([], [0, 1]), None) == []
