"""Host verdicts with a fake clock: silence, our own pauses, and self-doubt."""

from __future__ import annotations


from shmhb import FakeClock, Status
from shmhb.board.judge import Thresholds
from shmhb.board.layout import ts_units
from shmhb.net.suspicion import PeerState, Suspicion


S = 10**9
TH = Thresholds(ts_units(2 * S), ts_units(10 * S), ts_units(S), ts_units(S), ts_units(5 * S))
TICK = S // 20


def run(susp: Suspicion, peers: list[PeerState], clock: FakeClock, seconds: float,
        acking: tuple[PeerState, ...] = (), every_ticks: int = 4) -> None:
    """Tick every 50 ms for ``seconds``, a ping to every peer every ``every_ticks``
    ticks (0.2 s by default), the ``acking`` ones answering at once."""
    for k in range(int(seconds * 20)):
        clock.advance(TICK / S)
        if k % every_ticks == 0:
            for p in peers:
                susp.on_ping(p, clock.monotonic_ns())
        for p in acking:
            susp.on_ack(p, clock.monotonic_ns(), 1000)
        susp.tick(peers, clock.monotonic_ns())


def test_unknown_until_first_ack_then_alive_suspect_dead() -> None:
    c = FakeClock()
    s = Suspicion(TH, late_ns=S // 5)
    p = PeerState("h:1")
    s.tick([p], c.monotonic_ns())
    assert p.status is Status.UNKNOWN
    assert s.on_ack(p, c.monotonic_ns(), 70_000) is Status.UNKNOWN
    assert p.status is Status.ALIVE
    run(s, [p], c, 0.9)
    assert p.status is Status.ALIVE
    run(s, [p], c, 0.2)
    assert p.status is Status.SUSPECT
    run(s, [p], c, 4.0)
    assert p.status is Status.DEAD
    s.on_ack(p, c.monotonic_ns(), 70_000)
    assert p.status is Status.ALIVE


def test_a_host_that_never_answers_is_convicted_by_silence() -> None:
    c = FakeClock()
    s = Suspicion(TH, late_ns=S // 5)
    p = PeerState("h:1")
    run(s, [p], c, 6)
    assert p.status is Status.DEAD


def test_our_own_pause_is_not_held_against_peers() -> None:
    c = FakeClock()
    s = Suspicion(TH, late_ns=S // 5)
    p = PeerState("h:1")
    s.on_ack(p, c.monotonic_ns(), 1)
    run(s, [p], c, 0.5)
    c.advance(30)  # we were stopped for 30 s
    s.tick([p], c.monotonic_ns())
    assert p.status is Status.ALIVE and p.silent_ns < S
    # right after the pause, even real silence does not convict until we trust ourselves again
    run(s, [p], c, 0.9)
    assert p.status is not Status.DEAD


def test_all_peers_silent_at_once_stops_at_suspect() -> None:
    c = FakeClock()
    s = Suspicion(TH, late_ns=S // 5)
    peers = [PeerState(f"h:{i}") for i in range(3)]
    for p in peers:
        s.on_ack(p, c.monotonic_ns(), 1)
    run(s, peers, c, 30)
    assert all(p.status is Status.SUSPECT for p in peers)
    # one host answers again: we trust ourselves, the others are convicted
    run(s, peers, c, 6, acking=(peers[0],))
    assert peers[0].status is Status.ALIVE
    assert peers[1].status is Status.DEAD and peers[2].status is Status.DEAD


def test_inbound_pings_prove_our_network_works() -> None:
    c = FakeClock()
    s = Suspicion(TH, late_ns=S // 5)
    peers = [PeerState(f"h:{i}") for i in range(2)]
    for p in peers:
        s.on_ack(p, c.monotonic_ns(), 1)
    for k in range(6 * 20):
        c.advance(TICK / S)
        if k % 4 == 0:
            for p in peers:
                s.on_ping(p, c.monotonic_ns())
        s.inbound(c.monotonic_ns())
        s.tick(peers, c.monotonic_ns())
    assert all(p.status is Status.DEAD for p in peers)


def test_a_ping_that_waited_suspect_after_unanswered_counts_as_missed() -> None:
    """Pings 1.67 s apart (250 hosts at the defaults): after two unanswered pings the
    host is SUSPECT once the second has waited peer_suspect_after (1 s here), not only
    at the third turn, which comes with DEAD."""
    c = FakeClock()
    s = Suspicion(TH, late_ns=S // 5)
    p = PeerState("h:1")
    t0 = c.monotonic_ns()
    s.tick([p], t0)
    s.on_ack(p, t0, 1)
    gap = 5 * S // 3
    pings = [t0 + gap, t0 + 2 * gap]
    seen: list[tuple[int, Status]] = []
    for _ in range(int(4.6 * 20)):
        c.advance(TICK / S)
        now = c.monotonic_ns()
        if pings and now >= pings[0]:
            s.on_ping(p, now)
            pings.pop(0)
        for _p, _old, new in s.tick([p], now):
            seen.append((now - t0, new))
        if now - t0 < 2 * gap + S:  # the second ping has not waited 1 s yet: one missed
            assert p.status is Status.ALIVE and s.missed(p, now) <= 1, (now - t0) / S
    assert seen == [(seen[0][0], Status.SUSPECT)]
    assert 2 * gap + S <= seen[0][0] < 2 * gap + S + 2 * TICK
