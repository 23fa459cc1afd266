"""Prefill/decode disaggregation on one machine, with shmhb dropping stale KV links.

    PYTHONPATH=. python examples/pd_disagg.py [--quick]     # or with shmhb installed

Two "hosts" on loopback addresses (Linux: all of 127/8 is loopback), each with its own
board and its own ``shmhb pinger``:

* the **decode engine** on 127.0.0.3 (``--base-addr`` / ``$SHMHB_LOOPBACK_BASE`` move both hosts): a few ranks (processes).  Each registers on the
  decode board with its side-channel endpoint and serves its KV metadata there over ZMQ
  (a ROUTER answering a handshake with engine id, rank, KV base address, incarnation),
  and answers transfer requests (a stand-in for the KV read/write itself);
* the **prefill engine** on 127.0.0.2: a few ranks.  Each does the handshake with every
  decode rank, caches the answer per (remote engine host, port) the way KV connectors
  do, tracks the link with a ``LinkReaper`` (payload: the cache entry) and keeps sending
  transfer requests over it.  Once per step it calls ``reaper.poll()``; ``on_drop``
  removes the cache entry, closes the session and fails the request in flight at once.

Then the example SIGKILLs the decode ranks, shows every prefill rank dropping its cached
entries within the detection window, restarts the decode engine (new engine id, new
incarnations, same ports) and shows fresh handshakes against the new incarnation.  It
prints a timeline; everything it starts (processes, boards) is removed at the end, also
on Ctrl-C.  The same file runs the ranks (``--role``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

try:
    import shmhb
except ImportError:
    sys.exit("shmhb is not importable: `pip install .` first, or run "
             "`PYTHONPATH=. python examples/pd_disagg.py` from the repository root")

from shmhb.testing.loopback import free_port, loopback_addrs, set_base  # noqa: E402

# host addresses: $SHMHB_LOOPBACK_BASE (default 127.0.0.2) and the next; the rank
# processes inherit the variable, so every process agrees.
PREFILL_IP, DECODE_IP = loopback_addrs(2)
HANDSHAKE_TIMEOUT_S = 0.5
TRANSFER_TIMEOUT_S = 5.0
#: A kill is seen through a pidfd on the decode host and pushed to the prefill host at
#: once: milliseconds.  This is the bound the example checks, loose for a busy machine.
DETECTION_WINDOW_S = 2.0


def _emit(**event: Any) -> None:
    """A rank's timeline event: one JSON line on stdout, stamped with CLOCK_MONOTONIC
    (one clock for every process of the machine, so the orchestrator can order them)."""
    event["t"] = time.monotonic()
    print(json.dumps(event), flush=True)


def _die_with_parent() -> None:
    """Linux: the kernel SIGKILLs this process if the orchestrator dies first."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


# -- a decode rank: register, serve the side channel -------------------------------------------

def decode_rank(a: argparse.Namespace) -> int:
    _die_with_parent()
    endpoint = f"{DECODE_IP}:{a.port}"
    board = shmhb.Board.attach(a.board)
    # At worker init (in vLLM: register_kv_caches): register the rank with the endpoints
    # its peers will link to.  The host's `shmhb pinger` holds the agent role.
    hb = board.register(f"decode-r{a.rank}", endpoints=(endpoint,), agent=False).start(0.05)
    kv_base = 0x7F00_0000_0000 + (a.rank << 36) + (hb.incarnation << 24)  # a fake address
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"tcp://{endpoint}")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    _emit(role="decode", rank=a.rank, event="serving", endpoint=endpoint,
          engine=a.engine, incarnation=hb.incarnation, pid=os.getpid())
    replies: list[tuple[float, list[bytes]]] = []  # transfers "in progress": due time, reply
    try:
        while not stop.is_set():
            if sock.poll(10):
                rid, raw = sock.recv_multipart()
                msg = json.loads(raw)
                if msg["type"] == "handshake":
                    meta = {"engine_id": a.engine, "rank": a.rank, "kv_base_addr": kv_base,
                            "incarnation": hb.incarnation, "num_blocks": 4096}
                    sock.send_multipart([rid, json.dumps(meta).encode()])
                elif msg["type"] == "transfer":  # the KV transfer takes a while
                    done = {"req": msg["req"], "ok": True, "incarnation": hb.incarnation}
                    replies.append((time.monotonic() + a.transfer_s, [rid, json.dumps(done).encode()]))
            now = time.monotonic()
            for due, frames in [r for r in replies if r[0] <= now]:
                sock.send_multipart(frames)
                replies.remove((due, frames))
    finally:
        sock.close(0)
        ctx.term()
        hb.close()  # a graceful stop reads LEFT: links to it are dropped as "left"
        board.close()
    return 0


