"""A client of the job's etcd, the control plane of fault tolerance (Paddle-free).

It speaks etcd's HTTP/JSON gateway (``/v3/...``) through ``etcd3gw``'s client, so
nothing here needs gRPC or a protobuf that could clash with Paddle's. It adds what the
protocol (:mod:`.protocol`) needs and the library leaves out: several endpoints (a
3-member cluster: a call that cannot reach one tries the next), clients that share one
connection for their requests and one stream for their watches (each resuming from the
revision after the last event it delivered when the stream breaks), a :class:`History` that notices an etcd that lost its data (its revision went back), and a
count of requests (``requests``), which the scale simulator reports.

Addresses: ``etcd://host:port[,host:port...]`` (or plain ``host:port``). TLS and etcd's
own users come from the environment (:func:`security_from_env`).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import requests
from etcd3gw.client import Etcd3Client
from etcd3gw.exceptions import ConnectionFailedError, ConnectionTimeoutError, Etcd3Exception

logger = logging.getLogger("paddle_hsdp.ft")

SCHEME = "etcd://"
CA_ENV, CERT_ENV, KEY_ENV = ("PADDLE_HSDP_FT_ETCD_CA", "PADDLE_HSDP_FT_ETCD_CERT",
                             "PADDLE_HSDP_FT_ETCD_KEY")
USER_ENV, PASSWORD_ENV = "PADDLE_HSDP_FT_ETCD_USER", "PADDLE_HSDP_FT_ETCD_PASSWORD"
SECURITY_ENV = (CA_ENV, CERT_ENV, KEY_ENV, USER_ENV, PASSWORD_ENV)


# what a watch calls for each change: (kind "PUT" or "DELETE", key, value, revision)
OnEvent = Callable[[str, str, str, int], None]


class EtcdUnavailable(ConnectionError):
    """No endpoint of the job's etcd answered."""


class EtcdRefused(RuntimeError):
    """etcd answered a request with an error (its text says why: a lease not found,
    an unauthenticated client, a bad request)."""


class EtcdReset(RuntimeError):
    """etcd answered as a service that lost its data (restarted on an empty folder, or
    another cluster at the same address): every key and lease held before is gone. The
    answer that showed it is not returned: what it says is of the new service."""


class History:
    """What the clients of one user (a group's leader: its threads' clients and
    watches) have seen of etcd: its cluster id and the highest revision. A revision
    never goes back, so an answer with a lower one, or another cluster id, is of an
    etcd that lost its data: ``on_reset(why)`` is called once for it, and the answer
    raises :class:`EtcdReset`. From then on the new service's figures are the ones
    kept. An answer is held to the revision seen before its request was sent (threads'
    answers arrive in any order), so only a service that went back trips it."""

    def __init__(self, on_reset: Callable[[str], None] = lambda why: None):
        self._lock = threading.Lock()
        self._on_reset = on_reset
        self.cluster = ""
        self.revision = 0
        self.resets = 0

    def mark(self) -> tuple[int, int]:
        """What an answer to a request sent now is held to (:meth:`observe`)."""
        with self._lock:
            return self.revision, self.resets

    def observe(self, header: Mapping | None, mark: tuple[int, int]) -> None:
        """An answer's ``header``; ``mark``: :meth:`mark` when its request was sent (a
        request sent before a loss already noticed is not judged again)."""
        if not header or "revision" not in header:
            return
        revision, cluster = int(header["revision"]), str(header.get("cluster_id", ""))
        floor, resets = mark
        with self._lock:
            if resets != self.resets:
                return  # sent before the loss was noticed: its figures may be the old one's
            why = None
            if self.cluster and cluster and cluster != self.cluster:
                why = f"another cluster id ({cluster}, was {self.cluster})"
            elif revision < floor:
                why = f"its revision went back from {floor} to {revision}"
            self.cluster = cluster or self.cluster
            if why is None:
                self.revision = max(self.revision, revision)
                return
            self.revision = revision  # the new service's, from now on
            self.resets += 1
        why = f"etcd lost its data: {why} (restarted on an empty data folder?)"
        logger.warning("paddle_hsdp.ft: %s", why)
        self._on_reset(why)
        raise EtcdReset(f"paddle_hsdp.ft: {why}")


