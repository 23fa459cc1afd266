"""The byte map of a board segment, and the packing of its 64-bit words.

A board is one POSIX shared-memory segment::

    offset          size                  what                         written by
    0               HEADER_BYTES (4096)   Header (HEADER_DTYPE)        see field table below
    slot_off        nslots * 64           SlotWords: hb, verdict       hb: its worker; verdict: the agent
    record_off      nslots * 384          SlotRecord                   the registrant, under the lock
    peer_off        npeers * 192          PeerRow                      the agent
    remote_off      nremote * 384         RemoteRow                    the agent
    watch_off       nwatch * 128          WatchRow                     any process, under the lock

Every section starts on a 64-byte boundary and every 64-bit word sits on an 8-byte
boundary, so a load or a store of one word is a single aligned access: atomic on x86-64
and on aarch64 (docs/DESIGN.md, invariant 2).  ``Board`` asserts the alignment of the mapping.

What is guaranteed, and by whom.  The C path (``shmhb._native``, and any native reader
built on ``shmhb/include/shmhb.h``, which mirrors this byte map) loads and stores these
words with ``__atomic_load_n(p, __ATOMIC_ACQUIRE)`` / ``__atomic_store_n(p, v,
__ATOMIC_RELEASE)`` on addresses it checks are aligned: single-copy atomic and ordered,
a promise of the C compiler on x86-64 (plain MOV) and on aarch64 (LDAR / STLR).  The
pure-Python path (``SHMHB_PURE_PYTHON=1``, or no compiler at install) stores through a
memoryview cast to "Q" and numpy uint64 views; CPython and numpy compile those to one
aligned 8-byte MOV/STR/LDR (checked on today's builds, not promised by either), which is
single-copy atomic on both architectures, so no reader sees a torn word
(tests/test_processes.py hammers it across processes on both paths).  Neither path needs
ordering *between* words: each word names the incarnation or generation it belongs to
and records are checked by checksum, so an aarch64 reader that sees words out of order
sees a mismatch and retries, never a mix.  The release/acquire pair is a stronger
promise than the design needs, kept because it costs nothing on either architecture.

Words a reader uses to judge without a lock are *self-describing*: each carries the
incarnation (or row generation) it belongs to, so a reader that sees a new word next to
an old record, or the reverse, notices the mismatch instead of mixing them.  Records
(several words, written rarely) carry a checksum over all their fields, incarnation
included; a reader that catches one half-written sees a bad checksum and retries.

The bit map of each 64-bit word (which field sits where, the packing and the reading of
every field) is ``shmhb.board.words``; this module re-exports it.
"""

from __future__ import annotations

import hashlib
from typing import Final

import numpy as np

from .words import *  # noqa: F401,F403 (the bit map of each word: re-exported)

MAGIC: Final = int.from_bytes(b"SHMHBRD\x01", "little")
LAYOUT_VERSION: Final = 1
HEADER_BYTES: Final = 4096
ALIGN: Final = 64

# --- sizes of fixed fields --------------------------------------------------------------

KEY_BYTES: Final = 64  # utf-8 key, NUL padded; at most KEY_BYTES - 1 bytes used
ENDPOINTS_BYTES: Final = 256  # endpoints joined by b",", NUL padded
ADDR_BYTES: Final = 64  # "host:port" of a pinger or watched endpoint
PATH_BYTES: Final = 256
MAX_ENDPOINTS: Final = 8
NET_ERROR_BYTES: Final = 256  # the network half's last error, UTF-8, truncated
# text limits, one for the board and the wire (shmhb.net.protocol, shmhb.board.address use these)
MAX_KEY_BYTES: Final = KEY_BYTES - 1  # a key, UTF-8: what a slot holds with its NUL
MAX_ENDPOINT_BYTES: Final = 63  # one endpoint "host:port"
MAX_ADDRESS_BYTES: Final = ADDR_BYTES  # a pinger address in a frame (a row holds one less)
#: the most entries one ACK's digest lists, and so the most slots a board holds
MAX_DIGEST_ENTRIES: Final = 4096

