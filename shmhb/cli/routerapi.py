"""The worker-list APIs of the routers ``shmhb feed`` keeps in step with the board.

- **sglang-router** (the SGLang model gateway, ``sglang-router launch``): ``GET /workers``
  lists ``{id, url, worker_type, bootstrap_port}``; ``DELETE /workers/{id}`` and
  ``POST /workers {url, worker_type, bootstrap_port}`` take effect in the background
  (202), within milliseconds.
- **vllm-router** (``vllm-router``, PD mode): ``GET /workers`` lists ``{url, worker_type,
  bootstrap_port}``; ``DELETE /workers/{url}`` removes one at once.  In PD mode it adds
  no worker over HTTP (``POST /workers`` answers 400 "PD router requires specific
  add_prefill_server or add_decode_server methods", and no such route exists in 0.1.17),
  and it queries a prefill's engine id from its bootstrap server once, at startup: a
  removed instance comes back only when the router restarts.
- **smg** (the gateway that continues sglang-router's line, ``smg launch``): the same
  list, with ``is_healthy`` per worker (one listed with ``status`` ``draining``, a drain
  reported elsewhere under load and never seen here, is taken as removed).  ``DELETE /workers/{id}`` (202)
  removes the worker (1.13.0, measured: gone from the list within half a second, with
  or without requests in flight).  ``POST /workers`` of a URL it lists answers 409
  ``WORKER_ALREADY_EXISTS`` (``PUT /workers/{id}`` replaces it); of a URL whose
  registration is still running (its first health check failed: retried only every
  30 s) 409 ``WORKER_CREATE_IN_PROGRESS``, which a ``DELETE /workers/{id}`` cancels.  So
  this client replaces a listed worker with ``PUT`` and cancels a stuck registration
  before posting again; the workers it adds carry a drain time of 0 (a dead worker has
  nothing to drain).  It has no ``PATCH`` of a worker (405).

Bodies are not trusted: a worker list that is not the expected JSON, or an entry whose
URL is not ``http://host:port``, raises ``RouterError`` (the entry is skipped).  Only
plain HTTP to the router's own address; no redirects are followed.
"""

from __future__ import annotations

import http.client
import json
import re
import urllib.parse
from typing import Any, NamedTuple, Protocol

from ..board.address import check_endpoint, parse_address
from ..errors import InvalidAddress, InvalidConfig, ShmhbError

__all__ = ["KINDS", "RouterClient", "RouterError", "RouterWorker", "SglangRouter", "SmgRouter",
           "VllmRouter", "client_for", "smg_conflict", "worker_endpoint"]

#: the largest worker list read (bytes): a router with thousands of workers fits
MAX_BODY = 4 << 20
#: the worker id in smg's 409 message ("... with ID <id>. ...")
_ID_IN = re.compile(r"with ID ([0-9A-Za-z-]{1,100})")


class RouterError(ShmhbError, ConnectionError):
    """The router could not be reached, answered an error, or sent what is not a worker
    list; the feeder retries with backoff."""


class RouterWorker(NamedTuple):
    url: str              # "http://host:port", as the router lists it
    role: str             # prefill, decode or regular
    bootstrap_port: int | None
    id: str               # what DELETE takes (sglang, smg: its uuid; vllm-router: the url)
    healthy: bool = True  # the router routes to it (smg: healthy and ready; else listed)


def worker_endpoint(url: str) -> str:
    """"host:port" of ``http://host:port``; ``InvalidAddress`` otherwise."""
    if not isinstance(url, str) or not url.startswith("http://"):
        raise InvalidAddress(f"a worker URL is http://host:port, got {url!r}")
    return check_endpoint(url[len("http://"):].rstrip("/"))


class RouterClient(Protocol):
    kind: str
    base: str

    def workers(self) -> list[RouterWorker]: ...

    def remove(self, w: RouterWorker) -> None: ...

    def can_add(self, role: str) -> bool: ...

    def add(self, url: str, role: str, bootstrap_port: int | None) -> str | None:
        """Add a worker; returns the id the router gave it (None: its url)."""

    #: whether ``add`` of a listed but unhealthy worker replaces it (else it is not tried)
    replaces: bool


