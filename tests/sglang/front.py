"""The HTTP front of a rank process (``tests/sglang/engine.py --http-port``): a stand-in
for SGLang's HTTP server, so that a real router (smg in PD mode) sends it requests, each
of which becomes a real room through SGLang's own classes in that process.

It answers what a router asks a worker (``tests.routers.standin.Answers``: ``/health``,
``/server_info``, ``/model_info``, ``/v1/models``, ``/metrics``) and a request on
``/generate`` (or ``/v1/completions``, ``/v1/chat/completions``) the way smg's PD mode
sends one to a prefill and a decode at once, with ``bootstrap_host``, ``bootstrap_port``
and ``bootstrap_room``:

* prefill: a KVSender for the room; once the decode's metadata is in, the room's page is
  filled with bytes seeded by the room and sent; 200 when SGLang reports Success;
* decode: a KVReceiver from the prefill's bootstrap address (its parallel info fetched
  first, as the decode scheduler does); 200 when it reports Success and the page holds
  the room's bytes.

A room that fails (``KVPoll.Failed``, the bootstrap server unreachable, the wrong bytes)
is HTTP 500 with the reason, so the router retries it; one that has no verdict within
``DEADLINE_S`` is 504 (stock SGLang waits up to 300 s).  A request it cannot read is 400.

Every SGLang call is made from one thread, as SGLang's scheduler makes them: request
threads hand their rooms to it and wait for its verdict.  A room holds one page and the
aux slot of the same index until it concludes; with none free for ``SLOT_WAIT_S``, 503.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tests.routers.standin import GENERATE_PATHS, Answers, Server, answer

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger(__name__)

DEADLINE_S = 30.0
SLOT_WAIT_S = 5.0
POLL_S = 0.002


@dataclass
class Room:
    """One request's room in the scheduler thread: ``conn`` its sender or receiver,
    ``sent`` whether a prefill sent its page; ``ok``/``code``/``reason`` the verdict,
    final once ``done`` is set."""

    room: int
    bootstrap: str
    slot: int
    t0: float
    done: threading.Event = field(default_factory=threading.Event)
    conn: Any = None
    sent: bool = False
    code: int = 0
    reason: str = ""


class Front:
    """The scheduler thread and the HTTP server of one rank process."""

    def __init__(self, eng: Engine, port: int, emit: Callable[..., None]) -> None:
        """``emit``: the rank's event writer (a ``served`` event per room served)."""
        from .engine import AUX_SLOTS
        self.eng, self.emit = eng, emit
        self.free: queue.Queue[int] = queue.Queue()
        for i in range(min(eng.pages, AUX_SLOTS)):
            self.free.put(i)
        self.new: queue.Queue[Room] = queue.Queue()
        self.live: list[Room] = []
        threading.Thread(target=self._loop, name="front-scheduler", daemon=True).start()
        self.server = Server((eng.ip, port), self._handler())
        threading.Thread(target=self.server.serve_forever, name="front-http", daemon=True).start()

    # -- request threads ---------------------------------------------------------------------

    def serve(self, room: int, bootstrap: str) -> Room | None:
        """Run ``room`` to its verdict (None: no free slot within ``SLOT_WAIT_S``)."""
        try:
            slot = self.free.get(timeout=SLOT_WAIT_S)
        except queue.Empty:
            return None
        r = Room(room, bootstrap, slot, time.monotonic())
        try:
            self.new.put(r)
            r.done.wait()  # the scheduler thread concludes every room by its deadline
        finally:
            self.free.put(slot)
        return r

    def _handler(self) -> type[Answers]:
        front = self

        class Api(Answers):
            role, engine_id = front.eng.role, front.eng.bootstrap

            def do_POST(self) -> None:
                try:
                    body = self.json_body()
                except ValueError:
                    return self.reply(400, {"error": "not JSON"})
                if self.path.split("?", 1)[0] not in GENERATE_PATHS:
                    return self.reply(404, {"error": self.path})
                try:
                    req = read_request(body)
                except ValueError as e:
                    return self.reply(400, {"error": str(e)})
                if self.role == "prefill" and req.bootstrap != front.eng.bootstrap:
                    return self.reply(400, {"error": f"bootstrap {req.bootstrap} is not "
                                                     f"this prefill's ({front.eng.bootstrap})"})
                r = front.serve(req.room, req.bootstrap)
                if r is None:
                    return self.reply(503, {"error": "no free KV page"})
                if r.code != 200:
                    return self.reply(r.code, {"error": r.reason})
                return self.reply(200, answer(self.role, self.engine_id))
        return Api

    # -- the scheduler thread ------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            try:
                self._open(self.new.get(timeout=POLL_S if self.live else 0.5))
                while True:
                    self._open(self.new.get_nowait())
            except queue.Empty:
                pass
            for r in list(self.live):
                self._step(r)

    def _conclude(self, r: Room, code: int, reason: str = "") -> None:
        r.code, r.reason = code, reason
        if r in self.live:
            self.live.remove(r)
        r.done.set()
        if code == 200:
            self.emit("served", room=r.room, after_s=time.monotonic() - r.t0)

    def _open(self, r: Room) -> None:
        import numpy as np
        eng = self.eng
        kind = eng.KVClassType.SENDER if eng.role == "prefill" else eng.KVClassType.RECEIVER
        try:
            if eng.role == "decode":
                if not eng.mgr.try_ensure_parallel_info(r.bootstrap):
                    return self._conclude(r, 500, "no parallel info: bootstrap server "
                                                  "unreachable")
                eng.zero(r.slot, 1)
            r.conn = eng.get_kv_class(eng.backend, kind)(eng.mgr, r.bootstrap, r.room)
            if eng.role == "prefill":
                r.conn.init(1, r.slot)
            else:
                r.conn.init(0)
                r.conn.send_metadata(np.array([r.slot], dtype=np.int32), r.slot)
        except Exception as e:  # SGLang raised: the room fails, with why
            log.exception("room %d: SGLang raised", r.room)
            return self._conclude(r, 500, f"{type(e).__name__}: {e}")
        self.live.append(r)

    def _step(self, r: Room) -> None:
        import numpy as np
        from sglang.srt.disaggregation.base import KVPoll

        from .engine import expected_digest
        eng = self.eng
        try:
            st = r.conn.poll()
            if st == KVPoll.Failed:
                return self._conclude(r, 500, self._failure(r))
            if st == KVPoll.Success:
                if eng.role == "decode":
                    r.conn.clear()
                    if eng.digest(r.slot, 1) != expected_digest(r.room, 1):
                        return self._conclude(r, 500, "the room's page holds the wrong bytes")
                return self._conclude(r, 200)
            if eng.role == "prefill" and st == KVPoll.WaitingForInput and not r.sent:
                eng.fill(r.slot, r.room, 1)
                r.conn.send(np.array([r.slot], dtype=np.int32))
                r.sent = True
        except Exception as e:  # SGLang raised: the room fails, with why
            log.exception("room %d: SGLang raised", r.room)
            return self._conclude(r, 500, f"{type(e).__name__}: {e}")
        if time.monotonic() - r.t0 > DEADLINE_S:
            self._conclude(r, 504, f"no verdict from SGLang within {DEADLINE_S:.0f} s")

    def _failure(self, r: Room) -> str:
        if self.eng.role == "prefill":
            return str(self.eng.mgr.failure_records.get(r.room, "failed"))
        try:
            r.conn.failure_exception()
        except Exception as e:  # KVTransferError: what the decode scheduler reports
            return str(e)
        return "failed"


@dataclass(frozen=True)
class Request:
    """What a P/D request names: its room and the prefill's bootstrap "host:port"."""

    room: int
    bootstrap: str


def read_request(body: Any) -> Request:
    """The room and bootstrap address of a P/D request's body (``ValueError``, saying
    why, unless: a loopback bootstrap host, a port, a room that fits SGLang's u64)."""
    if not isinstance(body, dict):
        raise ValueError("not a JSON object")
    host, port, room = body.get("bootstrap_host"), body.get("bootstrap_port"), \
        body.get("bootstrap_room")
    if not isinstance(host, str) or not host.startswith("127."):
        raise ValueError("bootstrap_host is not a loopback address")
    if type(port) is not int or not 0 < port < 65536:
        raise ValueError("bootstrap_port is not a port")
    if type(room) is not int or not 0 <= room < 2 ** 64:
        raise ValueError("bootstrap_room is not a u64")
    return Request(room, f"{host}:{port}")
