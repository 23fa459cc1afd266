"""The instances as JSON over HTTP, beside ``/metrics`` (``shmhb exporter``), for routers
in other languages and for Kubernetes readiness (docs/ROUTERS.md, "The JSON view").

- ``GET /instances``: ``{"schema": 1, "epoch", "revision", "instances": [...]}``, each
  instance as ``Instance.to_json`` (host, key, engine_id, role, url, serving, bootstrap,
  incarnation, status, ranks, draining).  ``?live=1``: only those that read alive and are not draining; the answer is
  then 503 when there are none (a readiness probe).
- ``GET /instances/changes?since=REV&epoch=E[&wait_s=S]``: the changes after revision
  REV, ``{"schema", "epoch", "revision", "changes": [{"revision", "op", "instance"}]}``
  with op ``added``, ``changed`` (status, incarnation or draining) or ``removed``.  ``wait_s`` (at
  most 30) holds the answer until there is a change (a long poll).  A waiting poll looks
  at the board's change counter every ``POLL_S`` (two words) and reads the instances
  only when it moved, or every ``REREAD_S`` (a verdict that ages with time moves no
  counter); it answers early, with what it has, when the server needs its slot for
  another request (``httpserve.PARK``: probes and scrapes always get through).  A reader that
  missed too much (more than ``KEEP`` changes), or whose epoch is not this exporter's
  (it restarted), gets ``"reset": true`` and the whole list in ``instances``; it then
  continues from the ``revision`` given.

The revision counts the changes this exporter saw since it started (``epoch`` names
that run); the board is read on each request, so two changes between two requests may
fold into one.  Query values are validated; a bad one is 400.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from ..board.handle import Board
from ..board.config import board_name
from ..errors import BoardNotFound, ShmhbError
from .gc import shm_path
from .httpserve import PARK
from ..board.instances import Instance, board_instances

__all__ = ["InstanceLog", "KEEP", "SCHEMA", "with_instances"]

SCHEMA = 1
KEEP = 1024
MAX_WAIT_S = 30.0
#: how often a waiting long poll looks at the board's change counter
POLL_S = 0.05
#: how often it reads the instances anyway (verdicts that age with time)
REREAD_S = 1.0


class InstanceLog:
    """The revisioned change log of a list of instances (pure; thread-safe)."""

    def __init__(self, keep: int = KEEP) -> None:
        self.epoch = secrets.token_hex(8)
        self.revision = 0
        self._now: dict[tuple[str, str], Instance] = {}
        self._log: deque[dict[str, Any]] = deque(maxlen=keep)
        self._lock = threading.Lock()

    def update(self, instances: Iterable[Instance]) -> int:
        """Record what changed since the last update; returns the revision."""
        new = {(i.host, i.key): i for i in instances}
        with self._lock:
            for k, i in new.items():
                old = self._now.get(k)
                if old is None:
                    self._add("added", i)
                elif (old.status, old.incarnation, old.serving, old.bootstrap, old.draining) != \
                        (i.status, i.incarnation, i.serving, i.bootstrap, i.draining):
                    self._add("changed", i)
            for k, old in self._now.items():
                if k not in new:
                    self._add("removed", old)
            self._now = new
            return self.revision

    def _add(self, op: str, inst: Instance) -> None:
        self.revision += 1
        self._log.append({"revision": self.revision, "op": op, "instance": inst.to_json()})

    def snapshot(self, live_only: bool = False) -> dict[str, Any]:
        with self._lock:
            insts = [i.to_json() for _, i in sorted(self._now.items())
                     if not live_only or (i.status.value == "alive" and not i.draining)]
            return {"schema": SCHEMA, "epoch": self.epoch, "revision": self.revision,
                    "instances": insts}

    def since(self, revision: int, epoch: str | None) -> dict[str, Any]:
        with self._lock:
            first = self._log[0]["revision"] if self._log else self.revision + 1
            if epoch != self.epoch or revision > self.revision or revision < first - 1:
                out = None
            else:
                out = {"schema": SCHEMA, "epoch": self.epoch, "revision": self.revision,
                       "changes": [c for c in self._log if c["revision"] > revision]}
        if out is None:
            return dict(self.snapshot(), reset=True, changes=[])
        return out


class BoardInstances:
    """Reads one board's instances by name, following it when it is removed or
    recreated (as the metrics collector does)."""

    def __init__(self, name: str | None) -> None:
        self.name = board_name(name)
        self._board: Board | None = None
        self._ino = 0
        self._lock = threading.Lock()

    def read(self) -> list[Instance] | None:
        with self._lock:
            try:
                ino = os.stat(shm_path(self.name)).st_ino
            except FileNotFoundError:
                ino = 0
            if self._board is not None and ino != self._ino:
                self._board.close()
                self._board = None
            if not ino:
                return None
            if self._board is None:
                try:
                    self._board, self._ino = Board.attach(self.name), ino
                except BoardNotFound:
                    return None
            return board_instances(self._board)

    def changes(self) -> int | None:
        """The board's change counter (``Board.changes``: two words), None while no
        board is attached.  A board recreated since is found by the next ``read``."""
        with self._lock:
            return None if self._board is None else self._board.changes()

    def close(self) -> None:
        with self._lock:
            if self._board is not None:
                self._board.close()
                self._board = None


def _reply(start: Callable[..., Any], code: str, doc: Any) -> list[bytes]:
    body = json.dumps(doc).encode()
    start(code, [("Content-Type", "application/json"), ("Content-Length", str(len(body))),
                 ("Cache-Control", "no-store")])
    return [body]


def with_instances(app: Callable[..., Any], source: BoardInstances,
                   log: InstanceLog | None = None) -> Callable[..., Any]:
    """A WSGI app that answers ``/instances`` and ``/instances/changes`` from ``source``
    and hands every other path to ``app``."""
    ilog = log or InstanceLog()

    def wsgi(environ: dict[str, Any], start: Callable[..., Any]) -> Any:
        path = environ.get("PATH_INFO", "")
        if path not in ("/instances", "/instances/changes"):
            return app(environ, start)
        try:
            q = {k: v[-1] for k, v in urllib.parse.parse_qs(
                environ.get("QUERY_STRING", ""), strict_parsing=False).items()}
            since = int(q.get("since", "0"))
            wait_s = float(q.get("wait_s", "0"))
            if since < 0 or not 0 <= wait_s <= MAX_WAIT_S or len(q.get("epoch", "")) > 64:
                raise ValueError
        except ValueError:
            return _reply(start, "400 Bad Request",
                          {"error": "since is a revision (an int >= 0), wait_s seconds in "
                                    f"[0, {MAX_WAIT_S:g}], epoch at most 64 characters"})
        seen = _refresh(source, ilog)
        if seen is None:
            return _reply(start, "503 Service Unavailable",
                          {"schema": SCHEMA, "error": f"board {source.name!r} not found"})
        if path == "/instances":
            live = q.get("live") in ("1", "true")
            doc = ilog.snapshot(live_only=live)
            code = "503 Service Unavailable" if live and not doc["instances"] else "200 OK"
            return _reply(start, code, doc)
        park = environ.get(PARK)
        with park() if park is not None else contextlib.nullcontext(threading.Event()) as now:
            _wait_for_change(source, ilog, since, q.get("epoch"), time.monotonic() + wait_s,
                             seen, now)
        return _reply(start, "200 OK", ilog.since(since, q.get("epoch")))

    return wsgi


def _refresh(source: BoardInstances, ilog: InstanceLog) -> int | None:
    """Reads the instances into the log; the change counter as of before the read
    (-1: no board before it), None when there is no board."""
    try:
        seen = source.changes()
        got = source.read()
    except ShmhbError:
        got = None
    if got is None:
        return None
    ilog.update(got)
    return -1 if seen is None else seen


def _wait_for_change(source: BoardInstances, ilog: InstanceLog, since: int,
                     epoch: str | None, deadline: float, seen: int,
                     now: threading.Event) -> None:
    """Until a change after ``since``, the deadline, or ``now`` is set: the counter
    looked at every ``POLL_S``, the instances read when it moved (or every
    ``REREAD_S``)."""
    reread = time.monotonic() + REREAD_S
    while ilog.revision <= since and epoch == ilog.epoch:
        t = time.monotonic()
        if t >= deadline or now.wait(min(POLL_S, deadline - t)):
            return
        try:
            moved = source.changes() != seen
        except ShmhbError:
            moved = True
        if moved or time.monotonic() >= reread:
            reread = time.monotonic() + REREAD_S
            got = _refresh(source, ilog)
            seen = -1 if got is None else got
