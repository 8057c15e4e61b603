"""A client of the job's etcd, the control plane of fault tolerance (Paddle-free).

It speaks etcd's HTTP/JSON gateway (``/v3/...``) through ``etcd3gw``'s client, so
nothing here needs gRPC or a protobuf that could clash with Paddle's. It adds what the
protocol (:mod:`.protocol`) needs and the library leaves out: several endpoints (a
3-member cluster: a call that cannot reach one tries the next), clients that share one
connection for their requests and hand each other the events of one watch, a watch that
resumes from the revision after the last event it delivered when its stream breaks, a
:class:`History` that notices an etcd that lost its data (its revision went back), and a
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
    ``shared=`` another share its connection (a *link*): one keep-alive HTTP connection
    carries every request of them all, one at a time (each is short: a wait is a
    watch), and the keys one of them watches for all (:meth:`relay_events`: a group's
    control keys) reach the others' waits in-process (:meth:`listen`), so a group's
    leader holds two connections to etcd (docs/fault-tolerance.md, "One etcd client per
    group"). Safe to use from several threads."""

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
        self._link: _Link
        if shared is not None:  # its HTTP sessions (their one connection), its listeners
            self._link = shared._link
        else:
            self._link = _Link([self._client(h, p) for h, p in self.endpoints])
        self._clients = self._link.clients
        self._at = 0  # the endpoint that answered last

    def _client(self, host: str, port: int) -> Etcd3Client:
        sec = self.security
        client = Etcd3Client(host, port, protocol="https" if sec.ca else "http",
                             ca_cert=sec.ca, cert_key=sec.key, cert_cert=sec.cert,
                             timeout=self.timeout_s, api_path="/v3/")
        # etcd is reached directly, its CA the job's (tls()): nothing from the
        # environment (proxies, ~/.netrc, a CA bundle), which requests otherwise looks up
        # on every request (a stat of ~/.netrc each: 15% of tools/sim_ft.py's CPU)
        client.session.trust_env = False
        return client

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
              no_put: bool = False, end: str | None = None) -> Watch:
        """Call ``on_event(kind, key, value, revision)`` (kind ``"PUT"`` or ``"DELETE"``)
        for every change under ``prefix`` (or, with ``end``, of every key from
        ``prefix`` up to ``end``, excluded) from ``start_revision`` on, in order, on a
        thread of its own (and an HTTP stream of its own: one connection), until the
        watch is stopped."""
        return Watch(self, prefix, on_event, start_revision, no_put, end)

    # what a watch of the link's keys hands on to its other clients (ft/kv.py's waits
    # for keys the group's one watch already carries: no stream of their own)
    def relay_events(self, first: str, end: str) -> None:
        """This link's watch of the keys from ``first`` to ``end`` is live: its events
        go to :meth:`listen`'s callbacks (:meth:`dispatch`)."""
        with self._link.listening:
            self._link.relayed = (first, end)

    def relays(self, key: str) -> bool:
        """Whether a live watch of this link carries ``key``'s events (:meth:`listen`)."""
        first, end = self._link.relayed or ("", "")
        return first <= key < end

    def listen(self, key: str, on_event: OnEvent) -> Callable[[], None]:
        """Call ``on_event`` for each change of ``key`` the link's watch delivers; the
        returned function stops it."""
        with self._link.listening:
            self._link.listeners.setdefault(key, []).append(on_event)

        def stop() -> None:
            with self._link.listening:
                callbacks = self._link.listeners.get(key, [])
                if on_event in callbacks:
                    callbacks.remove(on_event)
                if not callbacks:
                    self._link.listeners.pop(key, None)
        return stop

    def dispatch(self, kind: str, key: str, value: str, revision: int) -> None:
        """An event of the link's watch, to the callbacks listening to its key."""
        with self._link.listening:
            callbacks = list(self._link.listeners.get(key, ()))
        for on_event in callbacks:
            on_event(kind, key, value, revision)