# --- header -----------------------------------------------------------------------------
#
# field                 writer                                  when
# magic .. watch_off    creator                                 before the board is ready
# boot_id, board_inc    creator
# policy (*_ns)         creator
# forget_after_ns       creator (policy; 0: off)
# timens_offset_ns      creator: its CLOCK_MONOTONIC offset (time namespace)
# created_ns, creator_pid
# state                 creator                                 last, under the init lock
# inc_counter           registrants, under the registry lock (shmhb.board.registration: one kept
#                       from it issues above the counter and leaves it)
# reg_gen               registrants, under the registry lock (bumped on register/leave/watch)
# agent_hb, agent_id    the agent role holder
# agent_gen             the agent role holder (bumped on every verdict or remote change)
# agent_term            the agent role holder, at its takeover (a takeover counter; only
#                       the holder of the new term's lock byte writes it: shmhb.agent.election)
# agent_lateness_us     the agent role holder: its worst loop lateness of the last second
# stats                 the agent role holder: frame and ping counters (see STAT_NAMES)
# cfg_*                 `shmhb pinger`, under the registration lock: the pinger settings
#                       any holder of the role applies (listen address, secret, interval,
#                       ping budget in milli-pings/s)
# net_state             the agent role holder: its network half's state (one word, the
#                       only one `status` judges by; names the holder's term)
# net_gen, net_listen,  the agent role holder: details of that state (settings generation,
# net_error, net_ck     the address listened on, the last error's text), checksummed with
#                       the state word: a reader that catches them mid-write sees a bad
#                       checksum and shows the state word alone, never mixed details
# net_counter           the agent role holder: the reservation of its ping nonces and
#                       push seqs (shmhb.net.exchange.SendCounter)

STAT_NAMES: Final = (
    "pings_sent",
    "acks_received",
    "pings_answered",
    "pushes_sent",
    "pushes_received",
    "bad_truncated",
    "bad_oversized",
    "bad_magic",
    "bad_version",
    "bad_type",
    "bad_malformed",
    "bad_auth",
    "bad_replay",
    "bad_unsolicited",
    "loop_late",
    "deaths_seen",
    "pings_evidence",
    "bad_spoofed",
    "push_unlisted",
    "drain_budget_spent",
    "net_failures",
    "intake_muted",
    "pings_confirm",
    "digest_cut",
    "digest_cut_seen",
    "pings_refused",
    "remote_capped",
)
NSTATS: Final = 32

HEADER_DTYPE: Final = np.dtype(
    {
        "names": [
            "magic", "version", "header_bytes", "total_bytes",
            "nslots", "npeers", "nremote", "nwatch",
            "slot_off", "record_off", "peer_off", "remote_off", "watch_off",
            "boot_id", "board_inc", "created_ns", "creator_pid",
            "suspect_after_ns", "dead_after_ns", "agent_stale_ns",
            "peer_suspect_after_ns", "peer_dead_after_ns",
            "state", "forget_after_ns", "timens_offset_ns",
            "inc_counter", "reg_gen", "agent_term",
            "agent_hb", "agent_id", "agent_gen", "agent_lateness_us",
            "stats",
            "cfg_gen", "cfg_listen", "cfg_secret_path", "cfg_curve_dir",
            "cfg_interval_ns", "cfg_checksum", "cfg_budget_mpps",
            "net_state", "net_gen", "net_listen", "net_error", "net_ck",
            "net_counter",
        ],
        "formats": [
            "<u8", "<u4", "<u4", "<u8",
            "<u4", "<u4", "<u4", "<u4",
            "<u8", "<u8", "<u8", "<u8", "<u8",
            "S16", "<u8", "<u8", "<u8",
            "<u8", "<u8", "<u8",
            "<u8", "<u8",
            "<u8", "<u8", "<i8",
            "<u8", "<u8", "<u8",
            "<u8", "<u8", "<u8", "<u8",
            ("<u8", NSTATS),
            "<u8", f"S{ADDR_BYTES}", f"S{PATH_BYTES}", f"S{PATH_BYTES}",
            "<u8", "<u8", "<u8",
            "<u8", "<u8", f"S{ADDR_BYTES}", f"S{NET_ERROR_BYTES}", "<u8",
            "<u8",
        ],
        "offsets": [
            0, 8, 12, 16,
            24, 28, 32, 36,
            40, 48, 56, 64, 72,
            80, 96, 104, 112,
            120, 128, 136,
            144, 152,
            160, 168, 176,  # 184: not used
            # lock-protected and agent words each on their own cache line
            192, 200, 208,
            256, 264, 272, 280,
            320,
            # pinger settings
            640, 648, 712, 968,
            1224, 1232, 1240,
            # the network half's state (agent role holder), its own cache lines
            1280, 1288, 1296, 1360, 1616,
            2048,  # the agent role holder: nonce/push seq reservation (shmhb.net.exchange.SendCounter)
        ],
        "itemsize": HEADER_BYTES,
    }
)

STATE_READY: Final = 0x5245_4144_59  # "READY"

