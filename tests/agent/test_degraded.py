"""A network half that cannot run as configured is contained and said.

Real ``shmhb pinger`` processes on loopback hosts, real sockets, real shared memory.
Each case checks the same three things: the holder survives (or gives the role up
cleanly), a local SIGKILL during the fault is DEAD within 1 s, and ``shmhb status``
exits non-zero while the host is degraded -- then 0 again once the cause is gone.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import pytest

import shmhb
from shmhb.board.core import board_words
from shmhb import Status
from shmhb.testing.loopback import child_env
from shmhb.net.settings import read_secret, store_config

from ..conftest import ROOT, wait_until
from ..hosts import (
    Cluster, FakePeer, Host, kill_is_dead_within_bound, listening, status, wait_held, wait_net,
    write_secret,
)
from ..stopping import stopped

pytestmark = pytest.mark.system  # it starts processes (see tests/tiers.py)

SECRET = b"cluster-secret-0123456789abcdef!"


def only_slots_unhealthy(h: Host) -> bool:
    rc, doc = status(h)
    return rc == 1 and all("slot" in m for m in doc["health"]["problems"])


def occupy(ip: str, port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((ip, port))
    s.listen(1)
    return s


# -- the listen port in use, an address that cannot be bound -------------------------------

def test_port_in_use_is_degraded_retried_and_recovers(cluster: Cluster) -> None:
    b = cluster.host()
    a = cluster.host(start=False)
    b.watch(a)
    blocker = occupy(a.ip, a.port)
    try:
        p = a.start_pinger(wait=False)
        wait_held(a, p)
        n = wait_net(a, "degraded", "bind")
        assert not n.listening and "cannot listen" in (n.error or ""), n
        rc, doc = status(a)
        assert rc == 4, doc["health"]
        assert doc["schema"] == 1 and doc["network"]["state"] == "degraded"
        assert any("network half is degraded" in m for m in doc["health"]["problems"])
        kill_is_dead_within_bound(a, "w-during")
        assert p.poll() is None
        fails = a.stats()["net_failures"]
        wait_until(lambda: a.stats()["net_failures"] >= fails + 2, what="bind retried")
    finally:
        blocker.close()
    wait_net(a, "listening")
    wait_until(lambda: listening(p.pid, a.ip, a.port), what="a listens after the port is free")
    wait_until(lambda: b.peer_status(a) is Status.ALIVE, what="b sees a alive")
    assert only_slots_unhealthy(a)  # the dead slot of the kill above, nothing else
    kill_is_dead_within_bound(a, "w-after")


def test_a_listen_address_not_on_this_host_is_degraded_not_healthy(cluster: Cluster) -> None:
    a = cluster.host(start=False)
    a.listen = f"192.0.2.1:{a.port}"  # TEST-NET-1: never local, never routed (no traffic)
    p = a.start_pinger(wait=False)
    wait_held(a, p)
    n = wait_net(a, "degraded", "bind")
    assert "192.0.2.1" in (n.error or "")
    assert status(a)[0] == 4
    kill_is_dead_within_bound(a, "w")
    # a new daemon with a good address takes over and the host is healthy again
    p.send_signal(signal.SIGTERM)
    assert p.wait(10) == 0
    a.listen = f"{a.ip}:{a.port}"
    a.start_pinger()
    wait_net(a, "listening")
    assert only_slots_unhealthy(a)


def test_an_invalid_listen_is_refused_at_the_door(cluster: Cluster) -> None:
    a = cluster.host(start=False)
    out = subprocess.run([sys.executable, "-m", "shmhb", "pinger", "--board", a.name,
                          "--listen", f"{a.ip}:99999"], capture_output=True, text=True,
                         timeout=30, env=child_env())
    assert out.returncode == 2 and "port" in out.stderr, out.stderr


# -- the secret file unreadable at a takeover ----------------------------------------------

def test_secret_gone_at_a_takeover_never_means_running_without_it(cluster: Cluster,
                                                                  tmp_path: Any) -> None:
    sf = write_secret(os.path.join(str(tmp_path), "secret"), SECRET)
    a = cluster.host(secret_file=sf)
    b = cluster.host(secret_file=sf)
    b.watch(a)
    a.worker("dec-0", a.endpoint(1))
    wait_until(lambda: (r := b.remote(a.endpoint(1))) is not None and r.status is Status.ALIVE,
               what="a's worker alive on b")
    os.rename(sf, sf + ".away")  # deleted, another mount, another account: unreadable
    a.kill_pinger()
    standby = a.start_pinger(configure=False, wait=False)
    wait_held(a, standby)
    n = wait_net(a, "degraded", "secret")
    assert n.auth == "hmac" and not n.listening and "secret" in (n.error or "")
    # no unauthenticated fallback: it does not listen at all, so b judges it dead
    assert not listening(standby.pid, a.ip, a.port)
    wait_until(lambda: b.peer_status(a) is Status.DEAD, timeout_s=15, what="a DEAD on b")
    assert status(a)[0] == 4
    kill_is_dead_within_bound(a, "w-during")
    fails = a.stats()["net_failures"]
    wait_until(lambda: a.stats()["net_failures"] > fails, what="the secret retried")
    os.rename(sf + ".away", sf)
    wait_net(a, "listening")
    wait_until(lambda: b.peer_status(a) is Status.ALIVE, timeout_s=15, what="a ALIVE on b again")
    assert standby.poll() is None


def test_a_secret_readable_by_others_is_refused_with_the_fix(cluster: Cluster,
                                                             tmp_path: Any) -> None:
    sf = write_secret(os.path.join(str(tmp_path), "secret"), SECRET)
    os.chmod(sf, 0o644)
    with pytest.raises(shmhb.InvalidConfig, match="chmod 600"):
        read_secret(sf)
    a = cluster.host(secret_file=sf, start=False)
    out = subprocess.run(a.pinger_cmd(), capture_output=True, text=True, timeout=30,
                         env=child_env())
    assert out.returncode == 2 and f"chmod 600 {sf}" in out.stderr, out.stderr
    # the same file made readable by others after it was stored: the holder refuses it
    os.chmod(sf, 0o600)
    p = a.start_pinger()
    os.chmod(sf, 0o640)
    standby = a.start_pinger(configure=False, wait=False)
    p.kill()
    wait_held(a, standby)
    n = wait_net(a, "degraded", "secret")
    assert "chmod 600" in (n.error or "")
    assert status(a)[0] == 4


# -- CURVE keys missing ----------------------------------------------------------------------

def _curve_dir(tmp_path: Any, *ips: str) -> str:
    import zmq.auth

    keys = os.path.join(str(tmp_path), "curve")
    os.makedirs(keys, exist_ok=True)
    for ip in ips:
        zmq.auth.create_certificates(keys, ip)
    return keys


def test_curve_without_this_hosts_secret_key_neither_hangs_nor_holds_the_role(
        cluster: Cluster, tmp_path: Any) -> None:
    keys = _curve_dir(tmp_path, "127.0.0.2", "127.0.0.3")
    a = cluster.host(curve_keys=keys)
    b = cluster.host(curve_keys=keys)
    b.watch(a)
    wait_until(lambda: b.peer_status(a) is Status.ALIVE, what="a alive on b")
    away = os.path.join(str(tmp_path), "a.key_secret")
    shutil.move(os.path.join(keys, f"{a.ip}.key_secret"), away)
    a.kill_pinger()
    standby = a.start_pinger(configure=False, wait=False)
    wait_held(a, standby)
    n = wait_net(a, "degraded", "curve")
    assert n.auth == "curve" and "key_secret" in (n.error or "")
    assert status(a)[0] == 4
    kill_is_dead_within_bound(a, "w")
    # it stops at once (nothing blocks in ctx.term), and a standby takes the role over
    second = a.start_pinger(configure=False, wait=False)
    t0 = time.monotonic()
    standby.send_signal(signal.SIGTERM)
    assert standby.wait(5) == 0
    wait_held(a, second)
    assert time.monotonic() - t0 < 5
    shutil.move(away, os.path.join(keys, f"{a.ip}.key_secret"))
    wait_net(a, "listening")
    wait_until(lambda: b.peer_status(a) is Status.ALIVE, timeout_s=15, what="a alive on b again")
    assert only_slots_unhealthy(a)


def test_a_watched_host_without_a_key_is_skipped_not_fatal(cluster: Cluster,
                                                          tmp_path: Any) -> None:
    keys = _curve_dir(tmp_path, "127.0.0.2", "127.0.0.3")
    a = cluster.host(curve_keys=keys)
    b = cluster.host(curve_keys=keys)
    a.watch(b)
    a.board.watch("127.0.0.4:30001")  # a host with no key in a's directory
    wait_until(lambda: a.peer_status(b) is Status.ALIVE, what="b alive on a")
    n = wait_net(a, "degraded", "host_key")
    assert n.listening and n.skipped_hosts == 1 and "127.0.0.4" in (n.error or "")
    rc, doc = status(a)
    assert rc == 4 and doc["network"]["skipped_hosts"] == 1
    kill_is_dead_within_bound(a, "w")
    assert a.pinger is not None and a.pinger.poll() is None
    a.board.unwatch("127.0.0.4:30001")
    wait_net(a, "listening")
    assert a.peer_status(b) is Status.ALIVE


# -- no listen address: no network half at all ---------------------------------------------

def test_no_listen_address_means_no_network_half_and_no_pings(cluster: Cluster,
                                                             fake_peers: list[FakePeer]) -> None:
    fake = FakePeer(cluster.spare_ip(), shmhb.DEFAULT_PORT)
    fake_peers.append(fake)
    a = cluster.host(start=False)
    a.board.watch(f"{fake.ip}:30001")
    p = a.start_pinger(configure=False, wait=False)
    wait_held(a, p)
    n = wait_net(a, "not configured")
    assert n.working and not n.listening
    assert fake.poll_ping(1.0) is None, "an unconfigured agent pinged the default port"
    assert a.peer(fake.ip) is None
    assert status(a)[0] == 0
    kill_is_dead_within_bound(a, "w")


# -- status: no running observer -------------------------------------------------------------

def test_status_exits_3_without_a_running_agent(cluster: Cluster) -> None:
    a = cluster.host(start=False)
    assert status(a)[0] == 0  # an empty board is not an error
    w = cluster.procs.worker(a.name, "w0", agent=False)  # a worker, and nobody watches it
    rc, doc = status(a)
    assert rc == 3 and "no agent has run" in doc["health"]["problems"][0]
    w.terminate()
    assert w.wait(10) == 0
    assert status(a)[0] == 0  # every worker left: nothing to watch
    w = cluster.procs.worker(a.name, "w1", agent=False)
    p = a.start_pinger()
    assert status(a)[0] == 0
    with stopped(p.pid):
        wait_until(lambda: a.board.agent().status is Status.SUSPECT, what="agent stale")
        rc, doc = status(a)
        assert rc == 3 and "stalled" in doc["health"]["problems"][0]
    p.send_signal(signal.SIGTERM)
    assert p.wait(10) == 0
    rc, doc = status(a)
    assert rc == 3 and "left" in doc["health"]["problems"][0]  # w1 lives, unwatched
    w.terminate()
    assert w.wait(10) == 0
    assert status(a)[0] == 0  # the agent left cleanly and so did every worker
    p = a.start_pinger()
    p.kill()  # an agent that died is a problem even with nothing registered
    p.wait(10)
    wait_until(lambda: a.board.agent().status is not Status.ALIVE, what="agent stale")
    assert status(a)[0] == 3


def test_a_pinger_that_does_not_run_is_unhealthy_while_the_hosts_it_follows_read_unknown(
        cluster: Cluster) -> None:
    """No worker, and the pinger stopped, or refused at each start after an earlier run
    stored its settings and left: the board's remote hosts read unknown (and this host
    reads left or dead to them), so ``status`` must not call the host healthy."""
    b = cluster.host()
    a = cluster.host(peers=(b.listen,))
    wait_until(lambda: a.peer_status(b) is Status.ALIVE, what="A follows B")
    assert status(a)[0] == 0
    assert a.pinger is not None
    a.pinger.send_signal(signal.SIGTERM)
    assert a.pinger.wait(10) == 0
    for _ in range(2):
        rc, doc = status(a)
        assert rc == 3, doc["health"]
        assert "1 remote host(s) this board follows read unknown" in doc["health"]["problems"][0]
        assert any("no `shmhb pinger` daemon runs" in p for p in doc["health"]["problems"])
        assert [p["status"] for p in doc["peers"]] == ["unknown"]
        # a start refused at the door (here a policy the board does not have): still so
        refused = subprocess.run(a.pinger_cmd() + ["--dead-after-s", "99"], capture_output=True,
                                 text=True, timeout=60, env=child_env())
        assert refused.returncode == 2, refused
    a.start_pinger()
    wait_until(lambda: status(a)[0] == 0, what="healthy again once the pinger runs")


def test_the_last_embedded_worker_leaving_leaves_a_healthy_board(cluster: Cluster) -> None:
    a = cluster.host(start=False)
    w = cluster.procs.worker(a.name, "only", agent=True)  # holds the role embedded
    wait_until(lambda: a.board.agent().pid == w.pid and a.board.agent().status is Status.ALIVE,
               what="the worker holds the role")
    assert status(a)[0] == 0
    w.terminate()
    assert w.wait(10) == 0
    wait_until(lambda: a.board.agent().status is Status.LEFT, what="the agent left")
    rc, doc = status(a)
    assert rc == 0, doc["health"]
    # no pinger settings were ever stored: as docs/PINGER.md says, whether anyone holds the role
    assert doc["network"]["state"] == "not configured", doc["network"]
    text = subprocess.run([sys.executable, "-m", "shmhb", "status", "--board", a.name],
                          capture_output=True, text=True, timeout=60, env=child_env())
    assert "network not configured" in text.stdout, text.stdout


def test_status_help_documents_every_exit_code() -> None:
    out = subprocess.run([sys.executable, "-m", "shmhb", "status", "--help"], capture_output=True,
                         text=True, timeout=30, env=child_env())
    for code in ("0", "1", "2", "3", "4", "5"):
        assert f"\n  {code}  " in out.stdout, code
    with open(os.path.join(ROOT, "docs", "OPERATIONS.md")) as f:
        doc = f.read()
    for code in ("0", "1", "2", "3", "4", "5"):
        assert f"  | {code} |" in doc, code


# -- bad stored settings and rows -------------------------------------------------------------

def test_a_stored_watch_address_that_cannot_be_pinged_is_skipped(cluster: Cluster) -> None:
    a = cluster.host()
    b = cluster.host()
    a.watch(b)
    _store_raw_watch(a.board, b"a b:1")  # what an older version let in
    wait_until(lambda: a.peer_status(b) is Status.ALIVE, what="b alive on a")
    n = wait_net(a, "degraded", "address")
    assert n.listening and n.skipped_hosts >= 1
    kill_is_dead_within_bound(a, "w")
    # a standby applying the same board runs the same way: no crash loop
    assert a.pinger is not None
    a.kill_pinger()
    standby = a.start_pinger(configure=False)
    wait_net(a, "degraded", "address")
    wait_until(lambda: a.peer_status(b) is Status.ALIVE, what="b alive on a again")
    assert standby.poll() is None


def _store_raw_watch(board: shmhb.Board, address: bytes) -> None:
    """A watch row written as an older version would have (no validation)."""
    from shmhb.board.layout import watch_checksum

    with board_words(board).registry():
        w = board_words(board).watch_table
        i = int(next(iter(i for i in range(len(w)) if int(w[i]["checksum"]) == 0)))
        row = w[i]
        row["owner_pid"] = 0
        row["owner_start"] = 0
        row["refs"] = 1
        row["address"] = address
        row["owner_ns"] = 0
        row["checksum"] = watch_checksum(row)
        board._head["reg_gen"] = int(board._head["reg_gen"]) + 1


def test_stored_settings_are_reapplied_by_a_standby_with_the_same_state(cluster: Cluster) -> None:
    a = cluster.host()
    rc, doc = status(a)
    assert rc == 0 and doc["network"]["state"] == "listening"
    assert doc["network"]["listen"] == a.listen and doc["network"]["settings_gen"] >= 1
    gen = doc["network"]["settings_gen"]
    store_config(a.board, shmhb.PingerConfig(listen=a.listen, interval_s=0.1))
    wait_until(lambda: a.board.network().settings_gen == gen + 1, what="new settings applied")
    wait_net(a, "listening")


def test_a_stored_endpoint_over_the_wire_limit_is_left_out_of_the_digest(cluster: Cluster) -> None:
    from shmhb.board.layout import encode_endpoints, pack_hb, record_checksum
    from shmhb.procinfo import own_pid_namespace, start_time

    a = cluster.host()
    b = cluster.host()
    b.watch(a)
    a.worker("ok-0", a.endpoint(1))
    wait_until(lambda: (r := b.remote(a.endpoint(1))) is not None and r.status is Status.ALIVE,
               what="ok-0 alive on b")
    # a registration as an older version stored it: an endpoint the wire cannot carry
    long_ep = "decode-rank-3.decode-headless.llm-inference-prod.svc.cluster.local:30003"
    board = a.board
    with board_words(board).registry():
        i = next(i for i in range(board.sizes.nslots) if int(board._hb[i]) == 0)
        inc = int(board._head["inc_counter"]) + 1
        board._head["inc_counter"] = inc
        rec = board._records[i]
        rec["checksum"] = 0
        rec["incarnation"], rec["pid"] = inc, os.getpid()
        rec["pid_start"], rec["pid_ns"] = start_time() or 0, own_pid_namespace()
        rec["registered_ns"] = time.monotonic_ns()
        rec["key"], rec["endpoints"] = b"old-long", encode_endpoints((long_ep,))
        rec["checksum"] = record_checksum(rec)
        board._hb[i] = pack_hb(inc, time.monotonic_ns() >> 20)
        board._head["reg_gen"] = int(board._head["reg_gen"]) + 1
    a.worker("ok-1", a.endpoint(2))  # a change after it: the digest is rebuilt with both
    wait_until(lambda: (r := b.remote(a.endpoint(2))) is not None and r.status is Status.ALIVE,
               what="ok-1 alive on b")
    # The worker itself is valid and alive: it is reported, without the endpoint the wire
    # cannot carry (the board's readers drop that one endpoint, never the whole slot).
    p = b.peer(a)
    assert p is not None
    eps = {s.key: s.endpoints for s in p.slots}
    assert all(long_ep not in e for e in eps.values()), eps
    assert eps.get("old-long", ()) == (), eps
    assert a.pinger is not None and a.pinger.poll() is None
    kill_is_dead_within_bound(a, "w")
    with board_words(board).registry():
        board._hb[i] = 0
        board._records[i]["checksum"] = 0


# -- a secret that differs between two hosts: named, not read as a death -------------------

def test_a_secret_mismatch_names_the_host_and_fails_status(cluster: Cluster, tmp_path: Any) -> None:
    from shmhb.cli.exporter import BoardCollector

    good = write_secret(os.path.join(str(tmp_path), "s1"), SECRET)
    other = write_secret(os.path.join(str(tmp_path), "s2"), b"another-secret-0123456789abcdef!")
    b = cluster.host(secret_file=other, start=False)
    a = cluster.host(secret_file=good, peers=(b.ip,))
    b.peers = (a.ip,)
    b.start_pinger()
    for h, o in ((a, b), (b, a)):  # each reads the other's frames as failing authentication
        wait_until(lambda h=h, o=o: (p := h.peer(o)) is not None and p.auth_failing
                   and p.auth_failures >= 2, timeout_s=20, what=f"{h} names {o} auth failing")
    rc, doc = status(a)
    assert rc == 4, doc["health"]
    named = [m for m in doc["health"]["problems"] if b.ip in m and "authentication fails" in m]
    assert named and "--secret-file" in named[0], doc["health"]
    peer = next(p for p in doc["peers"] if p["address"].startswith(b.ip))
    assert peer["auth_failing"] is True and peer["auth_failures"] >= 2
    text = subprocess.run([sys.executable, "-m", "shmhb", "status", "--board", a.name],
                          capture_output=True, text=True, timeout=60, env=child_env())
    assert text.returncode == 4 and "(auth fails)" in text.stdout
    assert f"problem: host {b.ip}" in text.stdout, text.stdout
    fams = {m.name: m for m in BoardCollector(a.name).collect()}
    bad = [s for s in fams["shmhb_peer_bad_auth_frames"].samples if s.name.endswith("_total")]
    assert bad and bad[0].labels["peer"].startswith(b.ip) and bad[0].value >= 2
    assert [s.value for s in fams["shmhb_peer_auth_failing"].samples] == [1]
    # the same secret on both: the flag clears (the count stays), status is healthy again
    b.kill_pinger()
    b.secret_file = good
    b.start_pinger()
    wait_until(lambda: (p := a.peer(b)) is not None and p.status is Status.ALIVE
               and not p.auth_failing, timeout_s=20, what="a reads b alive, auth passing")
    wait_until(lambda: status(a)[0] == 0, timeout_s=20, what="a healthy again")


def test_a_secret_file_holds_one_secret_or_two_lines(tmp_path: Any) -> None:
    from shmhb.net.protocol import Secrets

    one = write_secret(os.path.join(str(tmp_path), "one"), SECRET + b"\n")
    assert read_secret(one) == Secrets(SECRET)
    two = write_secret(os.path.join(str(tmp_path), "two"), SECRET + b"\r\n" + b"x" * 16 + b"\n")
    assert read_secret(two) == Secrets(SECRET, b"x" * 16)
    three = write_secret(os.path.join(str(tmp_path), "three"), b"\n".join([SECRET] * 3))
    with pytest.raises(shmhb.InvalidConfig, match="3 lines"):
        read_secret(three)
    short = write_secret(os.path.join(str(tmp_path), "short"), SECRET + b"\nshort")
    with pytest.raises(shmhb.InvalidConfig, match="shorter than 16 bytes"):
        read_secret(short)
