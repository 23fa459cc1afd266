"""Hostile processes the chaos harness starts (``python -m tests.chaos.actors KIND ...``).

``liar IP PORT``
    A followed host that lies: a ROUTER at IP:PORT answering pings with a digest that
    lists its own worker and, ALIVE, the endpoints of other hosts' workers (set by a
    ``{"claim": [...]}`` line on stdin).  ``{"flood": S}``: for S seconds, push 64 new
    keys per push to every watcher, as fast as it can.  ``{"relay": S, "to": ADDR}``:
    for S seconds, answer each ping with the ack the host at ADDR gives to the same
    nonce.  Prints one JSON line per command done.
``flood IP PORT N``
    Keeps up to N TCP connections open to IP:PORT, every other one sending half a ZMTP
    greeting and then nothing, reconnecting those the server drops; exits on stdin EOF.
``badconfig VARIANT IP PORT TMP``
    A throwaway host (own board) whose pinger cannot run as configured (VARIANT:
    port_in_use, secret_missing, secret_readable, curve_missing, foreign_listen): it
    must report itself degraded, exit 4 from ``shmhb status``, see a local SIGKILL DEAD
    within 1 s, and stop at once on SIGTERM.  Prints ``{"ok": ..., "why": ...}``.
"""

from __future__ import annotations

import json
import os
import random
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

import zmq

from shmhb.net.protocol import Ack, DigestEntry, Identity, Ping, Push, decode, encode_ack, encode_ping, encode_push
from ..children import child
from ..stopping import end

ALIVE = 1


