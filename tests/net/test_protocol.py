"""Tests of the pinger wire protocol (shmhb.net.protocol): round trips, limits, rejection
reasons, authentication, a 100k-frame fuzz loop and the replay helpers."""

from __future__ import annotations

import random
import struct
import time

import pytest

from shmhb.net import protocol
from shmhb.errors import InvalidConfig, ProtocolError
from shmhb.net.exchange import OutstandingPings, ReplayGuard, wants_full_digest
from shmhb.net.protocol import (
    MAX_ACK_ENTRIES, MAX_ADDRESS_BYTES, MAX_ENDPOINT_BYTES, MAX_ENDPOINTS, MAX_FRAME_BYTES,
    MAX_KEY_BYTES, MAX_PUSH_ENTRIES, REASONS, TAG_BYTES, U32_MAX, Ack, DigestEntry, Frame,
    FrameRejected, Identity, Ping, Push, decode, encode_ack, encode_ack_raw, encode_entries,
    encode_ping, encode_push,
)


SECRET = b"0123456789abcdef-shared-secret!!"
OTHER_SECRET = b"fedcba9876543210-shared-secret!!"
ME = Identity(bytes(range(16)), 7)
PEER = Identity(bytes(range(16, 32)), 2**64 - 1)


def entry(i: int, n_endpoints: int = 2, status: int = 1) -> DigestEntry:
    return DigestEntry(f"worker-{i}", i + 1, status, 1000 + i, 25 * i,
                       tuple(f"tcp://10.0.0.{i % 250}:{5000 + j}" for j in range(n_endpoints)))


def max_entry(i: int) -> DigestEntry:
    """An entry at every limit: 63-byte key, 8 endpoints of 63 bytes, u64/u32 maxima."""
    key = f"{i:03d}".ljust(MAX_KEY_BYTES, "k")
    eps = tuple(f"{i:03d}{j}".ljust(MAX_ENDPOINT_BYTES, "e") for j in range(MAX_ENDPOINTS))
    return DigestEntry(key, 2**64 - 1, 4, U32_MAX, U32_MAX, eps)


ENTRIES = tuple(entry(i) for i in range(5))
FIRST_PING = Ping(ME, "hosta:7070", 1)
PING_WITH_GEN = Ping(ME, "hosta:7070", 2**64 - 1, known_gen=42, known_identity=PEER)
ECHO_PING = Ping(ME, "hosta:7070", 5, known_gen=42, known_identity=PEER, challenge=2**64 - 1,
                 echo=77)
STEADY_ACK = Ack(1, PEER, "hostb:7070", 42, full=False)
FULL_ACK = Ack(3, PEER, "hostb:7070", 44, full=True, entries=ENTRIES)
FRAMES: list[Frame] = [
    FIRST_PING,
    PING_WITH_GEN,
    ECHO_PING,
    STEADY_ACK,
    Ack(2, PEER, "hostb:7070", 43, full=True, entries=()),
    FULL_ACK,
    Ping(ME, "hosta:7070", 6, 42, PEER, challenge=3, echo=4, gen=2**60 | 9),
    Ack(5, PEER, "hostb:7070", 44, full=True, entries=ENTRIES, body_age_ms=250),
    Push(ME, "hosta:7070", 9, 45, entries=(entry(1, 0, 3), entry(2, 1, 4), entry(3, 8, 1))),
    Push(ME, "hosta:7070", 10, 46, entries=()),
]


def encode(frame: Frame, secret: bytes | None = None) -> bytes:
    if isinstance(frame, Ping):
        return encode_ping(frame, secret)
    if isinstance(frame, Ack):
        return encode_ack(frame, secret)
    return encode_push(frame, secret)


def reason(frame: bytes, secret: bytes | None = None) -> str:
    with pytest.raises(FrameRejected) as info:
        decode(frame, secret)
    assert info.value.reason in REASONS
    return info.value.reason


# --- round trips ------------------------------------------------------------------------

@pytest.mark.parametrize("secret", [None, SECRET])
@pytest.mark.parametrize("frame", FRAMES, ids=lambda f: type(f).__name__)
def test_round_trip(frame: Frame, secret: bytes | None) -> None:
    raw = encode(frame, secret)
    assert decode(raw, secret) == frame
    assert decode(bytearray(raw), secret) == frame
    assert decode(memoryview(raw), secret) == frame
    assert (raw[6] & 1) == (secret is not None)
    assert len(raw) <= MAX_FRAME_BYTES