def parse_endpoints(address: str) -> list[tuple[str, int]]:
    """``etcd://h:p[,h:p...]`` (or ``h:p[,...]``) as ``[(host, port), ...]``; a clear
    error for anything else."""
    text = (address or "").strip()
    text = text[len(SCHEME):] if text.startswith(SCHEME) else text
    out: list[tuple[str, int]] = []
    for part in filter(None, text.split(",")):
        host, sep, port = part.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            out = []
            break
        out.append((host.strip("[]"), int(port)))
    if not out:
        raise ValueError("the coordinator's address must be etcd://host:port[,host:port...] "
                         "(the embedded one, `python -m paddle_hsdp.ft.coordinator`, prints "
                         f"it; an existing etcd cluster: its client URLs), got {address!r}")
    return out


@dataclass(frozen=True)
class Security:
    """TLS files and etcd's user (all optional); https once a CA is given."""
    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = None


def security_from_env(environ: Mapping[str, str] | None = None) -> Security:
    env = os.environ if environ is None else environ
    sec = Security(*(env.get(name) or None for name in SECURITY_ENV))
    if (sec.cert is None) != (sec.key is None):
        raise ValueError(f"{CERT_ENV} and {KEY_ENV} go together (a client certificate and "
                         "its key)")
    if (sec.user is None) != (sec.password is None):
        raise ValueError(f"{USER_ENV} and {PASSWORD_ENV} go together")
    return sec


def _b64(text: str | bytes) -> str:
    raw = text.encode() if isinstance(text, str) else text
    return base64.b64encode(raw).decode()


def _text(b64: str | None) -> str:
    return base64.b64decode(b64).decode() if b64 else ""


