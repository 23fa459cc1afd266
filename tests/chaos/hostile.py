"""Hostile-input fault kinds of the chaos harness, as a mixin of ``Harness``.

None of them may change a verdict: the standing invariants (a local SIGKILL DEAD within
the local bound, remote verdicts within theirs, no false DEAD, no torn read, no crash
of a pinger) are checked throughout by ``invariants.Checker``.  Besides, every scan:

- ``spoof-accepted``: an observer resolves a real worker's endpoint to a row of the
  liar (a followed host listing other hosts' endpoints);
- ``relay-accepted``: the liar's row on an observer lists a key the liar never served
  (another host's ack relayed by it was taken as the liar's);
- ``push-created-rows``: a pushed key the liar's acks never listed got a row.

``bad_config`` runs a throwaway host with a broken configuration next to the cluster
(``actors.badconfig``) and breaches ``bad-config`` if it is not reported degraded, if
``status`` does not exit 4, if a local kill there is not DEAD within 1 s, or if it
hangs on SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any

import zmq

from shmhb.board.core import board_words
from shmhb.board.layout import watch_checksum
from shmhb.net.protocol import Ack, Identity, Ping, decode, encode_ping

from ..conftest import ROOT
from .invariants import NS, actor_result, now_ns
from .schedule import Fault
from ..children import child

#: stored watch addresses an older version let in (libzmq refuses or misreads them)
BAD_WATCHES = (b"a b:1", b"*:1", "h\u00e9:1".encode(), b"[a:b]:1", b"-x:1", b"[h:99999]:1",
               b"host_a, host_b")
LONG_ENDPOINT = "decode-rank-3.decode-headless.llm-inference-prod.svc.cluster.local:30003"
BAD_CONFIGS = ("port_in_use", "secret_missing", "secret_readable", "curve_missing",
               "foreign_listen")
LIAR_IP = "127.0.0.9"
LONG_REGISTRANT = child("long_registrant")


class HostileFaults:
    """Mixed into ``Harness``; uses its hosts, cluster, timers, jobs and checker."""

    hosts: list[Any]
    cluster: Any
    env: dict[str, str]
    tmp: str
    jobs: list[Any]
    ctx: zmq.Context[Any] | None

    # -- setup and teardown -----------------------------------------------------------------

    def hostile_setup(self) -> None:
        self.liar: subprocess.Popen[str] | None = None
        self.liar_keys: set[str] = {"liar-0"}
        self.flooders: dict[int, subprocess.Popen[str]] = {}
        self.long_regs: list[subprocess.Popen[str]] = []
        self.forgers: list[subprocess.Popen[str]] = []
        self.bad_rows: dict[int, list[int]] = {}
        self._next_hostile_scan = 0
        main = [h for h in self.hosts if h.group == 0]
        p = subprocess.Popen([sys.executable, "-m", "tests.chaos.actors", "liar", LIAR_IP,
                              str(self.cluster.port)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd=ROOT, env=self.env)
        assert p.stdout is not None
        if p.stdout.readline().strip() != "ready":
            raise RuntimeError("the liar did not start")
        os.set_blocking(p.stdout.fileno(), False)
        self.liar = p
        for h in main:  # every loopback host follows the liar, as if a connector used it
            h.board.watch(f"{LIAR_IP}:30000")

    def hostile_teardown(self) -> None:
        for p in [*self.flooders.values(), *self.long_regs, *self.forgers,
                  *([self.liar] if self.liar else [])]:
            if p.poll() is None:
                p.kill()
            p.wait(10)
            for f in (p.stdin, p.stdout):
                if f is not None and not f.closed:
                    f.close()
        self.flooders.clear()
        self.long_regs.clear()
        self.forgers.clear()
        self.liar = None

    def _liar_cmd(self, cmd: dict[str, Any]) -> bool:
        p = self.liar
        if p is None or p.poll() is not None or p.stdin is None:
            return False
        p.stdin.write(json.dumps(cmd) + "\n")
        p.stdin.flush()
        return True

    # -- the checks -----------------------------------------------------------------------------

    def hostile_check(self, t: int) -> None:
        if t < self._next_hostile_scan:
            return
        self._next_hostile_scan = t + int(0.25 * NS)
        main = [h for h in self.hosts if h.group == 0]
        for o in main:
            p = o.board.peer(LIAR_IP)
            if p is not None:
                for s in p.slots:
                    if s.key.startswith("liar-flood-"):
                        self.breach("push-created-rows", f"h{o.idx}: a pushed key {s.key!r} "  # type: ignore[attr-defined]
                                    "the liar's acks never listed has a row", f"h{o.idx}")
                        return
                    if not s.key.startswith("liar-"):
                        self.breach("relay-accepted", f"h{o.idx}: the liar's row lists "  # type: ignore[attr-defined]
                                    f"{s.key!r}, another host's worker", f"h{o.idx}")
                        return
            for other in main:
                if other is o:
                    continue
                for w in other.workers:
                    r = o.board.remote(w.endpoint)
                    if r is not None and r.key.startswith("liar-"):
                        self.breach("spoof-accepted", f"h{o.idx}: {w.endpoint} resolves to "  # type: ignore[attr-defined]
                                    f"the liar's {r.key!r}", f"h{o.idx}")
                        return

    # -- the faults -------------------------------------------------------------------------------

    def _main_host(self, f: Fault) -> Any:
        main = [h for h in self.hosts if h.group == 0]
        return main[f.host % len(main)]

    def _f_conn_flood(self, f: Fault) -> bool:
        h = self._main_host(f)
        if h.idx in self.flooders:
            return False
        p = subprocess.Popen([sys.executable, "-m", "tests.chaos.actors", "flood", h.ip,
                              str(self.cluster.port), "1100"], stdin=subprocess.PIPE,
                             stdout=subprocess.DEVNULL, text=True, cwd=ROOT, env=self.env)
        self.flooders[h.idx] = p
        self.note(f"FAULT conn_flood h{h.idx}: 1100 connections at its pinger for "  # type: ignore[attr-defined]
                  f"{f.duration_s:.2f} s", f"h{h.idx}")

        def end() -> None:
            q = self.flooders.pop(h.idx, None)
            if q is not None:
                q.kill()
                q.wait(10)
                if q.stdin is not None:
                    q.stdin.close()
        self.at(f.duration_s, end)  # type: ignore[attr-defined]
        return True

    def _f_forged_ping(self, f: Fault) -> bool:
        main = [h for h in self.hosts if h.group == 0]
        if len(main) < 2 or self.ctx is None:
            return False
        x = main[f.host % len(main)]
        y = main[(f.host + 1 + f.worker) % len(main)]
        if y is x:
            return False
        spy = self.ctx.socket(zmq.DEALER)
        forger = self.ctx.socket(zmq.DEALER)
        try:
            for s in (spy, forger):
                s.setsockopt(zmq.LINGER, 0)
            spy.connect(f"tcp://{x.h.listen}")
            spy.send(encode_ping(Ping(Identity(os.urandom(16), 1), "127.0.0.1:1", 1)))
            if not spy.poll(300):
                return False  # x's pinger is down or stopped: nothing to learn
            ack = decode(spy.recv())
            if not isinstance(ack, Ack):
                return False
            forger.connect(f"tcp://{y.h.listen}")
            forger.send(encode_ping(Ping(ack.identity, x.h.listen, 2**64 - 1)))
        finally:
            spy.close(0)
            forger.close(0)
        self.note(f"FAULT forged_ping: h{y.idx} pinged as h{x.idx} with nonce 2^64-1",  # type: ignore[attr-defined]
                  f"h{x.idx}", f"h{y.idx}")
        return True

    def _f_push_flood(self, f: Fault) -> bool:
        if not self._liar_cmd({"flood": f.duration_s}):
            return False
        self.note(f"FAULT push_flood: the liar pushes 64 new keys a push for {f.duration_s:.2f} s", "*")  # type: ignore[attr-defined]
        return True

    def _f_relay(self, f: Fault) -> bool:
        h = self._main_host(f)
        if not self._liar_cmd({"relay": f.duration_s, "to": h.h.listen}):
            return False
        self.note(f"FAULT relay: the liar answers with h{h.idx}'s acks for {f.duration_s:.2f} s", "*")  # type: ignore[attr-defined]
        return True

    def _f_spoof(self, f: Fault) -> bool:
        main = [h for h in self.hosts if h.group == 0]
        eps = [w.endpoint for h in main for w in h.workers]
        if not self._liar_cmd({"claim": eps}):
            return False
        self.liar_keys |= {f"liar-spoof-{k}" for k in range(len(eps))}
        self.note(f"FAULT spoof: the liar lists {len(eps)} endpoints of other hosts ALIVE "  # type: ignore[attr-defined]
                  f"for {f.duration_s:.2f} s", "*")
        self.at(f.duration_s, lambda: self._liar_cmd({"claim": []}))  # type: ignore[attr-defined]
        return True

    def _f_bad_watch(self, f: Fault) -> bool:
        h = self._main_host(f)
        if h.idx in self.bad_rows:
            return False
        addr = BAD_WATCHES[f.salt % len(BAD_WATCHES)]
        b = h.board
        try:
            with board_words(b).registry(timeout_s=0.05):
                w = board_words(b).watch_table
                free = [i for i in range(len(w)) if int(w[i]["checksum"]) == 0]
                if not free:
                    return False
                row = w[free[0]]
                row["owner_pid"], row["owner_start"], row["refs"] = 0, 0, 1
                row["address"], row["owner_ns"] = addr, 0
                row["checksum"] = watch_checksum(row)
                b._head["reg_gen"] = int(b._head["reg_gen"]) + 1
        except Exception as e:  # noqa: BLE001 - LockTimeout (a registry_stall): skip
            self.note(f"h{h.idx}: bad_watch skipped ({e})", f"h{h.idx}")  # type: ignore[attr-defined]
            return False
        self.bad_rows[h.idx] = [free[0]]
        self.note(f"FAULT bad_watch h{h.idx}: stored watch {addr!r} for {f.duration_s:.2f} s",  # type: ignore[attr-defined]
                  f"h{h.idx}")

        def end() -> None:
            rows = self.bad_rows.pop(h.idx, [])
            try:
                with board_words(b).registry(timeout_s=5):
                    for i in rows:
                        board_words(b).watch_table[i]["checksum"] = 0
                    b._head["reg_gen"] = int(b._head["reg_gen"]) + 1
            except Exception as e:  # noqa: BLE001 - tried again later
                self.bad_rows[h.idx] = rows
                self.at(1.0, end)  # type: ignore[attr-defined]
                self.note(f"h{h.idx}: bad watch not removed yet ({e})", f"h{h.idx}")  # type: ignore[attr-defined]
        self.at(f.duration_s, end)  # type: ignore[attr-defined]
        return True

    def _f_long_endpoint(self, f: Fault) -> bool:
        h = self._main_host(f)
        key = f"long-{f.salt % 100000}"
        p = subprocess.Popen([sys.executable, LONG_REGISTRANT, h.name, key, LONG_ENDPOINT],
                             stdout=subprocess.DEVNULL, text=True, env=self.env)
        self.long_regs.append(p)
        self.note(f"FAULT long_endpoint h{h.idx}: {key} registers a {len(LONG_ENDPOINT)}-byte "  # type: ignore[attr-defined]
                  "endpoint", f"h{h.idx}")

        def end() -> None:
            if p.poll() is None:
                p.terminate()
        self.at(f.duration_s, end)  # type: ignore[attr-defined]
        return True

    def _f_bad_config(self, f: Fault) -> bool:
        variant = BAD_CONFIGS[f.salt % len(BAD_CONFIGS)]
        ip = f"127.0.1.{2 + f.salt % 200}"
        p = subprocess.Popen([sys.executable, "-m", "tests.chaos.actors", "badconfig", variant,
                              ip, str(self.cluster.port), self.tmp], stdout=subprocess.PIPE,
                             cwd=ROOT, env=self.env)
        self.note(f"FAULT bad_config: a throwaway host at {ip} with {variant}", "*")  # type: ignore[attr-defined]

        def done(out: str, rc: int) -> None:
            got = actor_result(out, rc)
            if got.get("ok"):
                self.checker.stats[f"bad-config-{variant}"] += 1  # type: ignore[attr-defined]
                self.checker.lat["bad-config-kill"].append(got.get("kill_ms", 0) / 1e3)  # type: ignore[attr-defined]
            else:
                self.breach("bad-config", f"{variant}: {got.get('why')}", "*")  # type: ignore[attr-defined]
        self.jobs.append((p, now_ns() + 60 * NS, "bad_config", done))
        return True

    def _f_big_digest(self, f: Fault) -> bool:
        """Two throwaway hosts next to the cluster, the 300th worker of one past 260 dead
        slots killed: the other must see it DEAD (``tests.chaos.bigdigest``)."""
        ips = [f"127.0.2.{2 + (f.salt + k) % 250}" for k in (0, 1)]
        if ips[0] == ips[1]:
            ips[1] = "127.0.2.253"
        p = subprocess.Popen([sys.executable, "-m", "tests.chaos.bigdigest", *ips],
                             stdout=subprocess.PIPE, cwd=ROOT, env=self.env)
        self.note(f"FAULT big_digest: 300 slots at {ips[0]}, 260 of them dead, watched "  # type: ignore[attr-defined]
                  f"from {ips[1]}", "*")

        def done(out: str, rc: int) -> None:
            got = actor_result(out, rc)
            if got.get("ok"):
                self.checker.stats["big-digest"] += 1  # type: ignore[attr-defined]
                self.checker.lat["big-digest-kill"].append(got.get("kill_ms", 0) / 1e3)  # type: ignore[attr-defined]
            else:
                self.breach("big-digest", str(got.get("why")), "*")  # type: ignore[attr-defined]
        self.jobs.append((p, now_ns() + 90 * NS, "big_digest", done))
        return True

    def _f_two_addresses(self, f: Fault) -> bool:
        return self._paths(f, "two_addresses", "a host listening on 0.0.0.0 followed as two "
                           "of its addresses")

    def _f_secret_rotation(self, f: Fault) -> bool:
        return self._paths(f, "secret_rotation", "a pair of hosts rotating their secret host "
                           "by host, then a mismatch")

    def _paths(self, f: Fault, kind: str, what: str) -> bool:
        """Throwaway hosts next to the cluster (``tests.chaos.paths``): a host reached
        under two addresses reads alive under both; a secret rotated host by host never
        reads a peer other than alive, and a mismatch reads unknown, never dead."""
        ips = [f"127.0.3.{2 + (f.salt + k) % 250}" for k in (0, 1, 2)]
        if len(set(ips)) < 3:
            ips = ["127.0.3.251", "127.0.3.252", "127.0.3.253"]
        p = subprocess.Popen([sys.executable, "-m", "tests.chaos.paths", kind, *ips],
                             stdout=subprocess.PIPE, cwd=ROOT, env=self.env)
        self.note(f"FAULT {kind}: {what} ({', '.join(ips)})", "*")  # type: ignore[attr-defined]
        label = kind.replace("_", "-")

        def done(out: str, rc: int) -> None:
            got = actor_result(out, rc)
            if got.get("ok"):
                self.checker.stats[label] += 1  # type: ignore[attr-defined]
                if "kill_ms" in got:
                    self.checker.lat[f"{label}-kill"].append(got["kill_ms"] / 1e3)  # type: ignore[attr-defined]
            else:
                self.breach(label, str(got.get("why")), "*")  # type: ignore[attr-defined]
        self.jobs.append((p, now_ns() + 120 * NS, kind, done))
        return True

    def _f_nat_forgery(self, f: Fault) -> bool:
        """x's holder stopped, a forger on x's address speaks for it to y: the
        standing invariants want x DEAD at y on time all the same."""
        main = [h for h in self.hosts if h.group == 0]
        if len(main) < 2 or self.ctx is None:
            return False
        x = main[f.host % len(main)]
        y = main[(f.host + 1 + f.worker) % len(main)]
        if y is x or x.busy or x.outage:
            return False
        spy = self.ctx.socket(zmq.DEALER)
        try:
            spy.setsockopt(zmq.LINGER, 0)
            spy.connect(f"tcp://{x.h.listen}")
            spy.send(encode_ping(Ping(Identity(os.urandom(16), 1), "127.0.0.1:1", 1)))
            if not spy.poll(300):
                return False
            ack = decode(spy.recv())
        finally:
            spy.close(0)
        if not isinstance(ack, Ack):
            return False
        ident = f"{ack.identity.boot_id.hex()}:{ack.identity.board_inc}"
        stop = Fault(f.at_s, f.kind, self.hosts.index(x), f.worker, f.duration_s)
        if not self._stop_holder(stop):  # type: ignore[attr-defined]
            return False
        self.forgers.append(subprocess.Popen(
            [sys.executable, "-m", "tests.chaos.actors", "forge", ident, x.h.listen, y.h.listen,
             str(f.duration_s)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, text=True,
            cwd=ROOT, env=self.env))
        self.note(f"FAULT nat_forgery: a forger on h{x.idx}'s address pings h{y.idx} as h{x.idx} "  # type: ignore[attr-defined]
                  f"for {f.duration_s:.2f} s", f"h{x.idx}", f"h{y.idx}")
        return True

    def _f_clock_step(self, f: Fault) -> bool:
        """Every pinger started on x from now on runs with its wall clock an hour further
        behind (``Host.pinger_cmd``: a process-level shift, stepping the real clock needs
        root and moves every host of the run); its standby is replaced by such a one,
        which takes the role over 6 s later, once warm."""
        h = self.hosts[f.host % len(self.hosts)]
        if h.busy or h.outage:
            return False
        holder = self._holder(h)  # type: ignore[attr-defined]
        standbys = [p for p in h.live_pingers() if p is not holder and not p.expect_exit]
        if holder is None or not standbys:
            return False
        h.wall_offset_s -= 3600.0
        for p in standbys:  # the harness starts a stepped one in their place
            p.expect_exit = True
            p.proc.kill()
        self.note(f"FAULT clock_step h{h.idx}: pingers started from now on run "  # type: ignore[attr-defined]
                  f"{-h.wall_offset_s:.0f} s behind; the holder goes in 6 s", f"h{h.idx}")

        def takeover() -> None:
            if not h.busy and not h.outage:
                self._end_holder(Fault(f.at_s, "pinger_kill", self.hosts.index(h), 0, 0.0),  # type: ignore[attr-defined]
                                 signal.SIGKILL, "pkill")
        self.at(6.0, takeover)  # type: ignore[attr-defined]
        return True
