"""The go-ahead a producer asks of its consumer before it writes into the consumer's
blocks, over a small ZMQ side channel of the consumer worker.

Wire (JSON, one frame each way, at most ``MAX_FRAME`` bytes):
  ask:   {"v": 1, "n": nonce, "inc": consumer incarnation, "from": "host:port", "reqs": [id]}
  reply: {"v": 1, "n": nonce, "ok": [id]}
``from`` is the producer's side channel (the endpoint the consumer sent its request to);
``inc`` is the incarnation the consumer put into that request: a consumer that restarted
since (a new incarnation at the same address) grants nothing.  Nothing received is
trusted: sizes, types and lengths are checked, a bad frame is dropped and counted.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from .. import address
from ..errors import InvalidConfig

log = logging.getLogger(__name__)

VERSION = 1
MAX_FRAME = 64 * 1024
MAX_REQS = 1024
MAX_ID_BYTES = 256
_LOG_EVERY_S = 10.0


def check_endpoint(ep: object) -> str:
    """A "host:port" from outside, checked at the project's one address door."""
    return address.check_endpoint(ep)


def _ids(v: object) -> list[str] | None:
    if not isinstance(v, list) or len(v) > MAX_REQS:
        return None
    if not all(isinstance(r, str) and 0 < len(r.encode()) <= MAX_ID_BYTES for r in v):
        return None
    return v


def decode_ask(frame: bytes) -> tuple[int, int, str, list[str]] | None:
    if len(frame) > MAX_FRAME:
        return None
    try:
        m = json.loads(frame)
    except ValueError:
        return None
    if not isinstance(m, dict) or m.get("v") != VERSION:
        return None
    n, inc, frm, reqs = m.get("n"), m.get("inc"), m.get("from"), _ids(m.get("reqs"))
    if not isinstance(n, int) or not isinstance(inc, int) or reqs is None:
        return None
    try:
        frm = check_endpoint(frm)
    except InvalidConfig:
        return None
    return n, inc, frm, reqs


def decode_reply(frame: bytes, nonce: int) -> list[str] | None:
    if len(frame) > MAX_FRAME:
        return None
    try:
        m = json.loads(frame)
    except ValueError:
        return None
    if not isinstance(m, dict) or m.get("v") != VERSION or m.get("n") != nonce:
        return None
    return _ids(m.get("ok"))


class FenceServer:
    """The consumer worker's side: answers asks with ``grant(from, reqs)`` when ``inc``
    is ours.  One thread, one ROUTER socket."""

    def __init__(self, host: str, incarnation: int,
                 grant: Callable[[str, list[str]], list[str]]) -> None:
        self.incarnation = incarnation
        self._grant = grant
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
        self.bad_frames = 0
        self.asks = 0
        self._last_log = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shmhb-fence", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(100):
                    continue
                frames = self._sock.recv_multipart()
                if len(frames) != 2:
                    self._bad("frame count")
                    continue
                ask = decode_ask(frames[1])
                if ask is None:
                    self._bad("malformed ask")
                    continue
                n, inc, frm, reqs = ask
                self.asks += 1
                ok = self._grant(frm, reqs) if inc == self.incarnation else []
                self._sock.send_multipart([frames[0], json.dumps(
                    {"v": VERSION, "n": n, "ok": ok}).encode()])
        except zmq.ContextTerminated:
            pass
        finally:
            self._sock.close(0)

    def _bad(self, why: str) -> None:
        self.bad_frames += 1
        now = time.monotonic()
        if now - self._last_log >= _LOG_EVERY_S:
            self._last_log = now
            log.warning("fence server %s: dropped a bad frame (%s; %d so far)",
                        self.endpoint, why, self.bad_frames)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self._ctx.term()


async def ask_grant(ctx: zmq.asyncio.Context, endpoint: str, incarnation: int, producer: str,
                    req_ids: list[str], timeout_s: float) -> list[str]:
    """The producer's side: which of ``req_ids`` the consumer at ``endpoint`` still
    wants.  Any failure (unreachable, timeout, bad reply) is "none": a write the consumer
    did not confirm is a write into blocks it may have given up."""
    nonce = int.from_bytes(os.urandom(6), "little")
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
    try:
        sock.connect(f"tcp://{endpoint}")
        await sock.send(json.dumps({"v": VERSION, "n": nonce, "inc": incarnation,
                                    "from": producer, "reqs": req_ids}).encode())
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not await sock.poll(int(left * 1000) + 1):
                log.warning("no go-ahead from consumer %s within %.1f s: not writing %d request(s)",
                            endpoint, timeout_s, len(req_ids))
                return []
            ok = decode_reply(await sock.recv(), nonce)
            if ok is not None:
                asked = set(req_ids)
                return [r for r in ok if r in asked]
    except zmq.ZMQError as e:
        log.warning("asking consumer %s for a go-ahead failed: %s", endpoint, e)
        return []
    finally:
        sock.close(0)


def parse_extra(v: Any) -> tuple[int, str] | None:
    """The consumer's incarnation and fence endpoint as its request carried them."""
    if not isinstance(v, dict):
        return None
    inc, fence = v.get("inc"), v.get("fence")
    if not isinstance(inc, int) or inc <= 0:
        return None
    try:
        return inc, check_endpoint(fence)
    except InvalidConfig:
        return None