def prefix_end(prefix: str) -> str:
    """The end of the key range that holds every key starting with ``prefix``."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


class Etcd:
    """A client of the job's etcd. ``timeout_s`` bounds each request. Clients made with
    ``shared=`` another share its connection: one keep-alive HTTP connection carries
    every request of them all, one at a time (each is short: a wait is a watch), and one
    watch stream carries all their watches (:class:`WatchStream`); so a group's leader
    holds two connections to etcd whatever it does (docs/fault-tolerance.md, "One etcd
    client per group"). Safe to use from several threads."""

    def __init__(self, address: str, timeout_s: float = 5.0, security: Security | None = None,
                 away_s: float = 0.0, history: History | None = None,
                 shared: Etcd | None = None):
        self.address = address
        # what this client's user has seen of etcd, to notice a loss of its data (None:
        # not judged here; the group's control plane does, and re-registers)
        self.history = history
        self.endpoints = parse_endpoints(address)
        self.timeout_s = timeout_s
        # how long a call waits for an endpoint to come back (a restarted coordinator,
        # an etcd member replaced), counted once from when none answered
        self.away_s = away_s
        self._gone_since: float | None = None
        self.came_back = float("-inf")  # when a call last found etcd again (monotonic)
        self.security = security or Security()
        self.requests = 0  # every request sent, watches' creations included
        if shared is not None:  # its HTTP sessions (their one connection) and its stream
            self._link = shared._link
        else:
            self._link = _Link([self._client(h, p) for h, p in self.endpoints])
        self._clients = self._link.clients
        self._at = 0  # the endpoint that answered last

    def _client(self, host: str, port: int) -> Etcd3Client:
        sec = self.security
        return Etcd3Client(host, port, protocol="https" if sec.ca else "http",
                           ca_cert=sec.ca, cert_key=sec.key, cert_cert=sec.cert,
                           timeout=self.timeout_s, api_path="/v3/")

    # -------------------------------------------------------------- requests
    def call(self, path: str, payload: dict) -> dict:
        """POST ``payload`` to ``/v3/<path>`` on the first endpoint that answers; while
        none does, again every 0.2 s for up to ``away_s`` (one bound from when the
        service was first found gone, shared by the calls after)."""
        history = self.history
        next_word, mark = 0.0, history.mark() if history else (0, 0)
        while True:
            last = None
            for i in range(len(self._clients)):
                at = (self._at + i) % len(self._clients)
                client = self._clients[at]
                self.requests += 1
                try:
                    with self._link.lock:  # one request at a time: one connection
                        result = client.post(client.get_url(path), json=payload,
                                             headers=self._auth_header(client), **self.tls())
                    if self._gone_since is not None:
                        self.came_back = time.monotonic()
                    self._at, self._gone_since = at, None
                    if history is not None:  # a lease's answers carry it one level down
                        history.observe(result.get("header") or
                                        (result.get("result") or {}).get("header"), mark)
                    return result
                except (ConnectionFailedError, ConnectionTimeoutError) as e:
                    last = e
                except Etcd3Exception as e:
                    text = str(e.detail_text or e)
                    if self._link.token is not None and "auth token" in text:
                        self._link.token = None  # expired (etcd's simple tokens: 5 min idle)
                        return self.call(path, payload)
                    raise EtcdRefused(f"paddle_hsdp.ft: etcd refused {path}: {text}") from None
            now = time.monotonic()
            self._gone_since = self._gone_since or now
            waited = now - self._gone_since
            if waited >= self.away_s:
                raise EtcdUnavailable(
                    f"paddle_hsdp.ft: no etcd endpoint of {self.address} answers "
                    f"({type(last).__name__}: {last}) after {waited:.1f} s: is the coordinator "
                    "(python -m paddle_hsdp.ft.coordinator) or the etcd cluster up?")
            if now >= next_word:
                logger.warning("paddle_hsdp.ft: etcd at %s does not answer; waiting up to %g s "
                               "for it (waited %.0f s)", self.address, self.away_s, waited)
                next_word = now + 10.0
            time.sleep(0.2)

    def tls(self) -> dict:
        """The CA per request: requests lets REQUESTS_CA_BUNDLE override a session's own
        ``verify``, and the job's etcd is signed by the job's CA, not the system's."""
        return {"verify": self.security.ca} if self.security.ca else {}

    def _auth_header(self, client: Etcd3Client) -> dict:
        sec = self.security
        if sec.user is None:
            return {}
        if self._link.token is None:
            self.requests += 1
            self._link.token = client.post(client.get_url("auth/authenticate"), json={
                "name": sec.user, "password": sec.password}, **self.tls())["token"]
        return {"Authorization": self._link.token}

    def put(self, key: str, value: str, lease: int = 0) -> int:
        """Write ``key``; the store's revision after it."""
        payload: dict[str, str | int] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            payload["lease"] = lease
        return int(self.call("kv/put", payload)["header"]["revision"])

    def get(self, key: str) -> str | None:
        return self.get_revision(key)[0]

    def get_revision(self, key: str) -> tuple[str | None, int]:
        """``key``'s value and the revision it was last written at (None, 0 if absent)."""
        kvs = self.call("kv/range", {"key": _b64(key)}).get("kvs", [])
        return (_text(kvs[0].get("value")), int(kvs[0]["mod_revision"])) if kvs else (None, 0)

    def get_lease(self, key: str) -> tuple[str | None, int, int]:
        """``key``'s value, the revision it was last written at and the lease it is
        attached to (0: none); ``(None, 0, 0)`` if absent."""
        kvs = self.call("kv/range", {"key": _b64(key)}).get("kvs", [])
        if not kvs:
            return None, 0, 0
        return (_text(kvs[0].get("value")), int(kvs[0]["mod_revision"]),
                int(kvs[0].get("lease", 0)))

    def swap(self, key: str, revision: int, value: str, lease: int = 0) -> bool:
        """Write ``key`` (with ``lease``, if not 0) only if it was last written at
        ``revision`` (0: absent)."""
        target = ({"target": "MOD", "mod_revision": revision} if revision else
                  {"target": "CREATE", "create_revision": 0})
        put: dict[str, str | int] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            put["lease"] = lease
        result = self.call("kv/txn", {
            "compare": [{"key": _b64(key), "result": "EQUAL", **target}],
            "success": [{"request_put": put}],
            "failure": []})
        return bool(result.get("succeeded"))

    def get_prefix(self, prefix: str, keys_only: bool = False) -> tuple[dict[str, str], int]:
        """Every key under ``prefix`` with its value, and the revision they were read at
        (a watch from the one after misses nothing)."""
        result = self.call("kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)),
                                        "keys_only": keys_only})
        found = {_text(kv["key"]): _text(kv.get("value")) for kv in result.get("kvs", [])}
        return found, int(result["header"]["revision"])

    def create(self, key: str, value: str, lease: int = 0,
               also: dict[str, str] | None = None, over: int = 0) -> int:
        """Write ``key`` (and the ``also`` keys, in the same transaction) only if ``key``
        does not exist (or, with ``over``, was last written at revision ``over``: a
        forged value replaced): the revision it was written at, or 0 if not written."""
        puts = [{"request_put": {"key": _b64(k), "value": _b64(v),
                                 **({"lease": lease} if lease and k == key else {})}}
                for k, v in {key: value, **(also or {})}.items()]
        compare = ({"target": "MOD", "mod_revision": over} if over else
                   {"target": "CREATE", "create_revision": 0})
        result = self.call("kv/txn", {
            "compare": [{"key": _b64(key), "result": "EQUAL", **compare}],
            "success": puts, "failure": []})
        return int(result["header"]["revision"]) if result.get("succeeded") else 0

    def delete(self, key: str, revision: int) -> bool:
        """Delete ``key`` if it was last written at ``revision``: whether it was."""
        result = self.call("kv/txn", {
            "compare": [{"key": _b64(key), "result": "EQUAL", "target": "MOD",
                         "mod_revision": revision}],
            "success": [{"request_delete_range": {"key": _b64(key)}}], "failure": []})
        return bool(result.get("succeeded"))

    def delete_prefix(self, prefix: str) -> None:
        self.call("kv/deleterange", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))})

    def delete_range(self, first: str, end: str) -> int:
        """Delete every key from ``first`` (included) to ``end`` (excluded), in one
        request: how many there were."""
        result = self.call("kv/deleterange", {"key": _b64(first), "range_end": _b64(end)})
        return int(result.get("deleted", 0))

    def count_prefix(self, prefix: str) -> int:
        """How many keys there are under ``prefix`` (etcd counts; nothing is sent)."""
        result = self.call("kv/range", {"key": _b64(prefix),
                                        "range_end": _b64(prefix_end(prefix)),
                                        "count_only": True})
        return int(result.get("count", 0))

    def compact(self, revision: int) -> bool:
        """Drop etcd's history before ``revision`` (the live keys stay; their older
        versions and the deleted keys' tombstones go, and their space in etcd's database
        is reused): whether it did. A revision already compacted (by this call elsewhere,
        or etcd's periodic compaction) is not an error: False."""
        try:
            self.call("kv/compaction", {"revision": revision})
        except EtcdRefused as e:
            if "compacted" in str(e) or "future revision" in str(e):
                return False
            raise
        return True

    def status(self) -> dict:
        """The answering member's status (etcd's maintenance API): ``dbSize`` (the
        database file's bytes), ``dbSizeInUse`` (bytes holding data), ``header`` and
        others, as etcd names them (numbers as JSON strings)."""
        return self.call("maintenance/status", {})

    def grant(self, ttl_s: int) -> int:
        return int(self.call("lease/grant", {"TTL": ttl_s, "ID": 0})["ID"])

    def keep_alive(self, lease: int) -> int:
        """Renew ``lease``; its new TTL, or -1 if it has expired (or was revoked)."""
        return int(self.call("lease/keepalive", {"ID": lease})["result"].get("TTL", -1))

    def revoke(self, lease: int) -> None:
        """Expire ``lease`` now: every key written with it is deleted."""
        try:
            self.call("kv/lease/revoke", {"ID": lease})
        except EtcdRefused as e:  # already expired: nothing to revoke
            logger.debug("paddle_hsdp.ft: revoke of lease %x: %s", lease, e)

    def watch(self, prefix: str, on_event: OnEvent, start_revision: int | None = None,
              no_put: bool = False) -> Watch:
        """Call ``on_event(kind, key, value, revision)`` (kind ``"PUT"`` or ``"DELETE"``)
        for every change under ``prefix`` from ``start_revision`` on, in order, from the
        thread of this client's watch stream (shared by the clients that share its
        connection: :class:`WatchStream`), until the watch is stopped."""
        return self._link.stream(self).add(prefix, on_event, start_revision, no_put)


