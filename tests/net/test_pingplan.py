"""The ping budget (shmhb.net.plan) with a fake clock: rates, phases, newcomers, stalls,
mutual pairs; and, with shmhb.net.suspicion, the verdict bounds it must keep."""

from __future__ import annotations

import math

import pytest

from shmhb import FakeClock, Status
from shmhb.board.judge import Thresholds
from shmhb.board.layout import ts_units
from shmhb.net.plan import (
    BATCH_NS, DEFAULT_BUDGET_PPS, LONG_REFRESH, MIN_PINGS_PER_WINDOW, PingPlan, host_interval_ns,
)
from shmhb.net.suspicion import PeerState, Suspicion


S = 10**9
TICK = S // 20  # a fast tick (the agent's default is 0.1 s; the plan is the same at any)
DEAD = 5 * S  # the default peer_dead_after
TH = Thresholds(ts_units(2 * S), ts_units(10 * S), ts_units(S), ts_units(S), ts_units(DEAD))


def hosts(n: int) -> list[str]:
    return [f"10.0.{i // 250}.{i % 250 + 1}:45645" for i in range(n)]


def plan(n: int, budget: float = DEFAULT_BUDGET_PPS, *, now: int = 0, **kw: object) -> PingPlan:
    p = PingPlan(budget, S // 5, DEAD, **kw)  # type: ignore[arg-type]
    p.set_hosts(hosts(n), now)
    return p


def drive(p: PingPlan, seconds: float, start: int = 0, tick: int = TICK) -> list[tuple[int, str]]:
    out = []
    for k in range(1, int(seconds * S / tick) + 1):
        now = start + k * tick
        out.extend((now, h) for h in p.due(now))
    return out


@pytest.mark.parametrize(("n", "want_s"), [(1, 0.2), (10, 0.2), (20, 0.4), (40, 0.8), (64, 1.28),
                                           (83, 1.66), (84, 5 / 3), (250, 5 / 3)])
def test_interval_grows_with_the_cluster_under_the_budget_and_stops_at_the_floor(n: int, want_s: float) -> None:
    assert host_interval_ns(n, DEFAULT_BUDGET_PPS, S // 5, DEAD) == pytest.approx(want_s * S, rel=1e-6)
    p = plan(n)
    assert p.rate_pps <= DEFAULT_BUDGET_PPS * 1.001 or p.over_budget
    assert p.over_budget == (n > DEFAULT_BUDGET_PPS * DEAD / S / MIN_PINGS_PER_WINDOW)
    assert p.interval_ns <= DEAD // MIN_PINGS_PER_WINDOW or p.interval_ns == S // 5


@pytest.mark.parametrize("n", [3, 40, 64, 250])
def test_pings_are_even_across_batches_and_one_interval_apart_per_host(n: int) -> None:
    p = plan(n)
    sent = drive(p, 20)
    per_batch: dict[int, int] = {}
    for t, _ in sent:
        per_batch[t] = per_batch.get(t, 0) + 1
    rate = p.rate_pps
    assert abs(len(sent) / 20 - rate) <= n / 20 + 1  # the first round is at once, then the rate
    times = sorted(per_batch)
    batch = min(BATCH_NS, p.interval_ns)  # at most one batch per interval
    assert min(b - a for a, b in zip(times, times[1:])) >= batch * 3 // 4  # batched
    steady = [c for t, c in per_batch.items() if t > 2 * p.interval_ns]
    # never a round at once: no batch carries more than its share (rounded up) plus one
    assert max(steady) <= math.ceil(rate * (batch + TICK) / S) + 1, (max(steady), rate)
    if n >= 40:
        assert max(steady) < n / 2
    last: dict[str, int] = {}
    for t, h in sent:
        if h in last and t > 2 * p.interval_ns:
            assert abs((t - last[h]) - p.interval_ns) <= BATCH_NS + TICK, (h, t - last[h])
        last[h] = t
    assert set(last) == set(hosts(n))


def test_a_newcomer_is_pinged_at_once_and_a_host_that_left_never_again() -> None:
    p = plan(64)
    drive(p, 3)
    now = 3 * S + TICK
    p.set_hosts([*hosts(63), "10.9.9.9:45645"], now)
    assert p.due(now)[0] == "10.9.9.9:45645"
    assert all(h != hosts(64)[63] for _, h in drive(p, 5, start=now))


def test_after_a_stall_each_host_is_pinged_once_not_a_backlog() -> None:
    p = plan(64)
    drive(p, 2)
    burst = p.due(2 * S + 30 * S)  # our loop was stopped for 30 s
    assert sorted(burst) == sorted(set(burst)) and len(burst) <= 64
    after = drive(p, 2, start=32 * S)
    assert len(after) <= p.rate_pps * 2 + 64 / 20 + 1


def test_passive_side_of_a_mutual_pair_skips_while_evidence_is_fresh_and_still_refreshes(
        ) -> None:
    me, other = "10.0.0.9:45645", "10.0.0.1:45645"
    passive = PingPlan(DEFAULT_BUDGET_PPS, S // 5, DEAD)
    active = PingPlan(DEFAULT_BUDGET_PPS, S // 5, DEAD)
    passive.set_hosts([other], 0)
    active.set_hosts([me], 0)
    sent_p = sent_a = 0
    for k in range(1, 30 * 20 + 1):  # 30 s: the active side pings, its pings are evidence
        now = k * TICK
        for _ in active.due(now):
            sent_a += 1
            passive.evidence(other, now, passive=True)
        sent_p += len(passive.due(now))
        active.evidence(me, now, passive=False)  # the active side ignores evidence for its turns
    assert sent_a == pytest.approx(30 * 5, abs=2)
    # the passive side: the first ping, then one refresh per LONG_REFRESH dead-after
    # windows (the active side's pings tell its digest generation)
    every = DEAD * LONG_REFRESH
    assert 30 * S // every - 1 <= sent_p <= 30 * S // every + 2, sent_p
    # the active side stops (died): the passive side's turns come back within 1.5 intervals
    quiet_from = 30 * S
    got = drive(passive, 2, start=quiet_from)
    assert got and got[0][0] - quiet_from <= 1.5 * passive.interval_ns + TICK
    assert len(got) >= 2 * 5 - 3


def test_a_nudged_passive_side_pings_at_its_next_turn_whatever_the_evidence() -> None:
    other = "10.0.0.1:45645"
    passive = PingPlan(DEFAULT_BUDGET_PPS, S // 5, DEAD)
    passive.set_hosts([other], 0)
    assert passive.due(0) == [other]  # the first ping

    def window(k0: int, ticks: int) -> list[tuple[int, str]]:
        out = []
        for k in range(k0, k0 + ticks):  # fresh evidence at every tick
            passive.evidence(other, k * TICK, passive=True)
            out += [(k, h) for h in passive.due(k * TICK)]
        return out

    assert len(window(1, 40)) <= 1  # 2 s of evidence: at most the first refresh
    assert window(41, 40) == []  # then every turn skipped
    passive.nudge(other)  # a push told of a change only an ack carries
    got = window(81, 40)
    assert [h for _, h in got] == [other]  # one ping, then skipping again
    assert (got[0][0] - 81) * TICK <= passive.interval_ns + 2 * TICK


def test_plan_refuses_a_bad_budget() -> None:
    for bad in (0, -1, float("nan"), float("inf"), 1e9):
        with pytest.raises(ValueError):
            PingPlan(bad, S // 5, DEAD)


# -- plan + suspicion: the verdict bounds ---------------------------------------------------

def simulate(n: int, *, die_at_s: float | None, seconds: float, rtt_ns: int = 2_000_000,
             lost_every: int = 0) -> tuple[list[PeerState], dict[str, list[tuple[int, Status]]], int]:
    """n hosts under the default budget, acks ``rtt_ns`` after each ping; host 0 dies at
    ``die_at_s`` (answers nothing after); with ``lost_every`` k, every k-th ping of each
    host is lost.  Returns the peers, each one's transitions (time, new status) and the
    time of host 0's last ack."""
    c = FakeClock()
    start = c.monotonic_ns()
    p = PingPlan(DEFAULT_BUDGET_PPS, S // 5, DEAD)
    addrs = hosts(n)
    p.set_hosts(addrs, start)
    susp = Suspicion(TH, late_ns=S // 4)
    peers = {a: PeerState(a) for a in addrs}
    seen: dict[str, list[tuple[int, Status]]] = {a: [] for a in addrs}
    pending: list[tuple[int, str]] = []
    count: dict[str, int] = {a: 0 for a in addrs}
    last_ack = 0
    for _ in range(int(seconds * S / TICK)):
        c.advance(TICK / S)
        now = c.monotonic_ns()
        dead = die_at_s is not None and now - start >= die_at_s * S
        arrived = [x for x in pending if x[0] <= now]
        pending = [x for x in pending if x[0] > now]
        for _due, a in arrived:
            if not (dead and a == addrs[0]):
                susp.on_ack(peers[a], now, rtt_ns)
                if a == addrs[0]:
                    last_ack = now - start
        for st, _old, new in susp.tick(list(peers.values()), now):
            seen[st.address].append((now - start, new))
        for a in p.due(now):
            susp.on_ping(peers[a], now)
            count[a] += 1
            if not (lost_every and count[a] % lost_every == 0):
                pending.append((now + rtt_ns, a))
    return list(peers.values()), seen, last_ack


@pytest.mark.parametrize("n", [2, 64, 250])
def test_live_hosts_never_flap_at_any_cluster_size_even_losing_every_third_ping(n: int) -> None:
    _, seen, _ = simulate(n, die_at_s=None, seconds=60, lost_every=3, rtt_ns=40_000_000)
    flapped = {a: s for a, s in seen.items() if any(st is not Status.ALIVE for _, st in s)}
    assert not flapped, list(flapped.items())[:3]


def test_seconds_alone_would_flap_at_one_ping_a_second() -> None:
    """The check above can fail: at 250 hosts a live host is silent for about a second
    between acks, as long as peer_suspect_after; only the missed-ping count keeps it ALIVE."""
    c = FakeClock()
    susp = Suspicion(TH, late_ns=S // 4)
    q = PeerState("x")
    susp.on_ping(q, c.monotonic_ns())
    susp.on_ack(q, c.monotonic_ns(), 1)
    for _ in range(25):  # 1.25 s; the next ping went out at 1 s and is not answered yet
        c.advance(TICK / S)
        if c.monotonic_ns() == S:
            susp.on_ping(q, c.monotonic_ns())
        susp.tick([q], c.monotonic_ns())
    assert q.silent_ns > TH.peer_suspect << 20 and q.status is Status.ALIVE
    from shmhb.board.judge import peer_verdict
    assert peer_verdict(q.silent_ns >> 20, TH, self_suspect=False) is Status.SUSPECT


@pytest.mark.parametrize(("n", "die_s"), [(2, 7.03), (64, 7.31), (250, 7.77), (250, 8.5)])
def test_a_dead_host_is_dead_within_dead_after_plus_one_interval_of_its_last_ack(n: int, die_s: float) -> None:
    _peers, seen, last_ack = simulate(n, die_at_s=die_s, seconds=die_s + 10)
    interval = host_interval_ns(n, DEFAULT_BUDGET_PPS, S // 5, DEAD)
    victim = hosts(n)[0]
    assert seen[victim][-1][1] is Status.DEAD, seen[victim]
    t_dead = next(t for t, st in seen[victim] if st is Status.DEAD)
    # (silence accrues a whole tick at the tick after an ack: up to one tick early)
    assert DEAD - TICK <= t_dead - last_ack <= DEAD + interval, (n, (t_dead - last_ack) / S)
    assert [st for t, st in seen[victim] if t > last_ack] == [Status.SUSPECT, Status.DEAD]
    others = [s for a, s in seen.items() if a != victim]
    assert all(st is Status.ALIVE for s in others for _, st in s)


def test_every_host_silent_at_once_still_stops_at_suspect_under_the_budget() -> None:
    c = FakeClock()
    p = PingPlan(DEFAULT_BUDGET_PPS, S // 5, DEAD)
    addrs = hosts(250)
    p.set_hosts(addrs, 0)
    susp = Suspicion(TH, late_ns=S // 4)
    peers = {a: PeerState(a) for a in addrs}
    for q in peers.values():
        susp.on_ack(q, 0, 1)
    for _ in range(30 * 20):  # our network is cut: nobody answers, nobody pings us
        c.advance(TICK / S)
        now = c.monotonic_ns()
        for a in p.due(now):
            susp.on_ping(peers[a], now)
        susp.tick(list(peers.values()), now)
    assert {q.status for q in peers.values()} == {Status.SUSPECT}


def test_evidence_keeps_a_host_alive_but_never_makes_an_unheard_one_alive() -> None:
    c = FakeClock()
    susp = Suspicion(TH, late_ns=S // 4)
    heard, unheard = PeerState("a"), PeerState("b")
    susp.on_ack(heard, 0, 1)
    for k in range(20 * 20):
        c.advance(TICK / S)
        now = c.monotonic_ns()
        if k % 4 == 0:
            susp.on_ping(heard, now)
            susp.on_ping(unheard, now)
        if k % 10 == 0:
            assert susp.on_evidence(unheard, now) is None
            susp.on_evidence(heard, now)
        susp.tick([heard, unheard], now)
    assert heard.status is Status.ALIVE
    assert unheard.status is Status.UNKNOWN


# -- inbound pings as evidence: the pure rule ------------------------------------------------

def test_only_an_authenticated_or_echoing_fresh_ping_naming_our_current_digest_counts() -> None:
    import os

    from shmhb.net.evidence import counts_as_evidence
    from shmhb.net.protocol import Identity, Ping

    them, me, other = (Identity(os.urandom(16), k) for k in (1, 2, 3))
    good = Ping(them, "10.0.0.1:45645", 100, 77, me)
    kw = {"authenticated": True, "known": them, "last_nonce": 99, "me": me, "my_gen": 77}
    assert counts_as_evidence(good, **kw)  # type: ignore[arg-type]
    for change in ({"authenticated": False}, {"known": None}, {"known": other},
                   {"last_nonce": 100}, {"last_nonce": 2**64 - 1}, {"me": other}, {"my_gen": 78}):
        assert not counts_as_evidence(good, **{**kw, **change}), change  # type: ignore[arg-type]
    assert not counts_as_evidence(Ping(them, "10.0.0.1:45645", 100, 0, None), **kw)  # type: ignore[arg-type]
    assert not counts_as_evidence(Ping(other, "10.0.0.1:45645", 100, 77, me), **kw)  # type: ignore[arg-type]
    # without authentication, echoing a challenge we sent that host stands in for it (a
    # connection from its address does not: anyone on that host can open one), and nothing else changes
    plain = {**kw, "authenticated": False, "echoed": True}
    assert counts_as_evidence(good, **plain)  # type: ignore[arg-type]
    for change in ({"echoed": False}, {"known": other}, {"last_nonce": 100},
                   {"my_gen": 78}, {"me": other}):
        assert not counts_as_evidence(good, **{**plain, **change}), change  # type: ignore[arg-type]


def test_a_connection_comes_from_a_host_only_from_the_ip_address_it_is_followed_at() -> None:
    from shmhb.net.evidence import from_host, host_ip

    v4, v6 = host_ip("10.0.0.1"), host_ip("[fd00::1]")
    assert v4 is not None and v6 is not None
    assert from_host("10.0.0.1", v4)
    assert from_host("::ffff:10.0.0.1", v4)  # an IPv4 peer on a dual-stack socket
    assert from_host("fd00::1", v6) and from_host("fd00:0::1", v6)
    for source in ("10.0.0.2", "127.0.0.1", "fd00::2", "", "garbage", "10.0.0.1:45645", None):
        assert not from_host(source, v4) and not from_host(source, v6), source
    # a name is never compared with a source: resolving it is not ours to trust
    assert host_ip("prefill-0.svc.cluster.local") is None
    assert not from_host("10.0.0.1", host_ip("prefill-0.svc.cluster.local"))


def test_pings_never_bind_a_source_address() -> None:
    # libzmq resolves a bound source through getifaddrs() on every reconnect and aborts
    # the process when that fails (EMFILE under a connection flood): the kernel picks
    from shmhb.net.transport import connect_endpoint

    for me in ("127.0.0.2", "::1", "10.0.0.1", "0.0.0.0", None):
        assert ";" not in connect_endpoint(me, "127.0.0.3", 45645)
    assert connect_endpoint("127.0.0.2", "127.0.0.3", 45645) == "tcp://127.0.0.3:45645"
    assert connect_endpoint("::1", "::1", 45645) == "tcp://[::1]:45645"


@pytest.mark.parametrize("die_s", [20.0, 20.4, 20.9, 21.3])
def test_a_dead_host_we_were_passive_to_is_dead_within_dead_after_plus_one_second(die_s: float) -> None:
    """250 hosts, each the active side of its pair with us: their pings are our evidence
    and we skip our turns.  When one dies, our pings to it start as soon as its evidence
    is stale, so DEAD comes within peer_dead_after + 1 s of its last ping (waiting for
    our next turn instead put it up to 1.8 s past)."""
    c = FakeClock()
    start = c.monotonic_ns()
    p = PingPlan(DEFAULT_BUDGET_PPS, S // 5, DEAD)
    addrs = hosts(250)
    p.set_hosts(addrs, start)
    interval = p.interval_ns
    susp = Suspicion(TH, late_ns=S // 4)
    peers = {a: PeerState(a) for a in addrs}
    for q in peers.values():
        susp.on_ack(q, start, 1)
    phase = {a: start + k * interval // len(addrs) for k, a in enumerate(addrs)}
    victim, last_ev, t_dead = addrs[0], 0, None
    for _ in range(int((die_s + 10) * S / TICK)):
        c.advance(TICK / S)
        now = c.monotonic_ns()
        dead = now - start >= die_s * S
        for a in addrs:  # their pings, every interval at their own phase
            if now >= phase[a]:
                phase[a] += interval
                if not (dead and a == victim):
                    susp.on_evidence(peers[a], now)
                    p.evidence(a, now, passive=True)
                    if a == victim:
                        last_ev = now
        for st, old, new in susp.tick(list(peers.values()), now):
            assert st.address == victim, (st.address, old, new)  # no live host flaps
            if new is Status.DEAD and t_dead is None:
                t_dead = now
        for a in p.due(now):
            susp.on_ping(peers[a], now)
            if not (dead and a == victim):
                susp.on_evidence(peers[a], now)  # its ack, at once
    assert t_dead is not None
    assert DEAD - TICK <= t_dead - last_ev <= DEAD + S, (t_dead - last_ev) / S