class _Http:
    def __init__(self, base: str, timeout_s: float) -> None:
        ep = worker_endpoint(base)
        a = parse_address(ep, need_port=True)
        self.base = f"http://{ep}"
        self._host, self._port = a.host.strip("[]"), int(a.port or 0)
        self.timeout_s = timeout_s

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        """(HTTP status, body) of one call; ``RouterError`` when there is no answer."""
        conn = http.client.HTTPConnection(self._host, self._port, timeout=self.timeout_s)
        try:
            data = None if body is None else json.dumps(body).encode()
            headers = {"content-type": "application/json"} if data is not None else {}
            conn.request(method, path, body=data, headers=headers)
            r = conn.getresponse()
            out = r.read(MAX_BODY + 1)
            if len(out) > MAX_BODY:
                raise RouterError(f"{self.base}{path}: answer over {MAX_BODY} bytes")
            return r.status, out
        except (OSError, http.client.HTTPException) as e:
            raise RouterError(f"{method} {self.base}{path}: {e}") from e
        finally:
            conn.close()

    def ok(self, method: str, path: str, body: Any = None) -> bytes:
        status, out = self.call(method, path, body)
        if not 200 <= status < 300:
            raise RouterError(f"{method} {self.base}{path}: HTTP {status}: "
                              f"{out[:200].decode(errors='replace')}")
        return out

    def list(self) -> list[dict[str, Any]]:
        try:
            doc = json.loads(self.ok("GET", "/workers"))
        except ValueError as e:
            raise RouterError(f"{self.base}/workers: not JSON ({e})") from None
        ws = doc.get("workers") if isinstance(doc, dict) else None
        if not isinstance(ws, list):
            raise RouterError(f"{self.base}/workers: no 'workers' list")
        return [w for w in ws if isinstance(w, dict)]


def _parse(w: dict[str, Any], ident: object, healthy: bool = True) -> RouterWorker | None:
    url, role, bp = w.get("url"), w.get("worker_type"), w.get("bootstrap_port")
    try:
        url = f"http://{worker_endpoint(url)}"  # type: ignore[arg-type]
    except InvalidAddress:
        return None
    if not isinstance(role, str) or not isinstance(ident, str) or not ident:
        return None
    if bp is not None and (isinstance(bp, bool) or not isinstance(bp, int) or not 0 < bp < 65536):
        bp = None
    return RouterWorker(url, role, bp, ident, healthy)


def _worker_id(out: bytes) -> str | None:
    try:
        ident = json.loads(out).get("worker_id")
    except (ValueError, AttributeError):
        return None
    return ident if isinstance(ident, str) and 0 < len(ident) <= 200 else None


class SglangRouter:
    kind = "sglang"

    def __init__(self, base: str, timeout_s: float = 1.0) -> None:
        self._h = _Http(base, timeout_s)
        self.base = self._h.base

    def workers(self) -> list[RouterWorker]:
        return [rw for w in self._h.list() if (rw := _parse(w, w.get("id"))) is not None]

    def remove(self, w: RouterWorker) -> None:
        self._h.ok("DELETE", "/workers/" + urllib.parse.quote(w.id, safe=""))

    def can_add(self, role: str) -> bool:
        return role in ("prefill", "decode", "regular")

    def add(self, url: str, role: str, bootstrap_port: int | None) -> str | None:
        body: dict[str, Any] = {"url": url, "worker_type": role}
        if bootstrap_port is not None:
            body["bootstrap_port"] = bootstrap_port
        return _worker_id(self._h.ok("POST", "/workers", body))

    replaces = False