class _Link:
    """What clients made with ``shared=`` share: the HTTP sessions (one per endpoint;
    requests go one at a time, so each keeps one connection), etcd's auth token and the
    watch stream."""

    def __init__(self, clients: list[Etcd3Client]):
        self.clients = clients
        self.lock = threading.Lock()
        self.token: str | None = None
        self._stream: WatchStream | None = None

    def stream(self, etcd: Etcd) -> WatchStream:
        with self.lock:
            if self._stream is None:
                self._stream = WatchStream(etcd)
            return self._stream


class Watch:
    """One watch of a key range on a :class:`WatchStream` (``ready``: etcd created it)."""

    def __init__(self, stream: WatchStream, number: int, prefix: str, on_event: OnEvent,
                 start_revision: int | None, no_put: bool):
        self._stream, self.number = stream, number
        self._prefix, self._on_event, self._no_put = prefix, on_event, no_put
        self._next = start_revision  # the first revision not delivered yet
        self.stopped = False
        self.ready = threading.Event()  # etcd created it (the first time)

    def create_request(self) -> dict:
        request: dict[str, object] = {"key": _b64(self._prefix),
                                      "range_end": _b64(prefix_end(self._prefix)),
                                      "watch_id": self.number}
        if self._next is not None:
            request["start_revision"] = self._next
        if self._no_put:
            request["filters"] = ["NOPUT"]
        return {"create_request": request}

    def stop(self) -> None:
        """No event is delivered once this returns (from another thread than the
        stream's: one delivering may finish)."""
        self._stream.remove(self)


