"""Terminal injection: keys with C1 controls (U+009B CSI, U+0085 NEL)
or bidi overrides (U+202E) are refused at every door -- ``check_key`` for local workers,
the digest decoder for a remote host's entries -- and whatever reaches a terminal, a
log line or a Prometheus label is escaped anyway."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

import shmhb
from shmhb import Status
from shmhb.net.protocol import Ack, decode, encode_ack
from shmhb.board.records import check_key, shown

from ..conftest import ROOT, wait_until
from ..hosts import Cluster, FakePeer, entry

EVIL = ("\u009b31m", "\u0085problem: none", "\u202egnp.exe", "\u2028x", "\u200bzw")


@pytest.mark.parametrize("tail", EVIL, ids=ascii)
def test_check_key_refuses_c1_controls_and_bidi_overrides(board: shmhb.Board, tail: str) -> None:
    with pytest.raises(shmhb.InvalidKey, match="control, format or separator"):
        check_key("rank-0" + tail)
    with pytest.raises(shmhb.InvalidKey):
        board.register("rank-0" + tail)
    assert board.slots() == []
    check_key("décode-ранг-0 x")  # printable text in any script stays welcome


def test_shown_escapes_what_steers_a_terminal() -> None:
    assert shown("rank-0") == "rank-0"
    assert shown("a\u009b31mb\u202ec\u0085d\x1b") == "a\\u009b31mb\\u202ec\\u0085d\\u001b"
    assert all(shown("k" + t).isprintable() for t in EVIL)


def _forged(frame: bytes, placeholder: str, evil: str) -> bytes:
    """``frame`` with ``placeholder`` replaced by ``evil`` (same UTF-8 length): what a
    hostile or older sender puts on the wire; encode_ack itself refuses it now."""
    a, b = placeholder.encode(), evil.encode()
    assert len(a) == len(b) and frame.count(a) == 1
    return frame.replace(a, b)


def test_a_remote_digest_cannot_inject_keys(cluster: Cluster, fake_peers: list[FakePeer]) -> None:
    a = cluster.host()
    c = FakePeer(cluster.spare_ip(), cluster.port)
    fake_peers.append(c)
    c.set(entry("good", 5, Status.ALIVE, f"{c.ip}:30001"),
          entry("evilQQproblem: none", 6, Status.ALIVE, f"{c.ip}:30002"),
          entry("bidiQQQgnp", 7, Status.ALIVE, f"{c.ip}:30003"))
    # the decoder drops those entries and keeps the rest of the digest
    probe = _forged(_forged(encode_ack(Ack(1, c.identity, c.address, c.gen, True,
                                           tuple(c.entries.values()))),
                            "QQp", "\u0085p"), "QQQg", "\u202eg")
    got = decode(probe)
    assert isinstance(got, Ack) and [e.key for e in got.entries] == ["good"]
    a.board.watch(f"{c.ip}:30001")

    def answer() -> bool:
        p = c.poll_ping(0.05)
        if p is not None:
            c.send(_forged(_forged(c.ack_frame(p.nonce), "QQp", "\u0085p"), "QQQg", "\u202eg"))
        r = a.remote(f"{c.ip}:30001")
        return r is not None and r.status is Status.ALIVE
    wait_until(answer, timeout_s=20, poll_s=0, what="the good key alive on a")
    deadline = time.monotonic() + 1.0  # a few more acks: the evil rows would be there by now
    while time.monotonic() < deadline:
        answer()
    peer = a.board.peer(c.ip)
    assert peer is not None and [s.key for s in peer.slots] == ["good"]
    for args in (("status",), ("events",)):
        out = subprocess.run([sys.executable, "-m", "shmhb", *args, "--board", a.board.name],
                             cwd=ROOT, capture_output=True, timeout=60).stdout.decode()
        assert "good" in out and out.isprintable() or all(
            line.isprintable() for line in out.split("\n")), ascii(out)
        for bad in ("\u0085", "\u202e", "\u009b"):
            assert bad not in out, (args, ascii(out))
