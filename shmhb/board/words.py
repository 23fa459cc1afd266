"""The bit map of the board's 64-bit words: how each word packs its fields, and the one
decoder that reads them back.  (``shmhb.board.layout`` is the byte map: where each word sits;
it re-exports this module.)

Timestamps are CLOCK_MONOTONIC nanoseconds shifted right by ``TS_SHIFT`` (units of
2**20 ns, about 1.05 ms): coarse enough to fit next to an incarnation in one word, fine
enough for verdicts measured in seconds.

Word maps (bit 63 on the left)::

    hb        | incarnation:24 | left:1 | ts:39 |      worker; left=1 after a graceful close
    verdict   | incarnation:24 | ts:40          |      agent; DEAD for that incarnation, ts of death
    agent_hb  | term:24        | left:1 | ts:39 |      agent; term = takeover counter
    agent_id  | term:24        | pid:40         |      agent
    peer/remote row status word
              | gen:20 | code:4 | ts:40         |      agent; code is a Status code
    rtt word  | gen:20 | rtt_us:44              |      agent
    auth word | gen:20 | failing:1 | count:43   |      agent; frames from that host failing auth
    net_state | term:24 | state:4 | auth:2 | listening:1 | reason:8 | errno:16 | skipped:9 |
                                                   agent; the network half (see netstate.py)
    net_gen   | term:24 | cfg_gen:40             |      agent; the settings generation applied

Every field of every word is packed and read here, and judged in ``shmhb.board.judge``: no
other module shifts or masks a word (tests/test_structure.py checks; ``shmhb.h`` and
``_native.c`` mirror these).  The two hot paths a call would slow, Heartbeat's pure
beat and ``LocalReads.slot``, inline ``>> TS_SHIFT`` / ``>> INC_SHIFT`` instead; that
test names them.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import Final

import numpy as np

TS_SHIFT: Final = 20
TS_UNIT_NS: Final = 1 << TS_SHIFT
INC_BITS: Final = 24
INC_SHIFT: Final = 40
INC_MASK: Final = (1 << INC_BITS) - 1
LEFT_BIT: Final = 1 << 39
TS39_MASK: Final = (1 << 39) - 1
TS40_MASK: Final = (1 << 40) - 1
GEN_BITS: Final = 20
GEN_SHIFT: Final = 44
GEN_MASK: Final = (1 << GEN_BITS) - 1
CODE_SHIFT: Final = 40
CODE_MASK: Final = 0xF
RTT_MASK: Final = (1 << 44) - 1


def ts_units(ns: int) -> int:
    """A monotonic-nanosecond instant in the board's timestamp units."""
    return ns >> TS_SHIFT


def units_to_s(units: int) -> float:
    return units * TS_UNIT_NS / 1e9


def inc_tag(incarnation: int) -> int:
    """The 24 low bits of an incarnation, as stored in words. Never 0 for a real one."""
    return incarnation & INC_MASK


def pack_hb(incarnation: int, ts: int, left: bool = False) -> int:
    return (inc_tag(incarnation) << INC_SHIFT) | (LEFT_BIT if left else 0) | (ts & TS39_MASK)


def pack_verdict(incarnation: int, ts: int) -> int:
    return (inc_tag(incarnation) << INC_SHIFT) | (ts & TS40_MASK)


def pack_agent_id(term: int, pid: int) -> int:
    return ((term & INC_MASK) << INC_SHIFT) | (pid & TS40_MASK)


def pack_row(gen: int, code: int, ts: int) -> int:
    return ((gen & GEN_MASK) << GEN_SHIFT) | ((code & CODE_MASK) << CODE_SHIFT) | (ts & TS40_MASK)


def unpack_row(word: int) -> tuple[int, int, int]:
    """(gen, code, ts) of a peer or remote row word."""
    return (word >> GEN_SHIFT) & GEN_MASK, (word >> CODE_SHIFT) & CODE_MASK, word & TS40_MASK


AUTH_FAILING_BIT: Final = 1 << 43
AUTH_COUNT_MASK: Final = AUTH_FAILING_BIT - 1


def pack_auth(gen: int, failing: bool, count: int) -> int:
    """A peer row's auth word ``gen:20 | failing:1 | count:43``: frames from that host
    that failed authentication (saturating), and whether the last word from it did."""
    return (((gen & GEN_MASK) << GEN_SHIFT) | (AUTH_FAILING_BIT if failing else 0)
            | min(count, AUTH_COUNT_MASK))


def unpack_auth(word: int, gen: int) -> tuple[bool, int]:
    """(failing, count) of an auth word of record generation ``gen``; (False, 0) for a
    word of another generation (or 0: never written)."""
    if (word >> GEN_SHIFT) & GEN_MASK != gen & GEN_MASK:
        return False, 0
    return bool(word & AUTH_FAILING_BIT), word & AUTH_COUNT_MASK


def pack_capped(gen: int, count: int) -> int:
    """A peer row's capped word ``gen:20 | count:44``: how many workers that host's last
    digest listed that this board did not store (its share of the remote table was
    spent: ``shmhb.net.reports``).  Readers say UNKNOWN, not GONE, for a worker of that
    host that has no row while it is nonzero."""
    return ((gen & GEN_MASK) << GEN_SHIFT) | (count & ((1 << GEN_SHIFT) - 1))