def test_encode_ack_raw_matches_encode_ack() -> None:
    body = encode_entries(ENTRIES)
    for secret in (None, SECRET):
        raw = encode_ack_raw(3, PEER, "hostb:7070", 44, body, secret)
        assert raw == encode_ack(FULL_ACK, secret)
        raw = encode_ack_raw(1, PEER, "hostb:7070", 42, None, secret)
        assert raw == encode_ack(STEADY_ACK, secret)


def test_steady_state_ack_is_small() -> None:
    assert len(encode_ack(STEADY_ACK)) == 50 + len("hostb:7070")
    assert len(encode_ack(STEADY_ACK, SECRET)) == 50 + len("hostb:7070") + TAG_BYTES


def test_unknown_identity_is_zero_on_the_wire() -> None:
    ping = decode(encode_ping(Ping(ME, "a:1", 5, 3, Identity(bytes(16), 0))))
    assert isinstance(ping, Ping) and ping.known_identity is None


def test_wants_full_digest() -> None:
    assert wants_full_digest(Ping(ME, "a:1", 1), PEER, 5)
    assert wants_full_digest(Ping(ME, "a:1", 1, 5, None), PEER, 5)
    assert wants_full_digest(Ping(ME, "a:1", 1, 4, PEER), PEER, 5)
    assert wants_full_digest(Ping(ME, "a:1", 1, 5, Identity(PEER.boot_id, 1)), PEER, 5)
    assert wants_full_digest(Ping(ME, "a:1", 1, 0, PEER), PEER, 0)
    assert not wants_full_digest(Ping(ME, "a:1", 1, 5, PEER), PEER, 5)


# --- limits -----------------------------------------------------------------------------

def test_largest_ack_is_exactly_max_frame_bytes() -> None:
    big = Ack(1, PEER, "h" * MAX_ADDRESS_BYTES, 1, True,
              tuple(max_entry(i) for i in range(MAX_ACK_ENTRIES)), body_age_ms=2**32 - 1)
    raw = encode_ack(big, SECRET)
    assert len(raw) == MAX_FRAME_BYTES
    assert decode(raw, SECRET) == big
    # past 256 entries: as many as the same bytes hold, up to 4,096
    many = Ack(1, PEER, "h", 1, True,
               tuple(entry(i, 0) for i in range(protocol.MAX_DIGEST_ENTRIES)))
    assert decode(encode_ack(many, SECRET), SECRET) == many
    too_many = Ack(1, PEER, "h", 1, True,
                   tuple(entry(i, 0) for i in range(protocol.MAX_DIGEST_ENTRIES + 1)))
    with pytest.raises(ProtocolError):
        encode_ack(too_many)
    too_big = Ack(1, PEER, "h", 1, True, tuple(max_entry(i) for i in range(MAX_ACK_ENTRIES + 1)))
    with pytest.raises(ProtocolError, match="exceeds"):
        encode_ack(too_big)


def test_push_entry_limit() -> None:
    ok = Push(ME, "a:1", 1, 1, tuple(entry(i) for i in range(MAX_PUSH_ENTRIES)))
    assert decode(encode_push(ok)) == ok
    with pytest.raises(ProtocolError):
        encode_push(Push(ME, "a:1", 1, 1, tuple(entry(i) for i in range(MAX_PUSH_ENTRIES + 1))))


@pytest.mark.parametrize("ok, bad", [
    ("é" * 31 + "k", "é" * 32),                      # 63 vs 64 UTF-8 bytes
    ("k" * MAX_KEY_BYTES, "k" * (MAX_KEY_BYTES + 1)),
])
def test_key_length_limit(ok: str, bad: str) -> None:
    good = Ack(1, PEER, "b:1", 1, True, (DigestEntry(ok, 1, 1, 1, 1),))
    assert decode(encode_ack(good)) == good
    with pytest.raises(ProtocolError):
        encode_ack(Ack(1, PEER, "b:1", 1, True, (DigestEntry(bad, 1, 1, 1, 1),)))


