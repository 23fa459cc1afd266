"""Judging is pure: words and a clock in, a status out.  Fake clock, no sleeps."""

from __future__ import annotations

import numpy as np
import pytest

from shmhb import FakeClock, Status
from shmhb.board import layout as L
from shmhb.board.judge import (
    Thresholds, combine_remote, judge_agent, judge_local, judge_local_array,
    judge_local_array_numpy, judge_row, peer_verdict,
)


TH = Thresholds(suspect=L.ts_units(2 * 10**9), dead=L.ts_units(10 * 10**9),
                agent_stale=L.ts_units(10**9), peer_suspect=L.ts_units(10**9),
                peer_dead=L.ts_units(5 * 10**9))


def now(clock: FakeClock) -> int:
    return L.ts_units(clock.monotonic_ns())


def test_fake_clock_refuses_to_go_backwards() -> None:
    c = FakeClock()
    c.advance(1.5)
    with pytest.raises(ValueError):
        c.advance(-0.1)
    with pytest.raises(ValueError):
        c.set_ns(c.monotonic_ns() - 1)


def test_local_slot_ages_through_suspect_to_dead_and_recovers() -> None:
    c = FakeClock()
    hb = L.pack_hb(7, now(c))
    assert judge_local(hb, 0, now(c), TH)[0] is Status.ALIVE
    c.advance(1.9)
    assert judge_local(hb, 0, now(c), TH)[0] is Status.ALIVE
    c.advance(0.2)
    assert judge_local(hb, 0, now(c), TH)[0] is Status.SUSPECT
    c.advance(8.0)
    st, age = judge_local(hb, 0, now(c), TH)
    assert st is Status.DEAD and L.units_to_s(age) == pytest.approx(10.1, abs=0.01)
    hb = L.pack_hb(7, now(c))  # the hung worker resumes: same incarnation, alive again
    assert judge_local(hb, 0, now(c), TH)[0] is Status.ALIVE


def test_verdict_applies_only_to_its_incarnation() -> None:
    c = FakeClock()
    hb = L.pack_hb(7, now(c))
    v = L.pack_verdict(7, now(c))
    assert judge_local(hb, v, now(c), TH)[0] is Status.DEAD
    hb8 = L.pack_hb(8, now(c))  # restarted: the old verdict no longer applies
    assert judge_local(hb8, v, now(c), TH)[0] is Status.ALIVE


def test_left_wins_over_everything() -> None:
    c = FakeClock()
    hb = L.pack_hb(3, now(c), left=True)
    c.advance(100)
    assert judge_local(hb, L.pack_verdict(3, now(c)), now(c), TH)[0] is Status.LEFT


def test_beat_after_the_readers_clock_reading_is_age_zero() -> None:
    c = FakeClock()
    t = now(c)
    c.advance(0.5)
    assert judge_local(L.pack_hb(1, now(c)), 0, t, TH) == (Status.ALIVE, 0)


