"""Host-side fault actors of the chaos harness, each on a throwaway board next
to the cluster (``python -m tests.chaos.localactors KIND ...``); each prints one JSON line
``{"ok": ..., "why": ..., ...}``.

``embstall``
    A worker's embedded agent holds the role; a ``shmhb pinger`` daemon starts and must
    take it; the worker is then SIGSTOPped (what a long C call holding the GIL does to
    its agent thread): a local SIGKILL must still be DEAD within 1 s.  Then the daemon
    goes, the worker holds the role again and is SIGSTOPped *before* a new daemon starts:
    that daemon must replace the stalled holder within 10 s (a kill DEAD within 1 s), and
    the worker, resumed, must stand down: the daemon keeps the role, renews its term,
    and the worker's own heartbeat is ALIVE again.
``regattach``
    A process stops while holding the registry lock: ``Board.attach`` and ``shmhb
    status`` must not wait for it, and a registration must fail naming its pid.
``torn IP PORT``
    A settings write torn by a SIGKILL: a bare standby must say degraded (``status``
    non-zero, never "not configured"), and a pinger with options must heal it.
``forgetfds IP PORT``
    ``forget_after_s`` on a pinger at 96 fds under a connection flood: it must keep
    running, see a kill DEAD within 1 s and forget the dead once the flood ends.
``conflict IP PORT``
    A settings conflict: a pinger holds the role with a secret; a stray ``shmhb pinger``
    with other flags and no secret must be refused at once (exit 2) and change nothing
    (the stored settings, authentication included); one with the board's flags is a
    standby that changes nothing either.
``stoppedholder IP PORT``
    A stopped daemon holder: host B (IP) runs a daemon and a worker whose embedded
    standby replaces the daemon once it is SIGSTOPped; host A (the next address)
    follows B's worker.  A must read B and the worker alive again while the daemon is
    still stopped: the new holder listens beside the stopped one.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

import shmhb
from shmhb import Status

from ..children import child
from ..stopping import end, resume, stopped
from .actors import _WORKER

EMBEDDED = child("embedded")
REG_HOLDER = child("registry_holder")
WORKER = child("worker")
TEARER = child("config_tearer")
PINGER = [sys.executable, "-m", "shmhb", "pinger", "--tick-s", "0.02"]


class _Fail(Exception):
    pass


class _Run:
    """A throwaway board and the processes started on it, all removed at the end."""

    def __init__(self, **create: Any) -> None:
        self.name = f"shmhb-chaos-local-{uuid.uuid4().hex[:8]}"
        self.board = shmhb.Board.create(self.name, slots=16, **create)
        self.procs: list[subprocess.Popen[Any]] = []
        self.tmp = tempfile.mkdtemp(prefix="shmhb-chaos-local-")

    def spawn(self, cmd: list[str], *, text: bool = False, log: str | None = None
              ) -> subprocess.Popen[Any]:
        """``log``: a file for its stderr (else discarded)."""
        err: Any = subprocess.DEVNULL if log is None else open(log, "wb")
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE if text else subprocess.DEVNULL,
                             stderr=err, stdin=subprocess.PIPE, text=text)
        if log is not None:
            err.close()  # the child has its own
        self.procs.append(p)
        return p

    def program(self, path: str, *args: str) -> subprocess.Popen[str]:
        return self.spawn([sys.executable, path, *args], text=True)

    def ready(self, p: subprocess.Popen[str], word: str = "ready") -> None:
        assert p.stdout is not None
        if p.stdout.readline().strip() != word:
            raise _Fail(f"a helper did not say {word!r} (rc {p.poll()})")

    def until(self, pred: Callable[[], Any], timeout_s: float, what: str) -> float:
        t0 = time.monotonic()
        while not pred():
            if time.monotonic() - t0 > timeout_s:
                raise _Fail(f"timed out after {timeout_s} s: {what}")
            time.sleep(0.002)
        return time.monotonic() - t0

    def victim(self, key: str) -> subprocess.Popen[str]:
        w = self.program(_WORKER, self.name, key)
        self.ready(w)
        return w

    def kill_is_dead(self, key: str, w: subprocess.Popen[str] | None = None) -> float:
        w = w or self.victim(key)
        w.kill()
        took = self.until(lambda: (s := self.board.slot(key)) is not None
                          and s.status is Status.DEAD, 3.0, f"{key} DEAD")
        if took > 1.0:
            raise _Fail(f"a local kill was DEAD after {took:.3f} s")
        return took

    def close(self) -> None:
        for q in self.procs:
            end(q)
        self.board.close()
        self.board.unlink()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _status(name: str) -> tuple[int, dict[str, Any]]:
    out = subprocess.run([sys.executable, "-m", "shmhb", "status", "--json", "--board", name],
                         capture_output=True, text=True, timeout=60)
    try:
        return out.returncode, json.loads(out.stdout)
    except ValueError:
        raise _Fail(f"status printed no JSON (rc {out.returncode}): {out.stderr[-300:]!r}") from None


def embstall(r: _Run) -> dict[str, Any]:
    holder = r.program(EMBEDDED, r.name, "holder")
    r.ready(holder)
    r.until(lambda: r.board.agent().pid == holder.pid, 10, "the embedded agent holds the role")
    daemon = r.spawn(PINGER + ["--board", r.name])
    took = r.until(lambda: r.board.agent().pid == daemon.pid
                   and r.board.agent().status is Status.ALIVE, 10, "the daemon took the role")
    os.kill(holder.pid, signal.SIGSTOP)
    kill = r.kill_is_dead("victim")
    resume(holder.pid)
    # the stalled holder replaced: the worker holds the role again, then stops first
    daemon.kill()
    daemon.wait(10)
    r.until(lambda: _holds(r, holder.pid), 10, "the worker took the role back")
    with stopped(holder.pid):
        second = r.spawn(PINGER + ["--board", r.name])
        stalled = r.until(lambda: _holds(r, second.pid), 10,
                          "a daemon replaced the stopped embedded holder")
        term = r.board.agent().term
        kill2 = r.kill_is_dead("victim2")
    r.until(lambda: r.board.agent().term > term and _holds(r, second.pid), 10,
            "the daemon renewed its term once the resumed worker stood down")
    r.until(lambda: (s := r.board.slot("holder")) is not None and s.status is Status.ALIVE,
            5, "the resumed worker's heartbeat ALIVE")
    if r.board.agent().pid != second.pid or holder.poll() is not None:
        raise _Fail("the resumed worker took the role back or died")
    return {"ok": True, "handover_ms": round(took * 1e3, 1), "kill_ms": round(kill * 1e3, 1),
            "stalled_takeover_ms": round(stalled * 1e3, 1),
            "kill2_ms": round(kill2 * 1e3, 1)}


def _holds(r: _Run, pid: int) -> bool:
    a = r.board.agent()
    return a.pid == pid and a.status is Status.ALIVE


def regattach(r: _Run) -> dict[str, Any]:
    daemon = r.spawn(PINGER + ["--board", r.name])
    r.until(lambda: r.board.agent().pid == daemon.pid, 10, "the pinger holds the role")
    w = r.victim("victim")
    stall = r.program(REG_HOLDER, r.name)
    r.ready(stall, "held")
    t0 = time.monotonic()
    shmhb.Board.attach(r.name).close()
    rc, _ = _status(r.name)
    took = time.monotonic() - t0
    if took > 2.0 or rc not in (0, 1):
        raise _Fail(f"attach and status took {took:.2f} s (rc {rc}) under a stopped holder")
    t0 = time.monotonic()
    during = r.victim("during")  # a restarted worker registers past the stopped holder
    reg = time.monotonic() - t0
    if reg > 4.0:
        raise _Fail(f"a registration waited {reg:.2f} s for a stopped registry holder")
    dkill = r.kill_is_dead("during", during)
    kill = r.kill_is_dead("victim", w)
    resume(stall.pid)
    return {"ok": True, "attach_status_ms": round(took * 1e3, 1), "register_ms": round(reg * 1e3, 1),
            "kill_ms": round(kill * 1e3, 1), "kill_registered_past_ms": round(dkill * 1e3, 1)}


def torn(r: _Run, ip: str, port: int) -> dict[str, Any]:
    listen = ["--listen", f"{ip}:{port}"]
    first = r.spawn(PINGER + ["--board", r.name, *listen])
    r.until(lambda: r.board.network().state == "listening", 20, "listening")
    first.kill()
    first.wait(10)
    t = r.program(TEARER, r.name)
    t.wait(30)
    bare = r.spawn(PINGER + ["--board", r.name])
    r.until(lambda: r.board.agent().pid == bare.pid, 10, "the bare standby holds the role")
    r.until(lambda: r.board.network().state == "degraded", 10, "degraded, not 'not configured'")
    rc, doc = _status(r.name)
    if rc == 0:
        raise _Fail(f"status exited 0 on torn settings: {doc.get('network')}")
    kill = r.kill_is_dead("victim")
    bare.kill()
    bare.wait(10)
    r.spawn(PINGER + ["--board", r.name, *listen])
    r.until(lambda: r.board.network().state == "listening", 20, "healed by a pinger with options")
    return {"ok": True, "kill_ms": round(kill * 1e3, 1)}


def forgetfds(r: _Run, ip: str, port: int) -> dict[str, Any]:
    p = r.spawn(["prlimit", "--nofile=96:96", *PINGER, "--board", r.name,
                 "--listen", f"{ip}:{port}"])
    r.until(lambda: r.board.network().state == "listening", 20, "listening")
    fl = r.spawn([sys.executable, "-m", "tests.chaos.actors", "flood", ip, str(port), "160"])
    r.until(lambda: len(os.listdir(f"/proc/{p.pid}/fd")) >= 94, 20, "the pinger's fds used up")
    kill = r.kill_is_dead("victim")
    time.sleep(1.5)  # pacing: several forget periods pass under the flood
    if p.poll() is not None:
        raise _Fail(f"the pinger exited {p.returncode} under the flood with forget_after_s")
    fl.kill()
    fl.wait(10)
    r.until(lambda: r.board.slot("victim") is None, 20, "the dead forgotten after the flood")
    if p.poll() is not None:
        raise _Fail(f"the pinger exited {p.returncode}")
    return {"ok": True, "kill_ms": round(kill * 1e3, 1)}


def conflict(r: _Run, ip: str, port: int) -> dict[str, Any]:
    from shmhb.net.settings import stored_settings

    secret = os.path.join(r.tmp, "secret")
    with open(os.open(secret, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
        f.write(os.urandom(24).hex().encode())
    mine = ["--board", r.name, "--listen", f"{ip}:{port}", "--secret-file", secret]
    r.spawn(PINGER + mine)
    r.until(lambda: r.board.network().state == "listening", 20, "listening")
    before = stored_settings(r.board)
    gen = r.board.network().settings_gen
    t0 = time.monotonic()
    stray = subprocess.run(PINGER + ["--board", r.name, "--listen", f"{ip}:{port + 1}",
                                     "--peer", "127.0.2.250"], capture_output=True, text=True,
                           timeout=60)
    took = time.monotonic() - t0
    if stray.returncode != 2 or "another shmhb pinger runs" not in stray.stderr:
        raise _Fail(f"a stray pinger with other flags was not refused: rc {stray.returncode}, "
                    f"{stray.stderr[-300:]!r}")
    log = os.path.join(r.tmp, "standby.log")
    standby = r.spawn(PINGER + mine, log=log)

    def started() -> bool:  # it logs this once its flags were checked (and stored, or not)
        with open(log, errors="replace") as f:
            return "waiting for the agent role" in f.read() or standby.poll() is not None
    r.until(started, 30, "the standby pinger started")
    if standby.poll() is not None:
        raise _Fail(f"a standby with the board's own flags exited {standby.returncode}")
    net = r.board.network()
    if stored_settings(r.board) != before or net.settings_gen != gen or net.auth != "hmac":
        raise _Fail(f"the stored settings changed: {stored_settings(r.board)} "
                    f"(gen {net.settings_gen}, auth {net.auth})")
    return {"ok": True, "refused_ms": round(took * 1e3, 1)}


def stoppedholder(r: _Run, ip: str, port: int) -> dict[str, Any]:
    a_ip = ip.rsplit(".", 1)[0] + "." + str(int(ip.rsplit(".", 1)[1]) + 1)
    a = _Run(suspect_after_s=0.5, dead_after_s=1.5)
    try:
        daemon = r.spawn(PINGER + ["--board", r.name, "--listen", f"{ip}:{port}"])
        r.until(lambda: r.board.network().state == "listening", 20, "B listening")
        ep = f"{ip}:30001"
        w = r.program(WORKER, r.name, "w", "0.05", "1", ep)
        assert w.stdout is not None
        if not w.stdout.readline().startswith("ready"):
            raise _Fail(f"B's worker did not start (rc {w.poll()})")
        a.spawn(PINGER + ["--board", a.name, "--listen", f"{a_ip}:{port}"])
        a.board.watch(ep)

        def heard() -> bool:
            p, w = a.board.peer(ip), a.board.remote(ep)
            return (p is not None and p.status is Status.ALIVE
                    and w is not None and w.status is Status.ALIVE)
        r.until(heard, 20, "A reads B and its worker alive")
        with stopped(daemon.pid):
            r.until(lambda: not heard(), 10, "A notices the stop")
            # the stall bound (3 s) and the embedded grace (1 s), then one reconnect of A's
            back = r.until(heard, 12, "A hears B again while its daemon is stopped")
            if r.board.agent().pid == daemon.pid:
                raise _Fail("B's daemon still holds the role while stopped")
    finally:
        a.close()
    return {"ok": True, "heard_again_ms": round(back * 1e3, 1)}


def main(argv: list[str]) -> int:
    kind, rest = argv[0], argv[1:]
    create: dict[str, Any] = {"suspect_after_s": 0.5, "dead_after_s": 1.5}
    if kind == "forgetfds":
        create["forget_after_s"] = 0.5
    r = _Run(**create)
    try:
        if kind == "embstall":
            out = embstall(r)
        elif kind == "regattach":
            out = regattach(r)
        elif kind == "torn":
            out = torn(r, rest[0], int(rest[1]))
        elif kind == "forgetfds":
            out = forgetfds(r, rest[0], int(rest[1]))
        elif kind == "conflict":
            out = conflict(r, rest[0], int(rest[1]))
        elif kind == "stoppedholder":
            out = stoppedholder(r, rest[0], int(rest[1]))
        else:
            raise SystemExit(f"unknown actor {kind!r}")
    except _Fail as e:
        out = {"ok": False, "why": str(e)}
    except Exception as e:  # noqa: BLE001 - reported to the harness, which breaches
        out = {"ok": False, "why": f"{type(e).__name__}: {e}"}
    finally:
        r.close()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