def test_endpoint_limits() -> None:
    eps = tuple("e" * MAX_ENDPOINT_BYTES for _ in range(MAX_ENDPOINTS))
    good = Push(ME, "a:1", 1, 1, (DigestEntry("k", 1, 3, 1, 1, eps),))
    assert decode(encode_push(good)) == good
    for bad_eps in (eps + ("e",), ("e" * (MAX_ENDPOINT_BYTES + 1),), ("",), ("a\x00b",)):
        with pytest.raises(ProtocolError):
            encode_push(Push(ME, "a:1", 1, 1, (DigestEntry("k", 1, 3, 1, 1, bad_eps),)))


def test_address_limit() -> None:
    assert decode(encode_ping(Ping(ME, "a" * MAX_ADDRESS_BYTES, 1))).address == "a" * 64
    for bad in ("a" * (MAX_ADDRESS_BYTES + 1), "", "\udc80"):
        with pytest.raises(ProtocolError):
            encode_ping(Ping(ME, bad, 1))


@pytest.mark.parametrize("bad", [
    DigestEntry("k", -1, 1, 1, 1), DigestEntry("k", 2**64, 1, 1, 1),
    DigestEntry("k", 1, 0, 1, 1), DigestEntry("k", 1, 5, 1, 1), DigestEntry("k", 1, True, 1, 1),
    DigestEntry("k", 1, 1, 2**32, 1), DigestEntry("k", 1, 1, 1, -1),
    DigestEntry("k", 1, 1, 1, 1.5), DigestEntry("k", 1, 1, 1, 1, ["e"]),  # type: ignore[arg-type]
    DigestEntry(b"k", 1, 1, 1, 1),  # type: ignore[arg-type]
])
def test_encode_rejects_bad_entries(bad: DigestEntry) -> None:
    with pytest.raises(ProtocolError):
        encode_entries([bad])


def test_encode_rejects_other_bad_input() -> None:
    with pytest.raises(ProtocolError):
        encode_entries([entry(1), entry(1)])  # duplicate key
    with pytest.raises(ProtocolError):
        Identity(b"short", 1)
    with pytest.raises(ProtocolError):
        Identity(bytes(16), -1)
    with pytest.raises(ProtocolError):
        encode_ping(Ping(ME, "a:1", -1))
    with pytest.raises(ProtocolError):
        encode_ack(Ack(1, PEER, "b:1", 1, False, ENTRIES))
    with pytest.raises(ProtocolError):
        encode_ack_raw(1, PEER, "b:1", 1, b"\x01")
    with pytest.raises(InvalidConfig):
        encode_ping(Ping(ME, "a:1", 1), b"too short")
    with pytest.raises(InvalidConfig):
        decode(encode_ping(Ping(ME, "a:1", 1)), b"too short")
    with pytest.raises(TypeError):
        decode("SHHB")  # type: ignore[arg-type]


def test_age_saturates() -> None:
    raw = encode_ack(Ack(1, PEER, "b:1", 1, True, (DigestEntry("k", 1, 1, 1, 2**40),)))
    ack = decode(raw)
    assert isinstance(ack, Ack) and ack.entries[0].age_ms == U32_MAX


# --- rejection reasons -------------------------------------------------------------------

def test_header_reasons() -> None:
    raw = encode_ping(PING_WITH_GEN)
    assert reason(b"") == "truncated"
    assert reason(raw[:7]) == "truncated"
    assert reason(b"XHHB" + raw[4:]) == "magic"
    assert reason(raw[:4] + b"\x03" + raw[5:]) == "version"
    assert reason(raw[:4] + b"\x00" + raw[5:]) == "version"
    assert reason(raw[:4] + b"\x02" + raw[5:]) == "version"
    assert reason(raw[:5] + b"\x04" + raw[6:]) == "type"
    assert reason(raw[:5] + b"\x00" + raw[6:]) == "type"
    assert reason(raw[:6] + b"\x02" + raw[7:]) == "malformed"  # unknown flag bit
    assert reason(raw[:7] + b"\x01" + raw[8:]) == "malformed"  # reserved byte
    assert reason(raw + b"\x00") == "malformed"  # trailing garbage
    assert reason(raw[:5] + b"\x02" + raw[6:]) in {"truncated", "malformed"}  # ping bytes as ack
    assert reason(b"\x00" * (MAX_FRAME_BYTES + 1)) == "oversized"
    assert reason(raw + bytes(MAX_FRAME_BYTES)) == "oversized"


