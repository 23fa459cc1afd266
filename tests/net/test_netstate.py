"""The network half's state words and its retry backoff (pure logic)."""

from __future__ import annotations

import random

import numpy as np

from shmhb.board.layout import (
    HEADER_DTYPE, INC_MASK, NetStateWord, net_checksum, pack_net_gen, pack_net_state,
    unpack_net_state,
)
from shmhb.net.state import Backoff, NetAuth, NetReason, NetState, decode_network



def _head(term: int, state: NetState, *, listening: bool = True, reason: NetReason = NetReason.NONE,
          err: int = 0, skipped: int = 0, gen: int = 7, listen: bytes = b"10.0.0.1:45645",
          error: bytes = b"", ck_ok: bool = True) -> np.ndarray:
    h = np.zeros(1, HEADER_DTYPE)[0]
    word = pack_net_state(NetStateWord(term=term, state=int(state), auth=int(NetAuth.HMAC),
                                       listening=listening, reason=int(reason), errno=err,
                                       skipped=skipped))
    gw = pack_net_gen(term, gen)
    h["net_state"], h["net_gen"], h["net_listen"], h["net_error"] = word, gw, listen, error
    h["net_ck"] = net_checksum(word, gw, listen, error) + (0 if ck_ok else 1)
    return h


def test_the_state_word_round_trips_every_field() -> None:
    for term in (1, 5, INC_MASK):
        for st in NetState:
            for reason in NetReason:
                f = NetStateWord(term=term, state=int(st), auth=2, listening=True,
                                 reason=int(reason), errno=98, skipped=3)
                assert unpack_net_state(pack_net_state(f)) == f
    big = NetStateWord(term=1, state=3, auth=0, listening=False, reason=0, errno=0, skipped=10**6)
    assert unpack_net_state(pack_net_state(big)).skipped == 511  # saturates


def test_decode_shows_details_only_with_a_matching_checksum() -> None:
    n = decode_network(_head(4, NetState.LISTENING), 4, True)
    assert (n.state, n.working, n.listen, n.auth, n.settings_gen) == (
        "listening", True, "10.0.0.1:45645", "hmac", 7)
    d = decode_network(_head(4, NetState.DEGRADED, listening=False, reason=NetReason.BIND,
                             err=98, error=b"cannot listen", listen=b""), 4, True)
    assert (d.state, d.working, d.reason, d.errno, d.error, d.listen) == (
        "degraded", False, "bind", 98, "cannot listen", None)
    torn = decode_network(_head(4, NetState.DEGRADED, reason=NetReason.SECRET, error=b"x",
                                ck_ok=False), 4, True)
    # the state word alone still decides; the details caught mid-write are hidden
    assert (torn.state, torn.working, torn.reason, torn.error, torn.listen, torn.settings_gen) == (
        "degraded", False, "secret", None, None, None)


def test_a_state_of_another_term_or_without_a_running_agent_claims_nothing() -> None:
    h = _head(3, NetState.DEGRADED, reason=NetReason.BIND)
    h["cfg_gen"] = 1  # pinger settings were stored
    assert decode_network(h, 4, True).state == "unknown"
    assert decode_network(h, 3, False).state == "unknown"
    assert decode_network(h, 3, False).working
    configured = np.zeros(1, HEADER_DTYPE)[0]
    configured["cfg_gen"] = 1
    assert decode_network(configured, 1, True).state == "unknown"
    assert decode_network(_head(2, NetState.OFF, listening=False), 2, True).state == "not configured"


def test_never_configured_reads_not_configured_with_or_without_a_holder() -> None:
    never = np.zeros(1, HEADER_DTYPE)[0]  # no settings stored, no state written
    for running in (True, False):
        n = decode_network(never, 1, running)
        assert n.state == "not configured" and n.working and not n.listening
    off = _head(2, NetState.OFF, listening=False)
    assert decode_network(off, 2, False).state == "not configured"  # the holder left


def test_backoff_doubles_to_its_cap_with_bounded_jitter_and_resets() -> None:
    rng = random.Random(1)
    b = Backoff(0.25, 2.0)
    got = [b.next_delay_ns(rng) / 1e9 for _ in range(6)]
    for d, base in zip(got, (0.25, 0.5, 1.0, 2.0, 2.0, 2.0)):
        assert base <= d <= base * 1.25
    b.reset()
    assert b.next_delay_ns(rng) / 1e9 <= 0.25 * 1.25