class _Link:
    """What clients made with ``shared=`` share: the HTTP sessions (one per endpoint;
    requests go one at a time, so each keeps one connection), etcd's auth token, and
    the range of keys one of them watches for all (``relayed``) with its listeners."""

    def __init__(self, clients: list[Etcd3Client]):
        self.clients = clients
        self.lock = threading.Lock()
        self.token: str | None = None
        self.listening = threading.Lock()  # (not the requests': one may take seconds)
        self.relayed: tuple[str, str] | None = None
        self.listeners: dict[str, list[OnEvent]] = {}



class Watch:
    """A watch of a key range that outlives a broken stream (etcd restarted, another
    endpoint): it resumes from the revision after the last event it delivered."""

    def __init__(self, etcd: Etcd, prefix: str, on_event: OnEvent, start_revision: int | None,
                 no_put: bool, end: str | None = None):
        self._owner = etcd  # counts the requests
        # fails at once: retried. A watch does not judge whether etcd lost its data (a
        # cluster's follower may answer a revision behind the leader's): its owner's
        # requests do, and replace the watch (GroupControl.register)
        self._etcd = Etcd(etcd.address, etcd.timeout_s, etcd.security)
        self._prefix, self._on_event = prefix, on_event
        self._end = prefix_end(prefix) if end is None else end
        self._next = start_revision  # the first revision not delivered yet
        self._no_put = no_put
        self._stopped = threading.Event()
        self._response: requests.Response | None = None
        self.ready = threading.Event()  # the first stream is created
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"paddle_hsdp-ft-watch {prefix}")
        self._thread.start()

    def _create_request(self) -> dict:
        request: dict[str, object] = {"key": _b64(self._prefix), "range_end": _b64(self._end)}
        if self._next is not None:
            request["start_revision"] = self._next
        if self._no_put:
            request["filters"] = ["NOPUT"]
        return {"create_request": request}

    def _run(self) -> None:
        etcd, at = self._etcd, self._owner._at
        while not self._stopped.is_set():
            client = etcd._clients[at % len(etcd._clients)]
            try:
                self._owner.requests += 1
                with self._owner._link.lock:
                    headers = self._owner._auth_header(client)
                self._response = client.session.post(
                    client.get_url("watch"), json=self._create_request(), stream=True,
                    timeout=(etcd.timeout_s, None), headers=headers, **etcd.tls())
                for line in self._response.iter_lines():
                    if self._stopped.is_set():
                        return
                    if line:
                        self._deliver(json.loads(line).get("result", {}))
            except (requests.RequestException, ConnectionFailedError, ValueError,
                    AttributeError, OSError) as e:
                if self._stopped.is_set():
                    return
                logger.debug("paddle_hsdp.ft: watch of %s broke (%s); resuming", self._prefix, e)
            at += 1  # the next endpoint (the same one, with a single endpoint)
            self._stopped.wait(0.2)

    def _deliver(self, result: dict) -> None:
        if result.get("created"):
            if self._next is None:  # from now on: nothing before it was asked for
                self._next = int(result["header"]["revision"]) + 1
            self.ready.set()
            return
        if result.get("canceled"):  # history compacted past our revision: from what is left
            compacted = int(result.get("compact_revision", 0))
            logger.warning("paddle_hsdp.ft: watch of %s lost the events before revision %d "
                           "(compacted)", self._prefix, compacted)
            self._next = compacted or None
            raise ValueError("watch canceled")
        for event in result.get("events", []):
            kv = event["kv"]
            self._next = int(kv["mod_revision"]) + 1
            self._on_event(event.get("type", "PUT"), _text(kv["key"]), _text(kv.get("value")),
                           self._next - 1)

    def stop(self) -> None:
        self._stopped.set()
        response = self._response
        if response is not None:  # unblock the reading thread
            try:
                fd = response.raw._fp.fp.raw._sock.fileno()  # noqa: SLF001
                sock = socket.socket(fileno=os.dup(fd))
                sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            except (AttributeError, OSError, ValueError):
                pass
            response.close()
        self._thread.join(timeout=2)
        for client in self._etcd._clients:  # its connections (a dead one stays pooled)
            client.session.close()


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
