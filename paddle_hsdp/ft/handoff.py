"""A rejoin's state handed over beside the step, so that the healthy groups do not
wait for it (issue 63, item 4).

At a round that takes a group in (a restarted group, or one a step behind) while some
member is up to date, and where every group holds its whole optimizer state (HSDP; not
HFSDP's shared pieces, whose transfer stays in the round's set-up), the receivers *sit
the round's first step out* (:func:`sits_out`): they add zero grads to its outer
all-reduce and are left out of its divisor. Per local rank, each receiver's donor
(:meth:`~.protocol.Round.donor_of`) copies the state that step starts from (its rank's
model shards and optimizer state: one more copy of that rank's state in memory until
it is sent) and serves it on a plain TCP socket from a thread of its own
(:class:`Donation`) while it trains the step; the socket's address and the tensors'
names, shapes and dtypes go as signed JSON through etcd, written from that thread, as
the set-up transfer's metadata does. The receiver's set-up waits for none of it: it
starts a thread (:class:`Receipt`) that reads the metadata and takes the bytes, and
runs the step with its zero grads on its own stale state (what its forward draws from
the RNG and its loader fetches is overwritten below). The donor, once its forward and
backward are done, hands the thread its plain state as of then (step, RNG, scheduler,
the user's state: its loader past the step's batch), sent after the bytes with a check
of its own. Once the step's all-reduce is through the receiver installs the donor's
state and plain state and lets its own optimizer apply the step's all-reduced grads: the
donor's update bit for bit (the same state, grads and code), and its RNG and loader
where the donor's are. It trains the next step. So a healthy group's rejoin step waits
for no metadata: the receiver reaches the step's first collective as soon as its
groups exist, like any member.

The bytes go in chunks of :data:`CHUNK_BYTES`, each checked by the job's keyed digest
(:meth:`~.trust.Signer.tensor_digest`: HMAC-SHA256 with ``PADDLE_HSDP_FT_SECRET``, a
CRC-32 without) bound to the round, the donor, the receiver, the local rank and the
chunk's index; the donor's checks follow the bytes, and the plain state carries a check
of its own. A stream cut short, a byte changed, a check forged or a stream of another
round or place: the receiver refuses the state, its attempt fails and it sits the next
round's step out again. Every wait is bounded (the sockets' timeouts are the round
timeout; the receiver also stops once a failure is announced in the round); a donor's
thread that fails only logs (the donor's step does not depend on it), except where it
could not write the metadata: then it announces a failure of the round, so that its
receiver does not wait a round timeout for it.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import paddle

from ..comm.gloo_store import _host_address
from ..engine import replication
from .protocol import FaultToleranceError
from .transfer import (TRANSFER_WAIT_ROUNDS, _bytes_of, _check_same_model, _described,
                       _exchange_meta, _flatten, _unflatten)
from .transfer import _plain as _json_default  # (numpy scalars a scheduler may hold)

if TYPE_CHECKING:
    from paddle.optimizer import Optimizer

    from .groups import LiveOuterGroup
    from .kv import SharedData
    from .pieces import PiecePlan
    from .protocol import Round
    from .trust import Signer

logger = logging.getLogger("paddle_hsdp.ft")

CHUNK_BYTES = 1 << 20  # one check per chunk; a chunk is sent and received whole
_HELLO = struct.Struct("<q16s")  # the receiver names its replica, with the donor's token
HELLO_TIMEOUT_S = 10.0  # a connection that says nothing holds the donor no longer


def sits_out(record: Round, plan: PiecePlan | None, syncs_apart: bool = False) -> list[int]:
    """The members of round ``record`` that sit its first step out, their state handed
    over beside it: its receivers, where some member is up to date (not the first
    round, whose state no one holds yet), each group holds its whole optimizer state
    (not HFSDP's pieces) and the groups sync their grads at every step (not DiLoCo's
    ``syncs_apart``: a sitting-out group's update needs the step's all-reduced grads,
    which DiLoCo's steps between syncs do not have). Else none: the receivers take
    their state in the set-up and train the step. Decided from the round's record and
    what every group's configuration shares only (the groups' configuration check
    covers DiLoCo), so every member decides alike: a group's own resume is no input (a
    resuming donor loads the checkpoint in the set-up, before its copy is made)."""
    if not record.receivers or not record.up_to_date or syncs_apart:
        return []
    if plan is not None and plan.parts > 1:
        return []
    return list(record.receivers)


def _nbytes(tensor: paddle.Tensor) -> int:
    return math.prod(tensor.shape) * tensor.element_size()


def _where(record: Round, donor: int, receiver: int, local_rank: int) -> tuple:
    """What a handoff's checks are bound to (with each chunk's index)."""
    return (record.number, "handoff", donor, receiver, local_rank)


def _meta_key(group: LiveOuterGroup, receiver: int) -> tuple:
    return (group.local_rank, "handoff", receiver)


def _snapshot(tensors: list[paddle.Tensor]) -> np.ndarray:
    """Every tensor's bytes, one after the other, in one buffer of their total size."""
    blob = np.empty(sum(_nbytes(t) for t in tensors), dtype=np.uint8)
    view, offset = blob.data, 0
    for tensor in tensors:
        size = _nbytes(tensor)
        if size:
            view[offset:offset + size] = _bytes_of(tensor)
            offset += size
    return blob