class WatchStream:
    """Every watch of the clients that share one connection, on ONE HTTP stream to etcd
    (etcd's gateway speaks HTTP/1.1: a stream is a connection, so a group's leader
    holds one however many keys it waits for). etcd's watch stream carries many watches
    (each created with an id of ours; each answer names its watch), but the gateway
    reads a request's body once: so a watch added while the stream runs reopens it
    with every live watch, each from the revision after the last event it delivered
    (nothing missed); a watch stopped is dropped at once here and from etcd at the
    next reopening (its events meanwhile are ignored). A broken stream resumes the
    same way (etcd restarted, another endpoint). The stream's thread runs while a
    watch is live. A watch does not judge whether etcd lost its data (a cluster's
    follower may answer a revision behind the leader's): its owner's requests do, and
    replace the watch (GroupControl.register)."""

    def __init__(self, etcd: Etcd):
        self._etcd = etcd  # counts the creations, answers for auth and TLS
        self._lock = threading.Lock()
        self._watches: dict[int, Watch] = {}  # the live ones, by id
        self._numbers = 0
        self._reopen = False  # a watch was added: reopen with it
        self._response: requests.Response | None = None
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()  # cuts the pause after a broken stream
        self.opened = 0  # streams opened (each a request to etcd)

    def add(self, prefix: str, on_event: OnEvent, start_revision: int | None,
            no_put: bool) -> Watch:
        with self._lock:
            self._numbers += 1  # (0 is the gateway's "no id": not used)
            watch = Watch(self, self._numbers, prefix, on_event, start_revision, no_put)
            self._watches[watch.number] = watch
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="paddle_hsdp-ft-watch")
                self._thread.start()
                return watch
            self._reopen = True
            response = self._response
        self._wake.set()
        _cut(response)  # the stream's thread reopens it with this watch too
        return watch

    def remove(self, watch: Watch) -> None:
        with self._lock:
            watch.stopped = True
            self._watches.pop(watch.number, None)
            if self._watches:
                return
            response, thread = self._response, self._thread
        self._wake.set()
        _cut(response)  # the last one: the stream closes (its thread ends)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2)

    def _run(self) -> None:
        etcd, at = self._etcd, self._etcd._at
        while True:
            with self._lock:
                watches = list(self._watches.values())
                if not watches:
                    self._thread = None
                    return
                self._reopen = False
            client = etcd._clients[at % len(etcd._clients)]
            session = requests.Session()  # a fresh connection: the last one was cut
            session.verify = etcd.security.ca or True
            if etcd.security.cert and etcd.security.key:
                session.cert = (etcd.security.cert, etcd.security.key)
            broke = True  # unless reopened on purpose (a watch added, canceled, the last gone)
            try:
                etcd.requests += len(watches)  # a creation of each
                self.opened += 1
                with etcd._link.lock:
                    headers = etcd._auth_header(client)
                response = session.post(
                    client.get_url("watch"), stream=True, timeout=(etcd.timeout_s, None),
                    data="".join(json.dumps(w.create_request()) for w in watches),
                    headers=headers, **etcd.tls())
                with self._lock:
                    self._response = response
                    done = self._reopen or not self._watches
                if done:
                    broke = False
                else:
                    by_number = {w.number: w for w in watches}
                    for line in response.iter_lines():
                        if line and self._deliver(json.loads(line).get("result", {}),
                                                  by_number):
                            broke = False  # a watch was canceled: reopened from where it is
                            break
                        if self._reopen:
                            broke = False
                            break
            except (requests.RequestException, ConnectionFailedError, ValueError,
                    AttributeError, OSError) as e:
                broke = not self._reopen and bool(self._watches)
                if broke:
                    logger.debug("paddle_hsdp.ft: the watch stream broke (%s); resuming", e)
            finally:
                with self._lock:
                    response, self._response = self._response, None
                if response is not None:
                    response.close()
                session.close()
            if broke:
                at += 1  # the next endpoint (the same one, with a single endpoint)
                self._wake.wait(0.2)
            self._wake.clear()

    def _deliver(self, result: dict, by_number: dict[int, Watch]) -> bool:
        """One answer of the stream; True if a watch was canceled (the stream reopens)."""
        watch = by_number.get(int(result.get("watch_id", 0)))
        if watch is None or watch.stopped:
            return False
        if result.get("created"):
            if watch._next is None:  # from now on: nothing before it was asked for
                watch._next = int(result["header"]["revision"]) + 1
            watch.ready.set()
            return False
        if result.get("canceled"):  # history compacted past its revision: from what is left
            compacted = int(result.get("compact_revision", 0))
            logger.warning("paddle_hsdp.ft: watch of %s lost the events before revision %d "
                           "(compacted)", watch._prefix, compacted)
            if not compacted:  # another reason: the stream breaks, and resumes
                raise ValueError(f"watch of {watch._prefix} canceled: {result}")
            watch._next = compacted
            return True
        for event in result.get("events", []):
            if watch.stopped:
                break
            kv = event["kv"]
            watch._next = int(kv["mod_revision"]) + 1
            watch._on_event(event.get("type", "PUT"), _text(kv["key"]),
                            _text(kv.get("value")), watch._next - 1)
        return False


def _cut(response: requests.Response | None) -> None:
    """Unblock the thread reading ``response`` (its socket shut down)."""
    if response is None:
        return
    try:
        fd = response.raw._fp.fp.raw._sock.fileno()  # noqa: SLF001
        sock = socket.socket(fileno=os.dup(fd))
        sock.shutdown(socket.SHUT_RDWR)
        sock.close()
    except (AttributeError, OSError, ValueError):
        pass


def wait_until_answers(address: str, timeout_s: float, security: Security | None = None) -> None:
    """Return once an endpoint of ``address`` serves requests (EtcdUnavailable after
    ``timeout_s``)."""
    etcd, deadline = Etcd(address, timeout_s=1.0, security=security), time.monotonic() + timeout_s
    while True:
        try:
            etcd.call("maintenance/status", {})
            return
        except (EtcdUnavailable, requests.RequestException) as e:
            if time.monotonic() > deadline:
                raise EtcdUnavailable(f"paddle_hsdp.ft: etcd at {address} did not answer "
                                      f"within {timeout_s:g} s ({e})") from None
            time.sleep(0.1)
