"""A rendezvous store per gloo sub-group (installed by :mod:`paddle_hsdp.patches.gloo_groups`).

Paddle 3.3's ``ProcessGroupGloo`` rendezvouses on the *global* TCP store with keys that
do not carry the group id, so two sub-groups created one after another (``fleet.init``
makes dozens) can read each other's, or stale, peer addresses: launches fail with
"connection refused" or hang until a gloo timeout.  We give every gloo sub-group its
own rendezvous store instead.  The group's first member starts a ``TCPStore`` server on
its own host address (the one the launcher advertises, never 127.0.0.1, so this works
across machines) and publishes ``host:port`` in the global store under a key that is
unique to the group id; the other members read it and connect.

Group ids are consistent across ranks because every rank creates every group in the
same global order (Paddle's HCG does; so does :mod:`paddle_hsdp.topology.fleet`).  NCCL and
other backends are left untouched: they key their ids by group already.

Shutdown: a store's server runs a libuv thread that logs (glog) when a peer's
connection closes. Peers close their connections when they exit, which may be while
this process is already in ``exit()``, after glog's statics are gone: the thread then
aborts the process (seen as SIGABRT/SIGSEGV after the work was done, about one launch in
30). So the server is a TCPStore object of its own, held only here (the process group
gets a client store), and an ``atexit`` handler destroys every server while the
interpreter and glog are alive, which stops and joins its thread. A server is needed
only while its group is being created.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Callable, Protocol, cast

from paddle.base import core

logger = logging.getLogger(__name__)

_KEY_PREFIX = "paddle_hsdp/gloo_store"
# Client stores live as long as their process groups (which hold them too).
_group_stores: dict[int, object] = {}
# Servers (on each group's first member): destroyed at exit by stop_servers().
_servers: dict[int, object] = {}


class RendezvousStore(Protocol):
    """Where a group's first member publishes its store's address: the job's global
    ``TCPStore``, or paddle_hsdp.ft's replica-group store."""

    def set(self, key: str, value: str, /) -> None: ...
    def get(self, key: str, /) -> bytes: ...


class AbortableStore(RendezvousStore, Protocol):
    """A store whose ``get`` calls ``abort()`` while it waits (paddle_hsdp.ft's)."""

    def get(self, key: str, /, *, abort: Callable[[], object] | None = None) -> bytes: ...


def _host_address() -> str:
    """The address this rank's peers reach it at, as the launcher advertises it."""
    endpoint = os.environ.get("PADDLE_CURRENT_ENDPOINT", "")
    host = endpoint.rsplit(":", 1)[0] if ":" in endpoint else ""
    return host or socket.gethostbyname(socket.gethostname())


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _store_timeout_s() -> int:
    # Bounded wait: a peer that never shows up fails the launch instead of hanging it.
    return int(os.environ.get("PADDLE_HSDP_GLOO_STORE_TIMEOUT", "300"))


def make_group_store(global_store: RendezvousStore, group_rank: int, group_size: int,
                     group_id: int, key: str | None = None, timeout_s: int | None = None,
                     listen_first: bool = False,
                     abort: Callable[[], object] | None = None) -> core.TCPStore:
    """A rendezvous store private to one sub-group (see the module docstring).
    ``key``: where the address is published (default: by group id); ``timeout_s``: how
    long members wait for each other (default ``PADDLE_HSDP_GLOO_STORE_TIMEOUT``).
    ``listen_first``: publish the address only once the server listens, so members
    that read it at once do not meet a refused connection and the client's retry
    back-off (seconds; paddle_hsdp.ft's rounds, whose members all read it at once).
    ``abort``: called while a member waits for the address or the server (it raises to
    stop waiting: paddle_hsdp.ft, once a failure is announced); needs a ``global_store``
    whose ``get`` takes it."""
    key = key or f"{_KEY_PREFIX}/{group_id}"
    timeout_s = timeout_s or _store_timeout_s()
    if group_rank == 0:
        host = _host_address()
        port = _free_port(host)
        if listen_first:  # a master that waits for itself only: it returns listening
            _servers[group_id] = core.TCPStore(host, port, True, 1, timeout_s)
            global_store.set(key, f"{host}:{port}")
        else:
            global_store.set(key, f"{host}:{port}")
            # The master's constructor returns once all group_size members connected.
            _servers[group_id] = core.TCPStore(host, port, True, group_size, timeout_s)
    else:
        address = (global_store.get(key) if abort is None
                   else cast(AbortableStore, global_store).get(key, abort=abort))
        host, port_text = address.decode().rsplit(":", 1)
        port = int(port_text)
        if listen_first:  # it listened before it published: gone now if it refuses
            wait_until_listening(host, port, timeout_s, abort)
    store = core.TCPStore(host, port, False, group_size, timeout_s)
    _group_stores[group_id] = store
    return store


def wait_until_listening(host: str, port: int, timeout_s: float,
                         abort: Callable[[], object] | None = None) -> None:
    """Return once something accepts connections at ``host:port``; ``TimeoutError``
    after ``timeout_s`` (``abort()``, if given, is called between tries: it raises to
    stop waiting). Paddle's ``TCPStore`` client retries a refused connection far
    past its own timeout (measured: still retrying after 120 s with 3 s), so a client of
    a server that may be gone is made only after this."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return
        except OSError as e:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens at {host}:{port} after {timeout_s:g} s "
                                   f"({e})") from None
            if abort is not None:
                abort()
            time.sleep(0.2)


def forget_group_store(group_id: int) -> None:
    """Drop this process's store client and server of group ``group_id`` (a group whose
    creation was abandoned: their destruction ends the connections its rendezvous is
    blocked on)."""
    _group_stores.pop(group_id, None)
    _servers.pop(group_id, None)


def stop_servers() -> None:
    """Destroy this process's store servers (joins their threads). Registered with
    ``atexit``; the groups keep working, their rendezvous is long done."""
    while _servers:
        _servers.popitem()
