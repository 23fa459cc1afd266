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

Bodies are not trusted: a worker list that is not the expected JSON, or an entry whose
URL is not ``http://host:port``, raises ``RouterError`` (the entry is skipped).  Only
plain HTTP to the router's own address; no redirects are followed.
"""

from __future__ import annotations

import http.client
import json
import urllib.parse
from typing import Any, NamedTuple, Protocol

from ..board.address import check_endpoint, parse_address
from ..errors import InvalidAddress, InvalidConfig, ShmhbError

__all__ = ["KINDS", "RouterClient", "RouterError", "RouterWorker", "client_for", "worker_endpoint"]

#: the largest worker list read (bytes): a router with thousands of workers fits
MAX_BODY = 4 << 20


class RouterError(ShmhbError, ConnectionError):
    """The router could not be reached, answered an error, or sent what is not a worker
    list; the feeder retries with backoff."""


class RouterWorker(NamedTuple):
    url: str              # "http://host:port", as the router lists it
    role: str             # prefill, decode or regular
    bootstrap_port: int | None
    id: str               # what DELETE takes (sglang: its uuid; vllm-router: the url)


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


class _Http:
    def __init__(self, base: str, timeout_s: float) -> None:
        ep = worker_endpoint(base)
        a = parse_address(ep, need_port=True)
        self.base = f"http://{ep}"
        self._host, self._port = a.host.strip("[]"), int(a.port or 0)
        self.timeout_s = timeout_s

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
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


def _parse(w: dict[str, Any], ident: object) -> RouterWorker | None:
    url, role, bp = w.get("url"), w.get("worker_type"), w.get("bootstrap_port")
    try:
        url = f"http://{worker_endpoint(url)}"  # type: ignore[arg-type]
    except InvalidAddress:
        return None
    if not isinstance(role, str) or not isinstance(ident, str) or not ident:
        return None
    if bp is not None and (isinstance(bp, bool) or not isinstance(bp, int) or not 0 < bp < 65536):
        bp = None
    return RouterWorker(url, role, bp, ident)


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
        out = self._h.ok("POST", "/workers", body)
        try:
            ident = json.loads(out).get("worker_id")
        except (ValueError, AttributeError):
            return None
        return ident if isinstance(ident, str) and 0 < len(ident) <= 200 else None


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


KINDS: dict[str, type[SglangRouter] | type[VllmRouter]] = {"sglang": SglangRouter, "vllm": VllmRouter}


def client_for(kind: str, base: str, timeout_s: float = 1.0) -> RouterClient:
    """A client for router ``kind`` ("vllm" or "sglang") at ``base`` (http://host:port)."""
    cls = KINDS.get(kind)
    if cls is None:
        raise InvalidConfig(f"router kind is one of {sorted(KINDS)}, got {kind!r}")
    return cls(base, timeout_s)