def unpack_capped(word: int, gen: int) -> int:
    """The count of a capped word of record generation ``gen``; 0 for a word of another
    generation (or 0: never written)."""
    if (word >> GEN_SHIFT) & GEN_MASK != gen & GEN_MASK:
        return 0
    return word & ((1 << GEN_SHIFT) - 1)


def pack_rtt(gen: int, rtt_us: int) -> int:
    return ((gen & GEN_MASK) << GEN_SHIFT) | (min(rtt_us, RTT_MASK) & RTT_MASK)


# network half state word (net_state): see the word map above and shmhb.net.state
NET_STATE_SHIFT: Final = 36
NET_AUTH_SHIFT: Final = 34
NET_LISTENING_BIT: Final = 1 << 33
NET_REASON_SHIFT: Final = 25
NET_ERRNO_SHIFT: Final = 9
NET_SKIPPED_MASK: Final = (1 << 9) - 1


@dataclass(frozen=True, slots=True)
class NetStateWord:
    """The fields of a net_state word: the holder's ``term``, the network half's
    ``state``, ``auth`` and ``reason`` codes (``shmhb.net.state``), whether it is
    ``listening``, the last ``errno``, and how many followed hosts it ``skipped``."""

    term: int
    state: int
    auth: int
    listening: bool
    reason: int
    errno: int
    skipped: int


def pack_net_state(f: NetStateWord) -> int:
    return (((f.term & INC_MASK) << INC_SHIFT) | ((f.state & 0xF) << NET_STATE_SHIFT)
            | ((f.auth & 0x3) << NET_AUTH_SHIFT) | (NET_LISTENING_BIT if f.listening else 0)
            | ((f.reason & 0xFF) << NET_REASON_SHIFT) | ((f.errno & 0xFFFF) << NET_ERRNO_SHIFT)
            | min(max(f.skipped, 0), NET_SKIPPED_MASK))


def unpack_net_state(word: int) -> NetStateWord:
    """The fields of a net_state word."""
    return NetStateWord(
        term=word >> INC_SHIFT, state=(word >> NET_STATE_SHIFT) & 0xF,
        auth=(word >> NET_AUTH_SHIFT) & 0x3, listening=bool(word & NET_LISTENING_BIT),
        reason=(word >> NET_REASON_SHIFT) & 0xFF, errno=(word >> NET_ERRNO_SHIFT) & 0xFFFF,
        skipped=word & NET_SKIPPED_MASK)


def pack_net_gen(term: int, cfg_gen: int) -> int:
    return ((term & INC_MASK) << INC_SHIFT) | (cfg_gen & TS40_MASK)


# --- reading words: the one decoder -----------------------------------------------------

WORD_MAX: Final = (1 << 64) - 1
_TS39_U64: Final = np.uint64(TS39_MASK)
_INC_SHIFT_U64: Final = np.uint64(INC_SHIFT)
_MARK_SHIFT_U64: Final = np.uint64(INC_SHIFT - 1)


def word_tag(word: int) -> int:
    """The top 24 bits of an hb, verdict, agent_hb, agent_id, net_state or net_gen word:
    a slot word's incarnation tag, the role holder's term in the others."""
    return word >> INC_SHIFT


def hb_left(word: int) -> bool:
    """Whether an hb or agent_hb word says its writer left gracefully."""
    return bool(word & LEFT_BIT)


def hb_ts(word: int) -> int:
    """The timestamp (units) of an hb or agent_hb word."""
    return word & TS39_MASK


def low40(word: int) -> int:
    """The 40 low bits: a verdict's or row status word's ts, agent_id's pid, net_gen's
    settings generation (named below for each)."""
    return word & TS40_MASK


verdict_ts = row_ts = agent_pid = net_cfg_gen = low40


def row_gen(word: int) -> int:
    """The row generation of a peer or remote row's status, rtt or auth word."""
    return (word >> GEN_SHIFT) & GEN_MASK


def row_code(word: int) -> int:
    """The Status code of a peer or remote row's status word."""
    return (word >> CODE_SHIFT) & CODE_MASK


def gen_tag(gen: int) -> int:
    """A row generation as its words hold it (20 bits)."""
    return gen & GEN_MASK


def next_gen(gen: int) -> int:
    """The generation after ``gen``, as stored: never 0 (a never-written word's)."""
    return gen_tag(gen + 1) or 1


def rtt_us(word: int, gen: int) -> int | None:
    """The round trip (µs) in an rtt word of row generation ``gen``; None if none was
    measured (0) or the word is another generation's."""
    return word & RTT_MASK if word and row_gen(word) == gen_tag(gen) else None


def units_to_ns(units: int) -> int:
    return units << TS_SHIFT


def units_to_ms(units: int) -> float:
    return units * TS_UNIT_NS / 1e6


def hb_ts_array(words: np.ndarray) -> np.ndarray:
    """``hb_ts`` of every word of a uint64 array (``word_tag_array``: ``word_tag``)."""
    return words & _TS39_U64


def word_tag_array(words: np.ndarray) -> np.ndarray:
    return words >> _INC_SHIFT_U64


def hb_marks_array(words: np.ndarray) -> np.ndarray:
    """Each hb word's incarnation tag and left bit together: what changes when a slot
    gets a new registrant or its worker leaves."""
    return words >> _MARK_SHIFT_U64