def test_auth_reasons() -> None:
    plain, tagged = encode_ping(FIRST_PING), encode_ping(FIRST_PING, SECRET)
    assert reason(plain, SECRET) == "auth"  # tag missing
    assert reason(tagged) == "auth"  # tag present, decoder has no secret
    assert reason(tagged, OTHER_SECRET) == "auth"
    assert reason(tagged[:-1] + bytes([tagged[-1] ^ 1]), SECRET) == "auth"
    # a tag appended to a frame without the flag is trailing garbage, not a valid frame
    assert reason(plain + tagged[-TAG_BYTES:]) == "malformed"
    assert reason(plain[:6] + b"\x01" + plain[7:8], SECRET) == "truncated"  # too short for a tag


def _entry_bytes(key: bytes, status: int = 1, endpoints: tuple[bytes, ...] = (),
                 key_len: int | None = None) -> bytes:
    head = struct.pack("<QIIBBB", 1, 2, 3, status, len(key) if key_len is None else key_len,
                       len(endpoints))
    return head + key + b"".join(bytes((len(e),)) + e for e in endpoints)


def _ack_with(body: bytes, full: int = 1) -> bytes:
    raw = encode_ack_raw(1, PEER, "b:1", 1, None)  # full=0, no body
    age = struct.pack("<I", 0) if full else b""  # a full ack's body age, then the body
    return raw[:48] + bytes((full,)) + raw[49:] + age + body


@pytest.mark.parametrize("body, why", [
    (struct.pack("<H", protocol.MAX_DIGEST_ENTRIES + 1), "malformed"),  # count over the limit
    (struct.pack("<H", 2) + _entry_bytes(b"k") + _entry_bytes(b"k"), "malformed"),  # dup key
    (struct.pack("<H", 1) + _entry_bytes(b"\xff\xfe"), "malformed"),  # not UTF-8
    (struct.pack("<H", 1) + _entry_bytes(b"a\x00"), "malformed"),  # NUL
    (struct.pack("<H", 1) + _entry_bytes(b""), "malformed"),  # empty key
    (struct.pack("<H", 1) + _entry_bytes(b"k" * 64), "malformed"),  # key too long
    (struct.pack("<H", 1) + _entry_bytes(b"k", status=0), "malformed"),
    (struct.pack("<H", 1) + _entry_bytes(b"k", status=5), "malformed"),
    (struct.pack("<H", 1) + _entry_bytes(b"k", endpoints=(b"e",) * 9), "malformed"),
    (struct.pack("<H", 1) + _entry_bytes(b"k", endpoints=(b"e" * 64,)), "malformed"),
    (struct.pack("<H", 1) + _entry_bytes(b"k", key_len=5), "truncated"),
    (struct.pack("<H", 2) + _entry_bytes(b"k"), "truncated"),
    (struct.pack("<H", 0) + b"\x00", "malformed"),  # trailing
    (b"\x00", "truncated"),
])
def test_body_reasons(body: bytes, why: str) -> None:
    assert reason(_ack_with(body)) == why


def test_ack_full_byte_is_0_1_or_2() -> None:
    assert reason(_ack_with(struct.pack("<H", 0), full=3)) == "malformed"
    assert reason(_ack_with(struct.pack("<H", 0), full=255)) == "malformed"
    cut = decode(_ack_with(struct.pack("<H", 0), full=2))  # a digest cut at its sender
    assert isinstance(cut, Ack) and cut.full and cut.cut
    assert reason(_ack_with(struct.pack("<H", 0), full=0)) == "malformed"  # body after non-full
    ack = decode(_ack_with(struct.pack("<H", 1) + _entry_bytes("é".encode())))
    assert isinstance(ack, Ack) and ack.full and ack.entries[0].key == "é"


@pytest.mark.parametrize("secret", [None, SECRET])
@pytest.mark.parametrize("frame", FRAMES, ids=lambda f: type(f).__name__)
def test_every_truncation_is_rejected(frame: Frame, secret: bytes | None) -> None:
    raw = encode(frame, secret)
    for i in range(len(raw)):
        assert reason(raw[:i], secret)