class SmgRouter:
    kind = "smg"
    replaces = True
    #: per-worker settings this client gives every worker it adds
    HEALTH = {"drain_settle_secs": 0}

    def __init__(self, base: str, timeout_s: float = 1.0) -> None:
        self._h = _Http(base, timeout_s)
        self.base = self._h.base

    def workers(self) -> list[RouterWorker]:
        """The listed workers, less those draining (on their way out: removed already)."""
        return [rw for w in self._h.list() if w.get("status") != "draining"
                and (rw := _parse(w, w.get("id"), w.get("is_healthy") is True
                                  and w.get("status") in (None, "ready"))) is not None]

    def _path(self, ident: str) -> str:
        return "/workers/" + urllib.parse.quote(ident, safe="")

    def remove(self, w: RouterWorker) -> None:
        self._h.ok("DELETE", self._path(w.id))

    def can_add(self, role: str) -> bool:
        return role in ("prefill", "decode", "regular")

    def _listed_id(self, url: str) -> str | None:
        return next((w.id for w in self.workers() if w.url == url), None)

    def add(self, url: str, role: str, bootstrap_port: int | None) -> str | None:
        """POST; a 409 for a listed worker is a PUT to its id (a restart met it still
        listed, draining or unhealthy); a 409 for a registration still running (its
        engine's HTTP server did not answer yet) cancels it and posts once more."""
        body: dict[str, Any] = {"url": url, "worker_type": role, "health": self.HEALTH}
        if bootstrap_port is not None:
            body["bootstrap_port"] = bootstrap_port
        for _ in range(2):
            status, out = self._h.call("POST", "/workers", body)
            if 200 <= status < 300:
                return _worker_id(out)
            code, ident = smg_conflict(out) if status == 409 else (None, None)
            if code == "WORKER_ALREADY_EXISTS":
                ident = self._listed_id(url) or ident
                if ident is None:
                    continue  # gone meanwhile: post again
                self._h.ok("PUT", self._path(ident), body)
                return ident
            if code == "WORKER_CREATE_IN_PROGRESS" and ident is not None:
                self._h.ok("DELETE", self._path(ident))
                continue
            break
        raise RouterError(f"POST {self.base}/workers {url}: HTTP {status}: "
                          f"{out[:200].decode(errors='replace')}")


def smg_conflict(out: bytes) -> tuple[str | None, str | None]:
    """(code, worker id) of smg's 409 answer: the id is the one its message names."""
    try:
        doc = json.loads(out)
    except ValueError:
        return None, None
    if not isinstance(doc, dict):
        return None, None
    code, msg = doc.get("code"), doc.get("error")
    ident = None
    if isinstance(msg, str):
        m = _ID_IN.search(msg)
        ident = m.group(1) if m else None
    return (code if isinstance(code, str) else None), ident


class VllmRouter:
    kind = "vllm"

    def __init__(self, base: str, timeout_s: float = 1.0) -> None:
        self._h = _Http(base, timeout_s)
        self.base = self._h.base

    def workers(self) -> list[RouterWorker]:
        return [rw for w in self._h.list() if (rw := _parse(w, w.get("url"))) is not None]

    def remove(self, w: RouterWorker) -> None:
        self._h.ok("DELETE", "/workers/" + urllib.parse.quote(w.id, safe=""))

    def can_add(self, role: str) -> bool:
        return role == "regular"  # PD mode: no worker can be added over HTTP

    def add(self, url: str, role: str, bootstrap_port: int | None) -> str | None:
        self._h.ok("POST", "/add_worker?url=" + urllib.parse.quote(url, safe=""))
        return None

    replaces = False


KINDS: dict[str, type[SglangRouter] | type[SmgRouter] | type[VllmRouter]] = {
    "sglang": SglangRouter, "smg": SmgRouter, "vllm": VllmRouter}


def client_for(kind: str, base: str, timeout_s: float = 1.0) -> RouterClient:
    """A client for router ``kind`` ("vllm", "sglang" or "smg") at ``base`` (http://host:port)."""
    cls = KINDS.get(kind)
    if cls is None:
        raise InvalidConfig(f"router kind is one of {sorted(KINDS)}, got {kind!r}")
    return cls(base, timeout_s)