def liar(ip: str, port: int) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    r = ctx.socket(zmq.ROUTER)
    r.setsockopt(zmq.LINGER, 0)
    r.setsockopt(zmq.SNDHWM, 256)
    r.bind(f"tcp://{ip}:{port}")
    me = Identity(os.urandom(16), random.getrandbits(62) | 1)
    addr = f"{ip}:{port}"
    claims: list[str] = []
    cmds: list[dict[str, Any]] = []
    lock = threading.Lock()

    def stdin() -> None:
        for line in sys.stdin:
            with lock:
                cmds.append(json.loads(line))
        os._exit(0)
    threading.Thread(target=stdin, daemon=True).start()
    watchers: dict[bytes, float] = {}
    flood_until = relay_until = 0.0
    relay: zmq.Socket[Any] | None = None
    gen = 1
    seq = time.time_ns()
    print("ready", flush=True)
    while True:
        with lock:
            todo, cmds[:] = list(cmds), []
        for c in todo:
            if "claim" in c:
                claims = list(c["claim"])
                gen += 1
            if "flood" in c:
                flood_until = time.monotonic() + float(c["flood"])
            if "relay" in c:
                relay_until = time.monotonic() + float(c["relay"])
                if relay is not None:
                    relay.close(0)
                relay = ctx.socket(zmq.DEALER)
                relay.setsockopt(zmq.LINGER, 0)
                relay.connect(f"tcp://{c['to']}")
            print(json.dumps({"done": c}), flush=True)
        now = time.monotonic()
        if now < flood_until and watchers:
            seq += 1
            push = encode_push(Push(me, addr, seq, gen, tuple(
                DigestEntry(f"liar-flood-{seq}-{j}", 1, 3, 4242, 0, (f"{ip}:{40000 + j}",))
                for j in range(64))))
            for rid in list(watchers):
                try:
                    r.send_multipart([rid, push], zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        if not r.poll(0 if now < flood_until else 20):
            continue
        rid, frame = r.recv_multipart()
        try:
            msg = decode(frame)
        except Exception:  # noqa: BLE001 - a liar does not care
            continue
        if not isinstance(msg, Ping):
            continue
        watchers[rid] = now
        if relay is not None and now < relay_until:
            relay.send(encode_ping(Ping(Identity(os.urandom(16), 7), "127.0.0.1:1", msg.nonce)))
            if relay.poll(500):
                r.send_multipart([rid, relay.recv()])
            continue
        entries = [DigestEntry("liar-0", 1, ALIVE, 4242, 0, (f"{ip}:30000",))]
        entries += [DigestEntry(f"liar-spoof-{k}", 1, ALIVE, 4242, 0, (ep,))
                    for k, ep in enumerate(claims[:200])]
        r.send_multipart([rid, encode_ack(Ack(msg.nonce, me, addr, gen, True, tuple(entries)))])


def flood(ip: str, port: int, n: int) -> None:
    sel = selectors.DefaultSelector()
    done = threading.Event()

    def stdin() -> None:
        sys.stdin.read()
        done.set()
    threading.Thread(target=stdin, daemon=True).start()

    def one(k: int) -> None:
        s = socket.socket()
        s.setblocking(False)
        try:
            s.connect((ip, port))
        except BlockingIOError:
            pass
        except OSError:
            s.close()
            return
        sel.register(s, selectors.EVENT_READ | selectors.EVENT_WRITE, k)
    for k in range(n):
        one(k)
    print("ready", flush=True)
    while not done.is_set():
        for key, ev in sel.select(0.05):
            s, k = key.fileobj, key.data
            assert isinstance(s, socket.socket)
            if ev & selectors.EVENT_WRITE:
                sel.modify(s, selectors.EVENT_READ, k)
                if k % 2:
                    try:
                        s.send(bytes([0xFF]) + bytes(8) + bytes([0x7F]))  # half a greeting
                    except OSError:
                        pass
            else:
                try:
                    data = s.recv(4096)
                except OSError:
                    data = b""
                if not data:
                    sel.unregister(s)
                    s.close()
                    one(k)


def _shmhb(*args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shmhb", *args], capture_output=True,
                          text=True, timeout=60, **kw)


def badconfig(variant: str, ip: str, port: int, tmp: str) -> dict[str, Any]:
    import shmhb
    from shmhb.net.settings import store_config

    name = f"shmhb-chaos-bad-{uuid.uuid4().hex[:8]}"
    board = shmhb.Board.create(name, slots=8)
    procs: list[subprocess.Popen[Any]] = []
    blocker: socket.socket | None = None
    try:
        listen, secret, curve = f"{ip}:{port}", None, None
        if variant == "port_in_use":
            blocker = socket.socket()
            blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            blocker.bind((ip, port))
            blocker.listen(1)
        elif variant in ("secret_missing", "secret_readable"):
            secret = os.path.join(tmp, f"{name}.secret")
            fd = os.open(secret, os.O_WRONLY | os.O_CREAT, 0o600)
            os.write(fd, b"chaos-secret-0123456789abcdef!!")
            os.close(fd)
            if variant == "secret_missing":
                os.unlink(secret)
            else:
                os.chmod(secret, 0o644)
        elif variant == "curve_missing":
            curve = os.path.join(tmp, f"{name}.curve")
            os.makedirs(curve)
        elif variant == "foreign_listen":
            listen = f"192.0.2.1:{port}"  # TEST-NET-1: never local
        store_config(board, shmhb.PingerConfig(listen=listen, secret_file=secret, curve_keys=curve))
        p = subprocess.Popen([sys.executable, "-m", "shmhb", "pinger", "--board", name,
                              "--tick-s", "0.02"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        procs.append(p)
        deadline = time.monotonic() + 20
        while board.network().state != "degraded":
            if time.monotonic() > deadline or p.poll() is not None:
                return {"ok": False, "why": f"not degraded: {board.network()} rc {p.poll()}"}
            time.sleep(0.01)
        rc = _shmhb("status", "--board", name).returncode
        if rc != 4:
            return {"ok": False, "why": f"status exited {rc} while degraded"}
        w = subprocess.Popen([sys.executable, _WORKER, name], stdout=subprocess.PIPE, text=True)
        procs.append(w)
        assert w.stdout is not None
        if w.stdout.readline().strip() != "ready":
            return {"ok": False, "why": "worker did not start"}
        t0 = time.monotonic()
        w.kill()
        while (s := board.slot("victim")) is None or s.status is not shmhb.Status.DEAD:
            if time.monotonic() - t0 > 3:
                return {"ok": False, "why": "a local kill was not DEAD within 3 s"}
            time.sleep(0.001)
        kill_s = time.monotonic() - t0
        t1 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            return {"ok": False, "why": "the degraded pinger hung on SIGTERM"}
        return {"ok": kill_s < 1.0, "why": "" if kill_s < 1.0 else f"kill DEAD after {kill_s:.3f} s",
                "kill_ms": round(kill_s * 1e3, 1), "stop_ms": round((time.monotonic() - t1) * 1e3, 1),
                "variant": variant}
    finally:
        for q in procs:
            end(q)
        if blocker is not None:
            blocker.close()
        board.close()
        board.unlink()


_WORKER = child("victim")


def forge(x_identity: str, x_listen: str, y_listen: str, duration_s: float) -> None:
    """Ping ``y_listen`` as the host at ``x_listen`` (board identity ``x_identity``,
    hex ``boot_id:board_inc``) every 0.2 s for ``duration_s``, naming y's current digest
    as x's pinger would: a process on x's host or behind its NAT (nat_forgery)."""
    boot, inc = x_identity.split(":")
    ident = Identity(bytes.fromhex(boot), int(inc))
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    # from x's own address, as a process on x or a container behind x's NAT connects
    s.connect(f"tcp://{x_listen.rsplit(':', 1)[0]}:0;{y_listen}")
    known: tuple[int, Identity | None] = (0, None)
    nonce = time.time_ns()
    end = time.monotonic() + duration_s
    while time.monotonic() < end:
        nonce += 1
        s.send(encode_ping(Ping(ident, x_listen, nonce, known[0], known[1])))
        while s.poll(200):
            try:
                msg = decode(s.recv())
            except ValueError:
                continue
            if isinstance(msg, Ack):
                known = (msg.gen, msg.identity)
    s.close(0)
    ctx.term()


def main(argv: list[str]) -> int:
    kind = argv[0]
    if kind == "liar":
        liar(argv[1], int(argv[2]))
    elif kind == "flood":
        flood(argv[1], int(argv[2]), int(argv[3]))
    elif kind == "forge":
        forge(argv[1], argv[2], argv[3], float(argv[4]))
    elif kind == "badconfig":
        try:
            out = badconfig(argv[1], argv[2], int(argv[3]), argv[4])
        except Exception as e:  # noqa: BLE001 - reported to the harness, which breaches
            out = {"ok": False, "why": f"{type(e).__name__}: {e}"}
        print(json.dumps(out), flush=True)
    else:
        raise SystemExit(f"unknown actor {kind!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