# -- a prefill rank: handshake, cache, track, transfer, poll -----------------------------------

@dataclass
class Peer:
    """One decode rank's side channel, as one prefill rank sees it."""

    endpoint: str
    sock: zmq.Socket | None = None
    state: str = "idle"  # idle -> handshaking -> linked -> (dropped) idle
    deadline: float = 0.0
    next_try: float = 0.0
    inflight: tuple[str, float] | None = None  # (request id, sent at)
    next_send: float = 0.0
    entry: dict[str, Any] | None = None  # the cache entry this link was made with
    failing: bool = False  # a failed handshake was reported; quiet until one succeeds
    sent: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def prefill_rank(a: argparse.Namespace) -> int:
    _die_with_parent()
    board = shmhb.Board.attach(a.board)
    hb = board.register(f"prefill-r{a.rank}", agent=False).start(0.05)
    ctx = zmq.Context()
    peers = {ep: Peer(ep) for ep in a.decode}
    # The connector's remote metadata cache, per (remote engine host, side-channel port).
    cache: dict[tuple[str, int], dict[str, Any]] = {}
    req_ids = iter(range(1, 1 << 62))

    def close_sock(p: Peer) -> None:
        if p.sock is not None:
            poller.unregister(p.sock)
            p.sock.close(0)
            p.sock = None

    def on_drop(link: shmhb.Link, reason: shmhb.DropReason) -> None:
        # Runs inside reaper.poll(), on this step loop's thread.  Remove the entry only
        # if it is still the one this link was made with (a newer handshake may have
        # replaced it), close the session, and fail the request in flight at once
        # instead of letting it wait for its timeout.
        entry = link.payload
        key = (entry["host"], entry["port"])
        if cache.get(key) is entry:
            del cache[key]
        p = peers[link.endpoint]
        failed = None
        if p.entry is entry:
            if p.inflight is not None:
                failed = p.inflight[0]
                p.inflight = None
            close_sock(p)
            p.state, p.entry, p.next_try = "idle", None, time.monotonic()
        _emit(role="prefill", rank=a.rank, event="drop", endpoint=link.endpoint,
              reason=str(reason), remote_rank=entry["rank"], engine=entry["engine_id"],
              incarnation=link.incarnation, failed_request=failed, cached=len(cache))

    reaper = shmhb.LinkReaper(board, on_drop=on_drop)
    poller = zmq.Poller()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    _emit(role="prefill", rank=a.rank, event="up", pid=os.getpid(), incarnation=hb.incarnation)
    try:
        while not stop.is_set():
            now = time.monotonic()
            # 1. what to start this step: handshakes with peers not cached, transfers
            for p in peers.values():
                if p.state == "idle" and now >= p.next_try:
                    s = ctx.socket(zmq.DEALER)
                    s.setsockopt(zmq.LINGER, 0)
                    s.connect(f"tcp://{p.endpoint}")
                    s.send(json.dumps({"type": "handshake", "from": f"prefill-r{a.rank}"}).encode())
                    poller.register(s, zmq.POLLIN)
                    p.sock, p.state, p.deadline = s, "handshaking", now + HANDSHAKE_TIMEOUT_S
                elif p.state == "linked" and p.inflight is None and now >= p.next_send:
                    rid = f"p{a.rank}-{next(req_ids)}"
                    assert p.sock is not None
                    p.sock.send(json.dumps({"type": "transfer", "req": rid, "blocks": 16}).encode())
                    p.inflight = (rid, now)
            # 2. answers
            by_sock = {p.sock: p for p in peers.values() if p.sock is not None}
            for s, _ in poller.poll(10):
                p = by_sock[s]
                msg = json.loads(s.recv())
                if p.state == "handshaking":
                    host, port = p.endpoint.rsplit(":", 1)
                    entry = {**msg, "host": host, "port": int(port)}
                    cache[(host, int(port))] = entry
                    # Track right after the handshake, with the incarnation it returned.
                    reaper.track(p.endpoint, payload=entry, incarnation=msg["incarnation"])
                    p.state, p.entry, p.failing, p.sent = "linked", entry, False, 0
                    _emit(role="prefill", rank=a.rank, event="handshake", endpoint=p.endpoint,
                          remote_rank=msg["rank"], engine=msg["engine_id"],
                          incarnation=msg["incarnation"], kv_base=msg["kv_base_addr"],
                          cached=len(cache))
                elif p.inflight is not None and msg.get("req") == p.inflight[0]:
                    p.sent += 1
                    if p.sent == 1:
                        _emit(role="prefill", rank=a.rank, event="transfer", endpoint=p.endpoint,
                              req=msg["req"], incarnation=msg["incarnation"],
                              ms=round((time.monotonic() - p.inflight[1]) * 1000, 1))
                    p.inflight, p.next_send = None, time.monotonic() + a.pause_s
            # 3. timeouts
            now = time.monotonic()
            for p in peers.values():
                if p.state == "handshaking" and now >= p.deadline:
                    close_sock(p)
                    p.state, p.next_try = "idle", now + 0.2
                    if not p.failing:
                        p.failing = True
                        _emit(role="prefill", rank=a.rank, event="handshake_failed",
                              endpoint=p.endpoint)
                elif p.inflight is not None and now - p.inflight[1] >= TRANSFER_TIMEOUT_S:
                    _emit(role="prefill", rank=a.rank, event="transfer_timeout",
                          endpoint=p.endpoint, req=p.inflight[0])
                    p.inflight = None
            # 4. once per step: drop links to peers that died, left or restarted
            reaper.poll()
    finally:
        for ep in list(peers):
            reaper.untrack(ep)
            close_sock(peers[ep])
        ctx.term()
        hb.close()
        board.close()
    return 0

