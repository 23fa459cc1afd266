"""A standby's count of the holder's silence (shmhb.agent.election.StallWatch): one
term's heartbeat, started afresh when the term moves, so a holder that has just claimed
the role is not charged with the silence of the one it replaced."""

from __future__ import annotations

from shmhb.agent.election import StallWatch


def test_the_count_is_of_one_terms_heartbeat() -> None:
    w = StallWatch()
    assert w.still_for_ns(1, 100, 0) == 0
    assert w.still_for_ns(1, 100, 5_000) == 5_000  # term 1's word stood still
    # A standby claimed term 2; its first beat is not written yet, the word still reads
    # term 1's: term 2 is counted from here, not from term 1's last beat.
    assert w.still_for_ns(2, 100, 6_000) == 0
    assert w.still_for_ns(2, 100, 7_000) == 1_000
    assert w.still_for_ns(2, 101, 8_000) == 0  # it beat
    assert w.still_for_ns(2, 101, 8_500) == 500
    w.reset()
    assert w.still_for_ns(2, 101, 9_000) == 0