def _chunks(view: memoryview) -> list[memoryview]:
    return [view[start:start + CHUNK_BYTES] for start in range(0, len(view), CHUNK_BYTES)]


def _chunk_moved(index: int) -> None:
    """Called after each chunk is sent or received (the fault tests die here)."""


def send_state(conn: socket.socket, blob: np.ndarray, signer: Signer, where: tuple) -> None:
    """The donor's side of one stream: each chunk of ``blob``, then their checks."""
    sums = []
    for index, chunk in enumerate(_chunks(blob.data)):
        sums.append(signer.tensor_digest(chunk, (*where, index)))
        conn.sendall(chunk)
        _chunk_moved(index)
    conn.sendall(struct.pack(f"<{len(sums)}q", *sums))


def _receive_exactly(conn: socket.socket, into: memoryview, what: str) -> None:
    got = 0
    while got < len(into):
        n = conn.recv_into(into[got:])
        if not n:
            raise FaultToleranceError(f"paddle_hsdp.ft: the stream ended in {what}, after "
                                      f"{got} of its {len(into)} bytes")
        got += n


def receive_state(conn: socket.socket, blob: np.ndarray, signer: Signer, where: tuple) -> None:
    """The receiver's side of one stream: ``blob`` filled chunk by chunk, each chunk's
    check computed as it arrived and compared with the donor's; raises on a stream cut
    short or a check that differs."""
    mine = []
    chunks = _chunks(blob.data)
    for index, chunk in enumerate(chunks):
        _receive_exactly(conn, chunk, f"chunk {index} of {len(chunks)}")
        _chunk_moved(index)
        mine.append(signer.tensor_digest(chunk, (*where, index)))
    sent = bytearray(8 * len(chunks))
    _receive_exactly(conn, memoryview(sent), "the donor's checks")
    bad = [i for i, (m, s) in enumerate(zip(mine, struct.unpack(f"<{len(chunks)}q", sent),
                                             strict=True)) if m != s]
    if bad:
        raise FaultToleranceError(
            f"paddle_hsdp.ft: {len(bad)} of the {len(chunks)} checks of the state handed "
            f"over at {where} differ from the donor's (first: chunk {bad[0]}); refused")


_PLAIN = struct.Struct("<qq")  # the plain state's length and check, then its JSON
MAX_PLAIN_BYTES = 64 << 20  # a length beyond it is refused before any allocation