# -- the orchestrator ------------------------------------------------------------------------------


class Orchestrator:
    def __init__(self, quick: bool) -> None:
        self.quick = quick
        self.n_decode = 2 if quick else 4
        self.n_prefill = 2
        self.t0 = time.monotonic()
        tag = f"{os.getpid()}-{secrets.token_hex(2)}"
        self.boards = {"prefill": f"pd-demo-{tag}-prefill", "decode": f"pd-demo-{tag}-decode"}
        self.procs: list[subprocess.Popen[str]] = []
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.env = dict(os.environ)
        pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(shmhb.__file__)))
        self.env["PYTHONPATH"] = pkg_root + os.pathsep + self.env.get("PYTHONPATH", "")
        self.decode_ranks: list[subprocess.Popen[str]] = []
        self.engine = ""

    # -- output ------------------------------------------------------------------------------

    def line(self, who: str, text: str, t: float | None = None) -> None:
        t = time.monotonic() if t is None else t
        print(f"{t - self.t0:8.3f} s  {who:<12} {text}", flush=True)

    def banner(self, text: str) -> None:
        print(f"\n== {text} ==", flush=True)

    def show(self, e: dict[str, Any]) -> None:
        who = f"{e['role']} r{e['rank']}" if e["rank"] != "" else e["role"]
        ev = e["event"]
        if ev == "serving":
            text = (f"serving side channel {e['endpoint']} (engine {e['engine']}, "
                    f"incarnation {e['incarnation']})")
        elif ev == "up":
            text = f"up (pid {e['pid']})"
        elif ev == "handshake":
            text = (f"handshake with decode r{e['remote_rank']} @{e['endpoint']}: engine "
                    f"{e['engine']}, incarnation {e['incarnation']}, kv_base "
                    f"{e['kv_base']:#x}; cached and tracked ({e['cached']} cached)")
        elif ev == "transfer":
            text = f"transfer {e['req']} over {e['endpoint']}: ok in {e['ms']} ms"
        elif ev == "drop":
            failed = f"; request {e['failed_request']} failed at once" if e["failed_request"] else ""
            text = (f"DROP {e['endpoint']} (decode r{e['remote_rank']}, incarnation "
                    f"{e['incarnation']}): {e['reason']}; cache entry removed ({e['cached']} "
                    f"cached){failed}")
            if "after_kill" in e:
                text += f" -- {e['after_kill'] * 1000:.0f} ms after the kill"
        elif ev == "board":
            how = "its agent saw the exit (pidfd)" if e["host"] == "decode" else "pushed by the decode host's pinger"
            text = (f"board: {e['key']} DEAD, {e['after_kill'] * 1000:.0f} ms after the kill "
                    f"({how})")
            who = e["role"]
        elif ev == "handshake_failed":
            text = f"handshake with {e['endpoint']} unanswered; retrying"
        elif ev == "transfer_timeout":
            text = f"request {e['req']} over {e['endpoint']} timed out"
        else:
            text = json.dumps(e)
        self.line(who, text, e["t"])

    # -- processes ---------------------------------------------------------------------------

    def spawn(self, args: list[str], events: bool) -> subprocess.Popen[str]:
        p = subprocess.Popen([sys.executable, *args], env=self.env, text=True,
                             stdout=subprocess.PIPE if events else subprocess.DEVNULL,
                             stderr=None if events else subprocess.DEVNULL,
                             start_new_session=True)  # Ctrl-C reaches us only: we clean up
        self.procs.append(p)
        if events:
            threading.Thread(target=self._read, args=(p,), daemon=True).start()
        return p

    def _read(self, p: subprocess.Popen[str]) -> None:
        assert p.stdout is not None
        for raw in p.stdout:
            try:
                self.events.put(json.loads(raw))
            except ValueError:
                pass

    def rank(self, role: str, rank: int, *extra: str) -> subprocess.Popen[str]:
        return self.spawn([os.path.abspath(__file__), "--role", role, "--rank", str(rank),
                           "--board", self.boards[role], *extra], events=True)

    def start_decode_engine(self) -> None:
        self.engine = secrets.token_hex(3)  # a restarted engine gets a fresh id, as in vLLM
        self.decode_ranks = [
            self.rank("decode", r, "--port", str(self.port + 1 + r), "--engine", self.engine,
                      "--transfer-s", "0.3")
            for r in range(self.n_decode)]

    def wait_for(self, what: str, done: Any, timeout_s: float,
                 on_event: Any = None) -> None:
        """Print events as they come until ``done()``; fail after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
            try:
                batch = [self.events.get(timeout=min(left, 0.1))]
            except queue.Empty:
                continue
            time.sleep(0.005)  # let events of the same moment from other processes arrive
            while not self.events.empty():
                batch.append(self.events.get_nowait())
            for e in sorted(batch, key=lambda e: e["t"]):  # in the order they happened
                if on_event is not None:
                    on_event(e)
                self.show(e)

    # -- the story ---------------------------------------------------------------------------

    def run(self) -> int:
        print(f"shmhb P/D disaggregation example{' (quick)' if self.quick else ''}: "
              f"{self.n_prefill} prefill ranks on {PREFILL_IP}, {self.n_decode} decode ranks "
              f"on {DECODE_IP}")
        self.port = free_port([PREFILL_IP, DECODE_IP], span=self.n_decode + 2)
        for role, ip in (("prefill", PREFILL_IP), ("decode", DECODE_IP)):
            shmhb.Board.create(self.boards[role]).close()
            p = self.spawn(["-m", "shmhb", "pinger", "--board", self.boards[role], "--listen",
                            f"{ip}:{self.port}", "--interval-s", "0.1"], events=False)
            self.line("orchestrator", f"{role} host {ip}: board {self.boards[role]}, "
                                      f"`shmhb pinger` pid {p.pid} on {ip}:{self.port}")
        links = self.n_prefill * self.n_decode

        self.banner("start the decode engine and the prefill engine")
        self.start_decode_engine()
        decode_eps = [f"{DECODE_IP}:{self.port + 1 + r}" for r in range(self.n_decode)]
        for r in range(self.n_prefill):
            self.rank("prefill", r, "--decode", *decode_eps, "--pause-s", "0.05")
        first: dict[tuple[int, str], int] = {}  # (prefill rank, endpoint) -> incarnation

        def steady(e: dict[str, Any]) -> None:
            if e["event"] == "transfer":
                first[(e["rank"], e["endpoint"])] = e["incarnation"]
        self.wait_for("every link handshaken and used", lambda: len(first) >= links, 60, steady)
        old = dict(first)
        if not self.quick:
            self.line("orchestrator", "links in use; transfers flowing for 2 s")
            hold_until = time.monotonic() + 2.0
            self.wait_for("transfers to flow", lambda: time.monotonic() >= hold_until, 5)

        self.banner(f"kill the decode engine: SIGKILL to its {self.n_decode} ranks")
        t_kill = time.monotonic()
        for p in self.decode_ranks:
            p.kill()
        self.line("orchestrator", f"SIGKILL sent to decode pids {[p.pid for p in self.decode_ranks]}",
                  t_kill)
        threading.Thread(target=self._follow_kill, args=(t_kill,), daemon=True).start()
        drops: list[dict[str, Any]] = []

        def dropped(e: dict[str, Any]) -> None:
            if e["event"] == "drop":
                e["after_kill"] = e["t"] - t_kill
                drops.append(e)
        self.wait_for("every prefill rank dropping every link", lambda: len(drops) >= links,
                      30, dropped)
        for p in self.decode_ranks:
            p.wait()
        worst = max(d["after_kill"] for d in drops)
        ok = worst <= DETECTION_WINDOW_S
        self.line("orchestrator", f"{len(drops)} cached links dropped, the last {worst * 1000:.0f} ms "
                                  f"after the kill: {'within' if ok else 'OUTSIDE'} the detection "
                                  f"window ({DETECTION_WINDOW_S:.0f} s)")

        self.banner("restart the decode engine (same ports, new engine id, new incarnations)")
        self.start_decode_engine()
        fresh: dict[tuple[int, str], int] = {}

        def rehandshake(e: dict[str, Any]) -> None:
            if e["event"] == "handshake" and e["incarnation"] > old[(e["rank"], e["endpoint"])]:
                fresh[(e["rank"], e["endpoint"])] = e["incarnation"]
            if e["event"] == "transfer" and (e["rank"], e["endpoint"]) in fresh:
                fresh[(e["rank"], e["endpoint"])] = -e["incarnation"]  # negative: used too
        self.wait_for("fresh handshakes and transfers against the new engine",
                      lambda: len(fresh) >= links and all(v < 0 for v in fresh.values()), 60,
                      rehandshake)
        self.line("orchestrator", f"{links} fresh handshakes against the new incarnations "
                                  f"({sorted({-v for v in fresh.values()})}; before: "
                                  f"{sorted(set(old.values()))}), each link used again")
        self.banner("summary")
        print(f"  links dropped: {len(drops)} of {links}, reasons "
              f"{sorted({d['reason'] for d in drops})}, worst {worst * 1000:.0f} ms after the kill")
        print(f"  in-flight requests failed at once by a drop: "
              f"{sum(1 for d in drops if d['failed_request'])}")
        print(f"  fresh handshakes against the restarted engine {self.engine}: {len(fresh)}")
        return 0 if ok else 1

    def _follow_kill(self, t_kill: float) -> None:
        """What each host's board says about the killed ranks, and when: the decode host's
        agent sees each exit through a pidfd; the prefill host's board learns it from a
        push of the decode host's pinger.  (Read-only: any process may read a board.)"""
        todo = {(host, r) for host in ("decode", "prefill") for r in range(self.n_decode)}
        boards = {h: shmhb.Board.attach(self.boards[h]) for h in ("decode", "prefill")}
        try:
            deadline = time.monotonic() + 10
            while todo and time.monotonic() < deadline:
                for host, r in sorted(todo):
                    if host == "decode":
                        s = boards[host].slot(f"decode-r{r}")
                    else:
                        s = boards[host].remote(f"{DECODE_IP}:{self.port + 1 + r}")
                    if s is not None and s.status is shmhb.Status.DEAD:
                        todo.discard((host, r))
                        self.events.put({"role": f"{host} host", "event": "board", "t": time.monotonic(),
                                         "rank": "", "key": f"decode-r{r}", "host": host,
                                         "after_kill": time.monotonic() - t_kill})
                time.sleep(0.0005)
        finally:
            for b in boards.values():
                b.close()

    def cleanup(self) -> None:
        running = [p for p in self.procs if p.poll() is None]
        for p in running:
            try:
                p.terminate()  # ranks leave gracefully; pingers release the role
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        for p in running:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        removed = 0
        for name in self.boards.values():
            try:
                shmhb.Board.attach(name).unlink()
                removed += 1
            except shmhb.BoardNotFound:
                pass
        print(f"cleaned up: {len(running)} processes ended, {removed} boards removed", flush=True)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer ranks, no pause (for tests)")
    ap.add_argument("--base-addr", default=None, metavar="ADDR",
                    help="the prefill host's loopback address; decode gets the next (default: "
                         "$SHMHB_LOOPBACK_BASE or 127.0.0.2)")
    ap.add_argument("--role", choices=("decode", "prefill"), help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--board", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    ap.add_argument("--transfer-s", type=float, default=0.3, help=argparse.SUPPRESS)
    ap.add_argument("--pause-s", type=float, default=0.2, help=argparse.SUPPRESS)
    ap.add_argument("--decode", nargs="*", default=[], help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.base_addr is not None:
        global PREFILL_IP, DECODE_IP
        set_base(a.base_addr)  # validated; exported to the rank processes
        PREFILL_IP, DECODE_IP = loopback_addrs(2)
    if a.role == "decode":
        return decode_rank(a)
    if a.role == "prefill":
        return prefill_rank(a)
    orch = Orchestrator(a.quick)
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM cleans up as Ctrl-C does
    try:
        return orch.run()
    except KeyboardInterrupt:
        print("\ninterrupted", flush=True)
        return 130
    except TimeoutError as e:
        print(f"\nFAILED: {e}", flush=True)
        return 1
    finally:
        orch.cleanup()


if __name__ == "__main__":
    sys.exit(main())