# --- slot words: one 64-byte line per slot so beating workers do not share a line ---------

SLOT_WORDS_DTYPE: Final = np.dtype(
    {"names": ["hb", "verdict"], "formats": ["<u8", "<u8"], "offsets": [0, 8], "itemsize": 64}
)

SLOT_RECORD_DTYPE: Final = np.dtype(
    {
        "names": ["incarnation", "pid", "pid_start", "pid_ns", "registered_ns",
                  "key", "endpoints", "checksum"],
        "formats": ["<u8", "<u8", "<u8", "<u8", "<u8",
                    f"S{KEY_BYTES}", f"S{ENDPOINTS_BYTES}", "<u8"],
        "offsets": [0, 8, 16, 24, 32, 40, 104, 360],
        "itemsize": 384,
    }
)

PEER_ROW_DTYPE: Final = np.dtype(
    {
        # status: gen|code|ts(last ack, local clock); rtt: gen|rtt_us;
        # auth: gen|failing|count (see pack_auth); capped: gen|count (see pack_capped)
        "names": ["status", "rtt", "gen", "board_inc", "boot_id", "address", "checksum", "auth",
                  "capped"],
        "formats": ["<u8", "<u8", "<u8", "<u8", "S16", f"S{ADDR_BYTES}", "<u8", "<u8", "<u8"],
        "offsets": [0, 8, 16, 24, 32, 48, 112, 120, 128],
        "itemsize": 192,
    }
)

REMOTE_ROW_DTYPE: Final = np.dtype(
    {
        # status: gen|code(reported)|ts(of the ack that reported it); peer: owning peer row;
        # beat: gen|0|ts(the worker's own last beat, local clock, as that report gave it;
        # 0: not known -- a report whose body age saturated says no more than its host's
        # age).
        "names": ["status", "gen", "peer", "peer_gen", "incarnation", "pid",
                  "key", "endpoints", "checksum", "beat"],
        "formats": ["<u8", "<u8", "<u8", "<u8", "<u8", "<u8",
                    f"S{KEY_BYTES}", f"S{ENDPOINTS_BYTES}", "<u8", "<u8"],
        "offsets": [0, 8, 16, 24, 32, 40, 48, 112, 368, 376],
        "itemsize": 384,
    }
)

WATCH_ROW_DTYPE: Final = np.dtype(
    {
        # owner_pid 0 = configured by `shmhb pinger --peer` (kept until the next daemon);
        # owner_ns: the owner's pid namespace, where its pid and start time mean something
        "names": ["owner_pid", "owner_start", "refs", "address", "owner_ns", "checksum"],
        "formats": ["<u8", "<u8", "<u8", f"S{ADDR_BYTES}", "<u8", "<u8"],
        "offsets": [0, 8, 16, 24, 88, 120],
        "itemsize": 128,
    }
)

# --- OFD lock bytes (byte ranges of the segment file; they need not lie inside it) --------

LOCK_REGISTRY: Final = 0  # registration counters, watch writes, pinger settings; init
#: held (shared) by every running ``shmhb pinger`` daemon: an embedded holder of the role
#: hands it over to it, and embedded standbys leave the role to it (shmhb.agent.role)
LOCK_DAEMON: Final = 2
#: term T of the agent role is held at LOCK_TERM_BASE + T % TERM_RING (shmhb.agent.election)
LOCK_TERM_BASE: Final = 1 << 19
TERM_RING: Final = 64


def term_byte(term: int) -> int:
    """The lock byte that term ``term`` of the agent role is held by."""
    return LOCK_TERM_BASE + term % TERM_RING

LOCK_SLOT_BASE: Final = 1 << 20  # slot i is held by its live registrant at LOCK_SLOT_BASE + i
#: watch row i is held (shared) by its live owner at LOCK_WATCH_BASE + i: how the rows of
#: owners in another pid namespace, whose pids mean nothing here, are judged
LOCK_WATCH_BASE: Final = 1 << 21
#: a key's registrants hold LOCK_KEY_BASE + crc32(key) % 65536 (shmhb.board.registration)
LOCK_KEY_BASE: Final = 1 << 22