def send_plain(conn: socket.socket, text: bytes, signer: Signer, where: tuple) -> None:
    """After the bytes: the donor's plain state (JSON) with its check."""
    conn.sendall(_PLAIN.pack(len(text), signer.tensor_digest(text, (*where, "plain")))
                 + text)


def receive_plain(conn: socket.socket, signer: Signer, where: tuple) -> dict:
    """The receiver's side of :func:`send_plain`: the plain state, checked."""
    head = bytearray(_PLAIN.size)
    _receive_exactly(conn, memoryview(head), "the plain state's length")
    size, check = _PLAIN.unpack(head)
    if not 0 <= size <= MAX_PLAIN_BYTES:
        raise FaultToleranceError(f"paddle_hsdp.ft: a plain state of {size} bytes at "
                                  f"{where}; refused")
    text = bytearray(size)
    _receive_exactly(conn, memoryview(text), "the plain state")
    if signer.tensor_digest(memoryview(text), (*where, "plain")) != check:
        raise FaultToleranceError(f"paddle_hsdp.ft: the check of the plain state handed "
                                  f"over at {where} differs from the donor's; refused")
    return json.loads(bytes(text))


class Donation:
    """A donor rank's side: the state its step starts from, copied now, served on a
    socket of its own to each receiver it feeds (``receivers``), one at a time, from a
    thread, which first writes the metadata (the socket's address, the tensors) through
    ``store`` (calling ``unwritten()`` if that fails: the donor's group announces a
    failure of the round); after the bytes each receiver gets the plain state
    :meth:`stepped` hands over. The thread ends once every receiver was served, or at
    the first accept or wait that takes a round timeout."""

    def __init__(self, store: SharedData, record: Round, group: LiveOuterGroup,
                 model: paddle.nn.Layer, optimizer: Optimizer, receivers: list[int],
                 unwritten: Callable[[], object] = lambda: None):
        named = replication.state_tensors(model)
        pairs, rest = _flatten(optimizer.state_dict())
        self._blob = _snapshot([t for _, t in named] + [t for _, t in pairs])
        self.bytes = int(self._blob.nbytes)
        host = _host_address()
        self._listener = socket.create_server((host, 0))
        self._listener.settimeout(store.timeout_s)
        self._timeout_s, self._signer = store.timeout_s, store.signer
        self._where = lambda r: _where(record, group.replica, r, group.local_rank)
        # only a reader of the (signed) metadata can ask for the state: a stray
        # connection to the port neither gets it nor takes a receiver's place
        self._token = secrets.token_bytes(16)
        meta = {"address": [host, self._listener.getsockname()[1]], "bytes": self.bytes,
                "token": self._token.hex(),
                "model": _described(named), "tensors": _described(pairs), "rest": rest}
        self._plain: bytes | None = None  # the plain state after the donor's backward
        self._why = ""  # why there is none (refuse)
        self._stepped = threading.Event()  # set by stepped(), or by close()
        self._thread = threading.Thread(
            target=self._run, args=(store, record, group, meta, set(receivers), unwritten),
            daemon=True, name="paddle_hsdp-ft-handoff")
        self._thread.start()

    @property
    def awaits_plain_state(self) -> bool:
        """Whether :meth:`stepped` is still to be called (once: the handoff's step)."""
        return not self._stepped.is_set()

    def stepped(self, plain: dict) -> None:
        """The donor's forward and backward of the step are done: ``plain`` (its step,
        RNG, scheduler and user state as of now) goes to each receiver after the bytes.
        Once: what later steps hold is not the bytes' state."""
        if not self.awaits_plain_state:
            return
        try:
            self._plain = json.dumps(plain, default=_json_default).encode()
        except (TypeError, ValueError) as e:  # the donor's step goes on; its receivers fail
            self.refuse(f"the donor's plain state is not JSON: {e}")
            return
        self._stepped.set()

    def refuse(self, why: str) -> None:
        """The plain state could not be made (``why``): each receiver's stream ends with
        that error (its attempt fails), the donor's step goes on."""
        logger.warning("paddle_hsdp.ft: the rejoin's handoff fails: %s", why)
        self._why = why
        self._stepped.set()

    def _run(self, store: SharedData, record: Round, group: LiveOuterGroup, meta: dict,
             waiting: set[int], unwritten: Callable[[], object]) -> None:
        try:  # (off the donor's step: a write through the leader's relay takes a while)
            try:
                for receiver in sorted(waiting):
                    _exchange_meta(store, record, _meta_key(group, receiver), True,
                                   lambda: meta)
            except Exception:  # a receiver would wait for it a round timeout
                unwritten()
                raise
            while waiting:
                conn, _ = self._listener.accept()
                with conn:
                    self._serve_one(conn, waiting)
        except Exception as e:  # noqa: BLE001 - closed by a later round, no receiver came,
            # or etcd refused the metadata: the receivers' attempts fail, not the donor's
            logger.warning("paddle_hsdp.ft: the rejoin's state was not handed over to "
                           "replica(s) %s: %s: %s", sorted(waiting), type(e).__name__, e)
        finally:
            self.close()

    def _serve_one(self, conn: socket.socket, waiting: set[int]) -> None:
        conn.settimeout(min(HELLO_TIMEOUT_S, self._timeout_s))
        hello = bytearray(_HELLO.size)
        try:
            _receive_exactly(conn, memoryview(hello), "a receiver's hello")
            receiver, token = _HELLO.unpack(hello)
            if not hmac.compare_digest(token, self._token):
                raise FaultToleranceError("a connection without the handoff's token")
            if receiver not in waiting:
                raise FaultToleranceError(f"replica {receiver} is not fed here")
            conn.settimeout(self._timeout_s)
            send_state(conn, self._blob, self._signer, self._where(receiver))
            # the donor's backward may end well after the bytes (a long step): bounded
            # as a bystander's wait for a transfer is
            if not self._stepped.wait(TRANSFER_WAIT_ROUNDS * self._timeout_s) or \
                    self._plain is None:
                raise FaultToleranceError(self._why or "the donor's step ended before its "
                                          "backward")
            send_plain(conn, self._plain, self._signer, self._where(receiver))
            waiting.discard(receiver)
        except (OSError, FaultToleranceError) as e:  # that stream alone: its receiver fails
            logger.warning("paddle_hsdp.ft: a handoff stream failed: %s", e)

    def close(self) -> None:
        """Stop serving (idempotent): the socket shut (which wakes a blocked accept;
        a close alone does not on Linux) and closed, the copy dropped."""
        _shut(self._listener)
        self._blob = np.empty(0, dtype=np.uint8)
        self._stepped.set()  # a stream waiting for the plain state stops

    def join(self, timeout_s: float) -> bool:
        """Whether the thread ended within ``timeout_s`` (tests)."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


class Receipt:
    """A receiver rank's side: a thread that reads the donor's metadata, takes the
    bytes and then the donor's plain state (:attr:`extra`) while the step runs, all
    installed by :meth:`install` once the step's all-reduce is through. Nothing here
    waits for the donor before the step."""

    def __init__(self, store: SharedData, record: Round, group: LiveOuterGroup,
                 model: paddle.nn.Layer, donor: int):
        self.extra: dict | None = None  # the donor's plain state, once it arrived
        self._meta: dict = {}
        self._blob = np.empty(0, dtype=np.uint8)
        self._number, self._timeout_s = record.number, store.timeout_s
        self._error: BaseException | None = None
        self._conn: socket.socket | None = None
        self._stopped = False
        where = _where(record, donor, group.replica, group.local_rank)
        mine = replication.state_tensors(model) if model is not None else None
        self._thread = threading.Thread(
            target=self._receive, daemon=True, name="paddle_hsdp-ft-handoff",
            args=(store, record, group, (mine, donor), where))
        self._thread.start()

    def _receive(self, store: SharedData, record: Round, group: LiveOuterGroup,
                 model_and_donor: tuple, where: tuple) -> None:
        try:
            meta = _exchange_meta(store, record, _meta_key(group, group.replica), False,
                                  None)
            _check_same_model(model_and_donor[0], meta, group.replica, model_and_donor[1])
            self._meta, self._blob = meta, np.empty(int(meta["bytes"]), dtype=np.uint8)
            host, port = meta["address"]
            with socket.create_connection((host, port), timeout=self._timeout_s) as conn:
                self._conn = conn
                if self._stopped:  # stopped while it connected
                    raise FaultToleranceError("the handoff was stopped")
                conn.sendall(_HELLO.pack(group.replica, bytes.fromhex(meta["token"])))
                receive_state(conn, self._blob, store.signer, where)
                # the plain state follows the donor's backward, which may end well after
                # the bytes: bounded as the donor's wait for it is
                conn.settimeout(TRANSFER_WAIT_ROUNDS * self._timeout_s)
                self.extra = receive_plain(conn, store.signer, where)
        except BaseException as e:  # noqa: BLE001 - handed to install's caller
            self._error = e

    def wait(self, abort: Callable[[], object] | None = None) -> None:
        """Until every byte arrived and was checked: bounded by round timeouts, and
        ended by ``abort()`` raising (a failure announced in the round)."""
        deadline = time.monotonic() + self._timeout_s * TRANSFER_WAIT_ROUNDS
        while self._thread.is_alive():
            self._thread.join(0.05)
            try:
                if abort is not None:
                    abort()
                if time.monotonic() > deadline:
                    raise FaultToleranceError(
                        f"paddle_hsdp.ft: the rejoin's state took over "
                        f"{self._timeout_s * TRANSFER_WAIT_ROUNDS:g} s; refused")
            except Exception:
                self._stop()
                raise
        if self._error is not None:
            raise FaultToleranceError(f"paddle_hsdp.ft: round {self._number}'s state was "
                                      f"not handed over: {type(self._error).__name__}: "
                                      f"{self._error}") from self._error

    def _stop(self) -> None:
        """The receiving thread woken and ended (a shut socket ends a blocked read),
        its buffer let go: a retry allocates its own."""
        self._stopped = True
        if self._conn is not None:
            _shut(self._conn)
        self._blob = np.empty(0, dtype=np.uint8)

    def install(self, model: paddle.nn.Layer, optimizer: Optimizer,
                abort: Callable[[], object] | None = None) -> int:
        """The donor's state in place of this rank's (after :meth:`wait`); its bytes.
        The plain state is then :attr:`extra`, the caller's to load."""
        self.wait(abort)
        view, offset = self._blob.data, 0
        for _, tensor in replication.state_tensors(model):
            offset = _write(tensor, view, offset)
        targets, paths = [], []
        for path, shape, dtype in self._meta["tensors"]:
            targets.append(paddle.zeros(shape, dtype))
            paths.append(tuple(path))
            offset = _write(targets[-1], view, offset)
        optimizer.set_state_dict(_unflatten(zip(paths, targets, strict=True),
                                            self._meta["rest"]))
        replication.state_replaced(model)  # views re-pointed, gathered params resharded
        self._blob = np.empty(0, dtype=np.uint8)
        return offset

    def close(self) -> None:
        self._stop()


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # not connected, or shut already
        pass
    sock.close()


def _write(tensor: paddle.Tensor, view: memoryview, offset: int) -> int:
    """``tensor``'s bytes from ``view`` at ``offset``, in place; the offset after."""
    size = _nbytes(tensor)
    if not size:
        return offset
    data = view[offset:offset + size]
    if tensor.place.is_cpu_place() and tensor.is_contiguous():
        _bytes_of(tensor)[:] = data
    else:  # unverified here (CPU only): through a host copy
        host = tensor.numpy()
        tensor.set_value(np.frombuffer(data, dtype=host.dtype).reshape(host.shape))
    return offset + size