def test_array_judging_matches_scalar_judging(hot_path: str) -> None:
    rng = np.random.default_rng(1)
    c = FakeClock(start_ns=10**13)
    t = now(c)
    hbs, vs = [0], [0]
    for _ in range(2000):
        inc = int(rng.integers(1, 1 << 24))
        ts = t - int(rng.integers(0, TH.dead * 2)) + int(rng.integers(0, 3))
        hbs.append(L.pack_hb(inc, ts, left=bool(rng.random() < 0.1)))
        r = rng.random()
        vs.append(L.pack_verdict(inc if r < 0.2 else inc ^ 1, ts) if r < 0.4 else 0)
    # the edges: a beat stamped after the clock read, the largest timestamp and
    # incarnation, a verdict on the largest incarnation, an empty slot among full ones
    hbs += [L.pack_hb(1, t + 5), L.pack_hb(L.INC_MASK, L.TS39_MASK), 0]
    vs += [0, L.pack_verdict(L.INC_MASK, 0), L.pack_verdict(7, t)]
    codes, ages = judge_local_array(np.array(hbs, np.uint64), np.array(vs, np.uint64), t, TH)
    assert codes.dtype == np.uint8 and ages.dtype == np.uint64 and len(codes) == len(hbs)
    seen = set()
    for k in range(len(hbs)):
        if hbs[k] == 0:
            assert codes[k] == 0
            continue
        st, age = judge_local(hbs[k], vs[k], t, TH)
        assert (codes[k], ages[k]) == (st.code, age), k
        seen.add(st)
    assert seen == {Status.ALIVE, Status.SUSPECT, Status.DEAD, Status.LEFT}
    if hot_path == "native":  # the C pass gives the numpy twin's arrays (on the pure
        # path judge_local_array *is* the twin: nothing to compare)
        hb_a, v_a = np.array(hbs, np.uint64), np.array(vs, np.uint64)
        py_codes, py_ages = judge_local_array_numpy(hb_a, v_a, t, TH)
        assert (py_codes == codes).all() and (py_ages == ages).all()


def test_array_judging_refuses_arrays_it_cannot_read(hot_path: str) -> None:
    hb = np.array([L.pack_hb(1, 5)] * 4, np.uint64)
    v = np.zeros(4, np.uint64)
    if hot_path == "native":  # the C pass reads raw buffers: it checks them first
        for bad_hb, bad_v in ((hb.astype(np.int64), v), (hb, v[:3]), (hb[::2], v[::2]),
                              (hb.reshape(2, 2), v.reshape(2, 2)), (hb, v.astype(np.uint32))):
            with pytest.raises(ValueError):
                judge_local_array(bad_hb, bad_v, 10, TH)
    codes, ages = judge_local_array(hb, v, 10, TH)
    assert list(codes) == [Status.ALIVE.code] * 4 and list(ages) == [5] * 4


def test_agent_judging() -> None:
    c = FakeClock()
    assert judge_agent(0, now(c), TH)[0] is Status.UNKNOWN
    w = L.pack_hb(1, now(c))
    assert judge_agent(w, now(c), TH)[0] is Status.ALIVE
    c.advance(1.1)
    assert judge_agent(w, now(c), TH)[0] is Status.SUSPECT
    assert judge_agent(L.pack_hb(1, now(c), left=True), now(c), TH)[0] is Status.LEFT


def test_rows_read_unknown_without_a_running_agent_and_reject_other_generations() -> None:
    c = FakeClock()
    w = L.pack_row(5, Status.ALIVE.code, now(c))
    assert judge_row(w, 5, True, now(c)) == (Status.ALIVE, 0)
    assert judge_row(w, 5, False, now(c))[0] is Status.UNKNOWN
    assert judge_row(L.pack_row(5, Status.DEAD.code, now(c)), 5, False, now(c))[0] is Status.UNKNOWN
    assert judge_row(w, 6, True, now(c)) is None


def test_remote_worker_is_bounded_by_its_host() -> None:
    A, S, D, LEFT, U = Status.ALIVE, Status.SUSPECT, Status.DEAD, Status.LEFT, Status.UNKNOWN
    assert combine_remote(A, A) is A
    assert combine_remote(A, S) is S
    assert combine_remote(A, D) is D
    assert combine_remote(LEFT, A) is LEFT
    assert combine_remote(D, S) is D
    assert combine_remote(A, U) is U and combine_remote(D, U) is U


def test_peer_verdict_never_convicts_when_we_doubt_ourselves() -> None:
    assert peer_verdict(0, TH, self_suspect=False) is Status.ALIVE
    assert peer_verdict(TH.peer_suspect, TH, self_suspect=False) is Status.SUSPECT
    assert peer_verdict(TH.peer_dead, TH, self_suspect=False) is Status.DEAD
    assert peer_verdict(TH.peer_dead * 10, TH, self_suspect=True) is Status.SUSPECT
