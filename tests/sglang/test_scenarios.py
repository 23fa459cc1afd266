"""SGLang 0.5.23's P/D on Mooncake with shmhb's wrapper: a prefill killed, stopped or
restarted fails the decode's rooms within a poll of the board's verdict (stock SGLang:
its health check, 2 x 5 s here; 300 s after a fast restart), the stale entries are
evicted so the next room reaches a restarted prefill, and no byte lands in pages the
decode gave up.  Real processes on 127.0.0.2 (prefill) and 127.0.0.3 (decode), each host
with its board and pinger."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import wait_until

from .conftest import make_stack, require_sglang

require_sglang()

from .engine import expected_digest, zeros_digest  # noqa: E402
from .stack import Rank, Stack, alive_on_decode_host, new_room  # noqa: E402

pytestmark = pytest.mark.system

#: the wrapped decode fails a room this soon after its prefill is killed (the board's
#: verdict is a pidfd read plus a push; the rest is load on a shared 2-core machine);
#: stock SGLang takes its health check, 2 failures x 5 s, here
FAST_S = 2.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: Any) -> Iterator[Stack]:
    yield from make_stack(tmp_path_factory, wrapped=True)


def live(stack: Stack, role: str) -> Rank:
    return [r for r in stack.ranks if r.role == role and r.p.poll() is None][-1]


def prefill(stack: Stack) -> Rank:
    return live(stack, "prefill") if any(
        r.role == "prefill" and r.p.poll() is None for r in stack.ranks) else stack.start("prefill")


def decode(stack: Stack) -> Rank:
    return live(stack, "decode") if any(
        r.role == "decode" and r.p.poll() is None for r in stack.ranks) else stack.start("decode")


def served(p: Rank, d: Rank, seed: int = 1) -> None:
    room = new_room()
    p.send("prefill", room=room, seed=seed)
    d.send("recv", room=room, bootstrap=p.bootstrap)
    ev = d.expect("received", "recv_failed", room=room, timeout_s=60)
    assert ev["ev"] == "received", ev
    assert ev["digest"] == expected_digest(seed, 64)
    p.expect("sent", room=room)


def test_wrapped_ranks_serve_a_room(stack: Stack) -> None:
    p, d = prefill(stack), decode(stack)
    assert d.ready["manager"] == "shmhb.sglang.manager", "the plugin did not install the wrapper"
    served(p, d)
    port = stack.bootstrap_port
    keys = {s.key: s for s in stack.prefill_host.board.slots()}
    rank = keys[f"sglang/p/{p.bootstrap}/dp0/tp0/pp0"]
    assert rank.pid == p.pid and p.bootstrap in rank.endpoints, rank
    assert f"{p.ip}:{p.ready['rank_port']}" in rank.endpoints, rank
    assert f"inst/prefill/{port}/sglang-{p.ip}-{port}" in keys, sorted(keys)  # for routers
    assert any(s.key.startswith("sglang/d/") and s.pid == d.pid
               for s in stack.decode_host.board.slots())


def test_prefill_killed_while_the_decode_waits_fails_the_room_at_once(stack: Stack) -> None:
    p, d = prefill(stack), decode(stack)
    served(p, d)  # the decode knows the prefill (its tables hold it)
    alive_on_decode_host(stack, p)
    room = new_room()
    p.send("prefill", room=room, seed=2, hold=True)  # bootstrapped, never computed
    d.send("recv", room=room, bootstrap=p.bootstrap)
    p.expect("waiting", room=room)
    t_kill = p.kill()
    ev = d.expect("recv_failed", room=room, timeout_s=30)
    print(f"room failed {ev['t'] - t_kill:.3f} s after the kill: {ev['reason']}")
    assert ev["t"] - t_kill < FAST_S, ev
    assert "shmhb" in ev["reason"]
    st = d.request("state", "state")
    assert p.bootstrap not in st["rooms"]
    assert not any(k.startswith(p.bootstrap) for k in st["connection_pool"]), st
    assert p.bootstrap not in st["prefill_info_table"], st
    # restarted on the same address: the next room reaches the new process
    p2 = stack.start("prefill")
    served(p2, d, seed=3)


def test_prefill_killed_before_the_room_no_room_goes_to_its_port(stack: Stack) -> None:
    p, d = prefill(stack), decode(stack)
    served(p, d)
    alive_on_decode_host(stack, p)
    p.kill()
    room = new_room()
    d.send("recv", room=room, bootstrap=p.bootstrap)
    ev = d.expect("received", "recv_failed", room=room, timeout_s=30)
    assert ev["ev"] == "recv_failed", ev
    assert ev["after_s"] < FAST_S, ev
    assert d.request("digest", "digest")["digest"] == zeros_digest(64)
    p2 = stack.start("prefill")
    served(p2, d, seed=4)


def test_prefill_stopped_while_the_decode_waits_never_writes_after_the_give_up(
        stack: Stack) -> None:
    """SIGSTOP: the decode fails the room at the board's DEAD (dead-after, 2 s here) and
    gives its go-ahead up; the prefill, resumed with the room in hand, asks, is refused,
    writes nothing and frees the room; then it serves again."""
    p, d = prefill(stack), decode(stack)
    served(p, d)
    alive_on_decode_host(stack, p)
    room = new_room()
    p.send("prefill", room=room, seed=5, hold=True)
    d.send("recv", room=room, bootstrap=p.bootstrap)
    p.expect("waiting", room=room)
    t_stop = p.stop()
    p.send("go", room=room)  # read when it resumes: the write it was about to do
    ev = d.expect("recv_failed", room=room, timeout_s=30)
    print(f"room failed {ev['t'] - t_stop:.3f} s after the stop: {ev['reason']}")
    assert ev["t"] - t_stop < 2.0 + FAST_S, ev
    p.cont()
    sent = p.expect("sent", "send_failed", room=room, timeout_s=30)
    assert sent["ev"] == "send_failed", sent
    assert "no go-ahead" in sent["reason"] or "gone" in sent["reason"], sent
    assert d.request("digest", "digest")["digest"] == zeros_digest(64), "a write landed after the give-up"
    alive_on_decode_host(stack, p)
    served(p, d, seed=6)


def test_decode_killed_while_the_prefill_holds_its_room_frees_it_at_once(stack: Stack) -> None:
    p, d = prefill(stack), decode(stack)
    served(p, d)
    room = new_room()
    p.send("prefill", room=room, seed=7, hold=True)
    d.send("recv", room=room, bootstrap=p.bootstrap)
    p.expect("waiting", room=room)
    t_kill = d.kill()
    ev = p.expect("send_failed", room=room, timeout_s=30)
    print(f"prefill room freed {ev['t'] - t_kill:.3f} s after the decode's kill: {ev['reason']}")
    assert ev["t"] - t_kill < FAST_S, ev
    assert "decode" in ev["reason"] and "shmhb" in ev["reason"], ev
    served(p, decode(stack), seed=8)


def test_a_suspect_prefill_convicts_nothing(stack: Stack) -> None:
    """Stopped past suspect-after but resumed before dead-after (a long pause): the
    room it holds is written and served, as if nothing happened."""
    from shmhb import Status
    p, d = prefill(stack), decode(stack)
    served(p, d)
    alive_on_decode_host(stack, p)
    ep = f"{p.ip}:{p.ready['rank_port']}"
    room = new_room()
    p.send("prefill", room=room, seed=12, hold=True)
    d.send("recv", room=room, bootstrap=p.bootstrap)
    p.expect("waiting", room=room)
    p.stop()
    try:
        wait_until(lambda: (s := stack.decode_host.board.remote(ep)) is not None
                   and s.status is Status.SUSPECT, timeout_s=1.8, poll_s=0.01,
                   what="the prefill SUSPECT on the decode host")
    finally:
        p.cont()
    p.send("go", room=room)
    ev = d.expect("received", "recv_failed", room=room, timeout_s=30)
    assert ev["ev"] == "received" and ev["digest"] == expected_digest(12, 64), ev