@pytest.mark.parametrize("frame", FRAMES, ids=lambda f: type(f).__name__)
def test_every_bit_flip_is_rejected_with_a_secret(frame: Frame) -> None:
    raw = bytearray(encode(frame, SECRET))
    for i in range(len(raw)):
        for bit in range(8):
            raw[i] ^= 1 << bit
            why = reason(bytes(raw), SECRET)
            raw[i] ^= 1 << bit
            # header bytes are checked before the tag; everything after is "auth"
            if i >= 8:
                assert why == "auth", (i, bit)
            else:
                assert why in {"magic", "version", "type", "malformed", "auth"}, (i, bit)


# --- fuzz ---------------------------------------------------------------------------------

def _mutate(rng: random.Random, raw: bytes) -> bytes:
    buf = bytearray(raw)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(7)
        pos = rng.randrange(len(buf) + 1)
        if op == 0 and pos < len(buf):
            buf[pos] ^= 1 << rng.randrange(8)
        elif op == 1 and pos < len(buf):
            buf[pos] = rng.choice((0, 1, 2, 0x3F, 0x40, 0x7F, 0x80, 0xFF, rng.randrange(256)))
        elif op == 2:
            buf[pos:pos] = rng.randbytes(rng.randint(1, 4))
        elif op == 3:
            del buf[pos:pos + rng.randint(1, 4)]
        elif op == 4:
            del buf[pos:]
        elif op == 5:
            buf += rng.randbytes(rng.randint(1, 16))
        else:
            start = rng.randrange(len(buf) + 1)
            buf[pos:pos] = buf[start:start + rng.randint(1, 32)]
    return bytes(buf)


def _left_out_entries(frame: bytes, result: Ping | Ack | Push) -> int:
    """How many entries ``frame`` counts beyond those ``decode`` returned."""
    if isinstance(result, Ping) or isinstance(result, Ack) and not result.full:
        return 0
    # a full ack's u32 body age comes before the count
    at = (protocol._ACK_HEAD.size + 4 if isinstance(result, Ack) else protocol._PUSH_HEAD.size)
    (count,) = struct.unpack_from("<H", frame, at + len(result.address.encode()))
    return int(count) - len(result.entries)


def test_fuzz_decode_only_returns_frames_or_rejects() -> None:
    rng = random.Random(20240611)
    pool = [encode(f) for f in FRAMES]
    pool.append(encode_ack(Ack(5, PEER, "b:1", 9, True, tuple(entry(i, 8) for i in range(40)))))
    pool.append(encode_push(Push(ME, "a:1", 5, 9, tuple(max_entry(i) for i in range(3)))))
    tagged = [encode(f, SECRET) for f in FRAMES]
    header = pool[0][:8]
    oversized = bytearray(rng.randbytes(MAX_FRAME_BYTES + 64))
    counts = {"ok": 0, **{r: 0 for r in REASONS}}
    started = time.perf_counter()
    for n in range(100_000):
        mode = rng.random()
        secret = None
        if mode < 0.15:
            frame = rng.randbytes(rng.randrange(96))
        elif mode < 0.25:
            frame = header[:rng.randrange(9)] + rng.randbytes(rng.randrange(128))
        elif mode < 0.35:
            frame = _mutate(rng, rng.choice(tagged))
            secret = SECRET if rng.random() < 0.8 else None
        elif mode < 0.351:
            oversized[rng.randrange(len(oversized))] = rng.randrange(256)
            frame = bytes(oversized[:rng.randint(MAX_FRAME_BYTES + 1, len(oversized))])
        else:
            frame = _mutate(rng, rng.choice(pool))
        try:
            result = decode(frame, secret)
        except FrameRejected as exc:
            assert exc.reason in REASONS, exc
            counts[exc.reason] += 1
            continue
        assert isinstance(result, (Ping, Ack, Push)), (n, frame)
        # the encoding is canonical, but for entries whose key no door accepts (control
        # or format characters, which could inject into a terminal), which decode leaves out
        assert encode(result, secret) == frame or _left_out_entries(frame, result) > 0
        counts["ok"] += 1
    elapsed = time.perf_counter() - started
    assert counts["ok"] > 100 and counts["auth"] > 1000 and counts["oversized"] > 10, counts
    assert all(counts[r] for r in REASONS - {"replay"}), counts
    assert elapsed < 15, f"fuzz loop took {elapsed:.1f}s"