class Sizes:
    """Offsets of every section for a board of the given capacity."""

    __slots__ = ("nslots", "npeers", "nremote", "nwatch", "slot_off", "record_off",
                 "peer_off", "remote_off", "watch_off", "total_bytes")

    def __init__(self, nslots: int, npeers: int, nremote: int, nwatch: int) -> None:
        self.nslots, self.npeers, self.nremote, self.nwatch = nslots, npeers, nremote, nwatch
        off = HEADER_BYTES
        self.slot_off = off
        off = _align(off + nslots * SLOT_WORDS_DTYPE.itemsize)
        self.record_off = off
        off = _align(off + nslots * SLOT_RECORD_DTYPE.itemsize)
        self.peer_off = off
        off = _align(off + npeers * PEER_ROW_DTYPE.itemsize)
        self.remote_off = off
        off = _align(off + nremote * REMOTE_ROW_DTYPE.itemsize)
        self.watch_off = off
        off = _align(off + nwatch * WATCH_ROW_DTYPE.itemsize)
        self.total_bytes = _align(off, 4096)


def _align(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


# --- where the words are: word indices ---------------------------------------------------

WORD_BYTES: Final = 8


def word_index(byte_offset: int) -> int:
    """The index, in the segment's array of 64-bit words, of the word at ``byte_offset``."""
    assert byte_offset % WORD_BYTES == 0, "board words must be 8-byte aligned"
    return byte_offset // WORD_BYTES


def field_word(dtype: np.dtype, field: str) -> int:
    """The index of ``field`` among the words of one row (or the header) of ``dtype``."""
    return word_index(dtype.fields[field][1])  # type: ignore[index]


def header_index(field: str) -> int:
    """The word index of header field ``field`` (of ``stats``: its first word)."""
    return field_word(HEADER_DTYPE, field)


#: the index of ``agent_term`` among the header's words: the current term of the agent role
TERM_WORD: Final = header_index("agent_term")
SLOT_STRIDE: Final = SLOT_WORDS_DTYPE.itemsize // WORD_BYTES  # words per slot line
VERDICT_WORD: Final = field_word(SLOT_WORDS_DTYPE, "verdict")  # from the slot's hb word
PEER_STRIDE: Final = PEER_ROW_DTYPE.itemsize // WORD_BYTES
PEER_RTT_WORD: Final = field_word(PEER_ROW_DTYPE, "rtt")  # from the row's status word
PEER_AUTH_WORD: Final = field_word(PEER_ROW_DTYPE, "auth")
PEER_CAPPED_WORD: Final = field_word(PEER_ROW_DTYPE, "capped")
REMOTE_BEAT_WORD: Final = field_word(REMOTE_ROW_DTYPE, "beat")
REMOTE_STRIDE: Final = REMOTE_ROW_DTYPE.itemsize // WORD_BYTES


# --- checksums --------------------------------------------------------------------------


def checksum(*parts: bytes | int) -> int:
    """A 64-bit keyed-free digest of a record's fields; never 0 (0 marks an empty row)."""
    h = hashlib.blake2b(digest_size=8, person=b"shmhb-row")
    for p in parts:
        if isinstance(p, int):
            h.update(p.to_bytes(8, "little"))
        else:
            h.update(len(p).to_bytes(2, "little"))
            h.update(p)
    return int.from_bytes(h.digest(), "little") or 1


def net_checksum(state_word: int, gen_word: int, listen: bytes, error: bytes) -> int:
    return checksum(state_word, gen_word, listen, error)


def record_checksum(rec: np.void) -> int:
    """Checksum of a SlotRecord (all fields but the checksum itself)."""
    return checksum(
        int(rec["incarnation"]), int(rec["pid"]), int(rec["pid_start"]), int(rec["pid_ns"]),
        int(rec["registered_ns"]), bytes(rec["key"]), bytes(rec["endpoints"]),
    )


def peer_checksum(row: np.void) -> int:
    """Checksum of a PeerRow's record fields (not its status and rtt words)."""
    return checksum(int(row["gen"]), int(row["board_inc"]), bytes(row["boot_id"]),
                    bytes(row["address"]))


def remote_checksum(row: np.void) -> int:
    """Checksum of a RemoteRow's record fields (not its status word)."""
    return checksum(int(row["gen"]), int(row["peer"]), int(row["peer_gen"]),
                    int(row["incarnation"]), int(row["pid"]), bytes(row["key"]),
                    bytes(row["endpoints"]))


def watch_checksum(row: np.void) -> int:
    return checksum(int(row["owner_pid"]), int(row["owner_start"]), int(row["refs"]),
                    bytes(row["address"]), int(row["owner_ns"]))


def encode_endpoints(endpoints: tuple[str, ...]) -> bytes:
    return ",".join(endpoints).encode()


def decode_endpoints(raw: bytes) -> tuple[str, ...]:
    return tuple(raw.decode().split(",")) if raw else ()