# --- replay helpers -------------------------------------------------------------------

def test_replay_guard_accepts_only_increasing() -> None:
    guard = ReplayGuard()
    assert guard.accept(ME, 5)
    assert not guard.accept(ME, 5)
    assert not guard.accept(ME, 4)
    assert guard.accept(ME, 6)
    assert guard.accept(PEER, 0)  # per identity
    assert guard.last(ME) == 6 and guard.last(Identity(bytes(16), 1)) is None
    with pytest.raises(FrameRejected) as info:
        guard.require(ME, 6)
    assert info.value.reason == "replay"
    guard.require(ME, 100)
    assert guard.last(ME) == 100


def test_replay_guard_is_bounded_lru() -> None:
    guard = ReplayGuard(max_identities=4096)
    for i in range(100_000):
        assert guard.accept(Identity(bytes(16), i), 1)
        if i % 1000 == 0:
            assert guard.accept(ME, i + 1)  # kept fresh, so never evicted
        assert len(guard) <= 4096
    assert guard.last(ME) == 99_001
    assert guard.last(Identity(bytes(16), 0)) is None  # evicted: replay reopens (documented)
    with pytest.raises(InvalidConfig):
        ReplayGuard(0)


def test_outstanding_pings_one_use() -> None:
    out = OutstandingPings()
    out.add("b:1", 10, 1_000)
    out.add("b:1", 11, 2_000)
    assert len(out) == 2
    assert out.take("c:1", 10) is None  # wrong peer
    assert out.take("b:1", 10) == 1_000
    assert out.take("b:1", 10) is None  # replayed ack
    assert out.take("b:1", 11) == 2_000
    assert len(out) == 0 and out.peers() == 0


def test_outstanding_pings_expire_per_peer() -> None:
    out = OutstandingPings(per_peer=8)
    for nonce in range(1, 11):
        out.add("b:1", nonce, nonce * 100)
    assert len(out) == 8
    assert out.take("b:1", 1) is None and out.take("b:1", 2) is None
    assert out.take("b:1", 3) == 300 and out.take("b:1", 10) == 1_000
    out.add("b:1", 4, 999)  # re-adding a nonce replaces it, not double counts
    assert len(out) == 6 and out.take("b:1", 4) == 999
    out.drop_peer("b:1")
    out.drop_peer("nobody")
    assert len(out) == 0 and out.take("b:1", 5) is None


def test_outstanding_pings_bounded_total() -> None:
    out = OutstandingPings(per_peer=8, max_peers=1000)
    for i in range(100_000):
        out.add(f"h{i % 50_000}", i, i)
        out.add("keep", i, i)
    assert out.peers() <= 1000 and len(out) <= 8 * 1000
    assert out.take("keep", 99_999) == 99_999
    assert out.take("h0", 0) is None
    with pytest.raises(InvalidConfig):
        OutstandingPings(per_peer=0)


# --- the ping's tail: challenge, echo, the sender's digest generation -------------------

TAIL_PING = Ping(ME, "hosta:7070", 5, 3, PEER, challenge=11, echo=12, gen=(1 << 60) | 77)


def test_every_ping_carries_the_challenge_echo_and_the_senders_gen() -> None:
    raw = encode_ping(TAIL_PING)
    assert raw[4] == 1 and raw[6] == 0  # no flag: the tail is not optional
    assert decode(raw) == TAIL_PING
    assert decode(encode_ping(TAIL_PING, SECRET), SECRET) == TAIL_PING
    plain = Ping(ME, "hosta:7070", 5)  # nothing to echo: zeros, still there
    assert len(encode_ping(plain)) == len(raw) and decode(encode_ping(plain)) == plain
    assert reason(raw[:-1]) == "truncated" and reason(raw + b"\x00") == "malformed"
    assert reason(raw[:6] + b"\x02" + raw[7:]) == "malformed"  # no flag but the tag's
    one_sided = Ping(ME, "hosta:7070", 6, echo=9)
    assert decode(encode_ping(one_sided)) == one_sided
    for frame in (encode_ack(STEADY_ACK), encode_push(FRAMES[-1])):  # type: ignore[arg-type]
        assert reason(frame[:6] + b"\x02" + frame[7:]) == "malformed"
    biggest = Ping(PEER, "a" * (MAX_ADDRESS_BYTES - 2) + ":1", 2**64 - 1, 2**64 - 1, PEER,
                   2**64 - 1, 2**64 - 1, 2**64 - 1)
    assert len(encode_ping(biggest, SECRET)) == 177 <= MAX_FRAME_BYTES
    with pytest.raises(ProtocolError):
        encode_ping(Ping(ME, "hosta:7070", 1, challenge=2**64))


def test_a_full_ack_says_how_old_its_body_is_and_a_steady_one_carries_no_age() -> None:
    full = Ack(9, PEER, "hostb:7070", 4, True, (entry(0),), body_age_ms=1234)
    raw = encode_ack(full)
    assert decode(raw) == full
    assert decode(encode_ack(full, SECRET), SECRET) == full
    steady_len = len(encode_ack(STEADY_ACK))
    assert len(encode_ack(Ack(1, PEER, "hostb:7070", 42, True, ()))) == steady_len + 4 + 2
    assert reason(raw[:-1]) == "truncated"
    late = encode_ack_raw(9, PEER, "hostb:7070", 4, encode_entries(()), body_age_ms=2**40)
    assert decode(late).body_age_ms == 2**32 - 1  # saturated: older than 49 days is all one needs


def test_a_frame_of_another_version_is_refused_as_version_even_when_tagged() -> None:
    for frame in (encode_ping(TAIL_PING, SECRET), encode_ack(STEADY_ACK, SECRET),
                  encode_push(FRAMES[-1], SECRET)):  # type: ignore[arg-type]
        for v in (0, 2, 3, 255):
            assert reason(frame[:4] + bytes([v]) + frame[5:], SECRET) == "version"


def test_challenges_kept_and_echoed() -> None:
    from shmhb.net.evidence import KEEP, echoed, issue, new_challenge

    got = [new_challenge() for _ in range(100)]
    assert all(0 < c < 2**64 for c in got) and len(set(got)) == 100
    kept: tuple[int, ...] = ()
    for c in got[:KEEP + 2]:
        kept = issue(kept, c)
    assert kept == tuple(reversed(got[2:KEEP + 2]))
    assert echoed(kept, got[KEEP + 1]) and echoed(kept, got[2])
    assert not echoed(kept, got[1]) and not echoed(kept, 0) and not echoed((), 0)


# -- rotation: two secrets, and the refusal ------------------------------------------------

def test_a_rotation_signs_with_the_first_secret_and_accepts_either() -> None:
    ping = Ping(ME, "10.0.0.1:45645", 5)
    both = protocol.Secrets(SECRET, OTHER_SECRET)
    framed = encode_ping(ping, both)
    assert framed == encode_ping(ping, SECRET)  # tagged with the first
    assert decode(framed, SECRET) == ping
    for sender in (SECRET, OTHER_SECRET):  # a host on either side of the rotation
        assert decode(encode_ping(ping, sender), both) == ping
        assert decode(encode_ping(ping, sender), protocol.Secrets(OTHER_SECRET, SECRET)) == ping
    third = b"a-third-secret-0123456789abcdef!"
    with pytest.raises(FrameRejected) as e:
        decode(encode_ping(ping, third), both)
    assert e.value.reason == "auth"
    with pytest.raises(FrameRejected) as e:
        decode(encode_ping(ping), both)
    assert e.value.reason == "auth"


@pytest.mark.parametrize("secret", [None, SECRET, OTHER_SECRET, "both"])
def test_a_refusal_decodes_for_nobody_and_reads_as_auth(secret: object) -> None:
    keys = protocol.Secrets(SECRET, OTHER_SECRET) if secret == "both" else secret
    frame = protocol.encode_refusal()
    assert len(frame) == 24 and len(frame) < len(encode_ping(Ping(ME, "a:1", 1)))
    with pytest.raises(FrameRejected) as e:
        decode(frame, keys)  # type: ignore[arg-type]
    assert e.value.reason == "auth"
