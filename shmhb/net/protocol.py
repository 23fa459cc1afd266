"""The pinger wire protocol: pure encode/decode of PING, ACK and PUSH frames.

One pinger per host pings the pingers of other hosts (ZMQ DEALER -> ROUTER); each ack
carries a digest of the responder's worker slots, or nothing when the pinger already
holds the responder's current digest generation.  A PUSH sends changes (deaths, leaves,
restarts) without waiting for the next ping.  docs/PROTOCOL.md is the full byte map.

Every frame is little-endian and starts with an 8-byte header::

    0  magic    4s  b"SHHB"
    4  version  u8  1 (the first release's wire; any other is refused as ``version``)
    5  type     u8  1 PING, 2 ACK, 3 PUSH
    6  flags    u8  bit 0: a 16-byte HMAC tag ends the frame; other bits must be 0
    7  reserved u8  must be 0

A PING ends with the challenge, the echo and the sender's own digest generation; a full
ACK states how old its body is before the digest.

Why this shape (fixed-width integers, length-prefixed UTF-8, every length checked
against its limit and the bytes left, no pickle): docs/PROTOCOL.md, "Why this design".
The tag is HMAC-SHA256 (key = the shared secret, message = ``b"shmhb-v1"`` + every byte
before the tag) truncated to 16 bytes, checked before the body is parsed.  The records
frames decode into (``Ping``, ``Ack``, ``Push``, ``DigestEntry``, ``Identity``) and the
one error decoding raises (``FrameRejected``) are defined here too.  Decoding is
stateless; ``shmhb.net.exchange`` holds replay state and the responder's full-digest rule.
"""

from __future__ import annotations

import hmac
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final, Union

from shmhb.board.layout import (
    MAX_ADDRESS_BYTES, MAX_DIGEST_ENTRIES, MAX_ENDPOINT_BYTES, MAX_ENDPOINTS, MAX_KEY_BYTES,
)
from shmhb.errors import InvalidConfig, ProtocolError

# --- the records frames decode into and encode from -------------------------------------

U64_MAX: Final = 0xFFFF_FFFF_FFFF_FFFF


class FrameRejected(ProtocolError):
    """A received frame that decode refused; ``reason`` is one of :data:`REASONS`, short
    and stable so the pinger can count bad frames per reason."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"frame rejected: {reason}" + (f" ({detail})" if detail else ""))
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Identity:
    """One incarnation of a host's board: the kernel boot id and the board's creation
    counter.  A new identity means the remote board (and every slot on it) was reborn."""

    boot_id: bytes
    board_inc: int

    def __post_init__(self) -> None:
        if not isinstance(self.boot_id, bytes) or len(self.boot_id) != 16:
            raise ProtocolError("boot_id must be exactly 16 bytes")
        if not isinstance(self.board_inc, int) or not 0 <= self.board_inc <= U64_MAX:
            raise ProtocolError("board_inc must be an integer in u64 range")


@dataclass(frozen=True, slots=True)
class DigestEntry:
    """One worker slot of the sender's board, validated when encoded, not when built."""

    key: str
    incarnation: int
    status: int
    pid: int
    age_ms: int
    endpoints: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Ping:
    """``known_gen``/``known_identity``: the responder digest the sender holds (0/None:
    none); the responder answers with a full digest unless both match its own.
    ``challenge``/``echo`` (both 0: a plain ping, no extension): one the sender issues
    to the responder, the last the responder issued to the sender (``shmhb.net.evidence``).
    ``gen``: the sender's own digest generation as its acks state it (0: none), so a host
    that follows the sender learns from its pings alone that the digest it holds of it
    is behind."""

    identity: Identity
    address: str
    nonce: int
    known_gen: int = 0
    known_identity: Identity | None = None
    challenge: int = 0
    echo: int = 0
    gen: int = 0


@dataclass(frozen=True, slots=True)
class Ack:
    """Answer to the ping with ``nonce``.  ``full=False``: the sender's copy of digest
    ``gen`` is current and ``entries`` is empty; ``full=True``: ``entries`` is the whole
    digest of generation ``gen`` (possibly empty).  ``cut``: the responder's board holds
    more slots than one ACK carries, and ``entries`` are those that fit (live ones
    first): a slot absent from it is not known gone (the ``full`` byte reads 2).
    ``body_age_ms`` (a full ack): how long before the ack the entries' ``age_ms`` were
    measured (the body is encoded once per generation), so a receiver can tell a
    worker's own beat age, not only its host's."""

    nonce: int
    identity: Identity
    address: str
    gen: int
    full: bool
    entries: tuple[DigestEntry, ...] = ()
    cut: bool = False
    body_age_ms: int = 0


@dataclass(frozen=True, slots=True)
class Push:
    """Unsolicited changes of the sender's digest, which is at generation ``gen`` after
    them.  ``seq`` increases per sender identity.  Receivers must never raise a host or a
    slot to ALIVE on a push alone (see docs/PROTOCOL.md)."""

    identity: Identity
    address: str
    seq: int
    gen: int
    entries: tuple[DigestEntry, ...] = ()


Frame = Union[Ping, Ack, Push]


# --- the tag: HMAC-SHA256 keyed by the shared secret over the domain prefix and every
# byte before it, truncated to TAG_BYTES; the HMAC primed with the prefix is kept per secret

MIN_SECRET_BYTES: Final = 16
TAG_BYTES: Final = 16
DOMAIN: Final = b"shmhb-v1"

_MACS: dict[bytes, hmac.HMAC] = {}  # secret -> primed HMAC


def fresh_mac(secret: bytes) -> hmac.HMAC:
    """A fresh HMAC-SHA256 keyed by ``secret`` that has already absorbed ``domain``.
    Priming once per secret and copying halves the cost of a tag on small frames."""
    base = _MACS.get(secret) if isinstance(secret, bytes) else None
    if base is None:
        if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
            raise InvalidConfig(f"the shared secret must be bytes of length >= {MIN_SECRET_BYTES}")
        if len(_MACS) >= 8:
            _MACS.clear()
        base = _MACS[secret] = hmac.new(secret, DOMAIN, "sha256")
    return base.copy()


@dataclass(frozen=True, slots=True)
class Secrets:
    """The shared secrets of one pinger: frames are tagged with ``sign`` and accepted
    under ``sign`` or ``also`` (the secret a cluster rotates to, or from: with each
    host accepting both while it is rotated, no two hosts ever fail each other's frames;
    docs/OPERATIONS.md, "Rotating the secret")."""

    sign: bytes
    also: bytes | None = None

    def accepted(self) -> tuple[bytes, ...]:
        return (self.sign,) if self.also is None else (self.sign, self.also)


#: what the encoders and ``decode`` take: one secret, a rotation's two, or none
Keys = Union[bytes, Secrets, None]


def _signing(secret: Keys) -> bytes | None:
    return secret.sign if isinstance(secret, Secrets) else secret


def seal(parts: list[bytes], secret: Keys) -> bytes:
    """The frame ``parts`` joined, and tagged with ``secret`` (its signing one) if given."""
    frame = b"".join(parts)
    secret = _signing(secret)
    if secret is None:
        return frame
    mac = fresh_mac(secret)
    mac.update(frame)
    return frame + mac.digest()[:TAG_BYTES]


# --- the byte map -------------------------------------------------------------------------

MAGIC: Final = b"SHHB"
VERSION: Final = 1
PING: Final = 1
ACK: Final = 2
PUSH: Final = 3
FLAG_AUTH: Final = 0x01
#: ACK ``full`` byte: 0 no digest follows, 1 the digest, 2 the digest cut to what fits
FULL: Final = 1
FULL_CUT: Final = 2

STATUS_ALIVE: Final = 1
STATUS_SUSPECT: Final = 2
STATUS_DEAD: Final = 3
STATUS_LEFT: Final = 4
STATUSES: Final = frozenset((STATUS_ALIVE, STATUS_SUSPECT, STATUS_DEAD, STATUS_LEFT))

# MAX_ADDRESS_BYTES, MAX_KEY_BYTES, MAX_ENDPOINT_BYTES, MAX_ENDPOINTS, and
# MAX_DIGEST_ENTRIES (an ACK holds up to this many, within MAX_DIGEST_BODY_BYTES): layout
MAX_ACK_ENTRIES: Final = 256  # entries of the largest size an ACK always holds
MAX_PUSH_ENTRIES: Final = 64
U32_MAX: Final = 0xFFFF_FFFF

REASONS: Final = frozenset(
    ("truncated", "oversized", "magic", "version", "type", "malformed", "auth", "replay"))

_ZERO_BOOT: Final = bytes(16)
_HEADER = struct.Struct("<4sBBBB")
# Header plus the fixed part of each body, packed and unpacked in one call.
_PING_HEAD = struct.Struct("<4sBBBB16sQQQ16sQB")  # ids, nonce, known_gen, known id, addr_len
_ACK_HEAD = struct.Struct("<4sBBBB16sQQQBB")  # id, nonce, gen, full, addr_len
_PUSH_HEAD = struct.Struct("<4sBBBB16sQQQB")  # id, seq, gen, addr_len
_PING_TAIL = struct.Struct("<QQQ")  # a ping's tail: challenge, echo, the sender's gen
_BODY_AGE = struct.Struct("<I")  # a full ack: ms since its body's ages were taken
_COUNT = struct.Struct("<H")
_ENTRY = struct.Struct("<QIIBBB")  # incarnation, pid, age_ms, status, key_len, n_endpoints

MAX_ENTRY_BYTES: Final = _ENTRY.size + MAX_KEY_BYTES + MAX_ENDPOINTS * (1 + MAX_ENDPOINT_BYTES)
MAX_PING_BYTES: Final = _PING_HEAD.size + MAX_ADDRESS_BYTES + _PING_TAIL.size + TAG_BYTES
MAX_ACK_BYTES: Final = (_ACK_HEAD.size + MAX_ADDRESS_BYTES + _BODY_AGE.size + _COUNT.size
                        + MAX_ACK_ENTRIES * MAX_ENTRY_BYTES + TAG_BYTES)
MAX_PUSH_BYTES: Final = (_PUSH_HEAD.size + MAX_ADDRESS_BYTES + _COUNT.size
                         + MAX_PUSH_ENTRIES * MAX_ENTRY_BYTES + TAG_BYTES)
#: An ACK's digest body at most: 256 of the largest entries, ~2,800 of 53 bytes.
MAX_DIGEST_BODY_BYTES: Final = _COUNT.size + MAX_ACK_ENTRIES * MAX_ENTRY_BYTES
#: No valid frame is longer (152,200 bytes: the largest authenticated ACK).
MAX_FRAME_BYTES: Final = max(MAX_PING_BYTES, MAX_ACK_BYTES, MAX_PUSH_BYTES)


# --- encoding -------------------------------------------------------------------------

def _text(value: str, limit: int, what: str) -> bytes:
    """UTF-8 of a key, endpoint or address: 1..limit bytes, no NUL."""
    if not isinstance(value, str):
        raise ProtocolError(f"{what} must be a str, not {type(value).__name__}")
    try:
        raw = value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ProtocolError(f"{what} {value!r} is not encodable as UTF-8") from exc
    if not 1 <= len(raw) <= limit or b"\x00" in raw:
        raise ProtocolError(f"{what} {value!r} must be 1..{limit} UTF-8 bytes without NUL")
    return raw


def _encode_entry(e: DigestEntry) -> bytes:
    key = _text(e.key, MAX_KEY_BYTES, "key")
    if not e.key.isprintable():  # refused by check_key; receivers skip it
        raise ProtocolError(f"key {key!r} has control or format characters")
    if not isinstance(e.status, int) or isinstance(e.status, bool) or e.status not in STATUSES:
        raise ProtocolError(f"entry {e.key!r}: status {e.status!r} is not a status code")
    if not isinstance(e.endpoints, tuple) or len(e.endpoints) > MAX_ENDPOINTS:
        raise ProtocolError(f"entry {e.key!r}: endpoints must be a tuple of <= {MAX_ENDPOINTS}")
    eps = [_text(ep, MAX_ENDPOINT_BYTES, "endpoint") for ep in e.endpoints]
    if isinstance(e.age_ms, int) and e.age_ms > U32_MAX:
        age = U32_MAX  # saturate: "older than 49.7 days" is all a reader needs
    else:
        age = e.age_ms
    try:
        fixed = _ENTRY.pack(e.incarnation, e.pid, age, e.status, len(key), len(eps))
    except struct.error as exc:
        raise ProtocolError(f"entry {e.key!r}: field out of range ({exc})") from exc
    return b"".join([fixed, key, *(bytes((len(ep),)) + ep for ep in eps)])


def encode_entries(entries: Iterable[DigestEntry], limit: int = MAX_DIGEST_ENTRIES) -> bytes:
    """The digest body (u16 count + entries, at most ``MAX_DIGEST_BODY_BYTES``) of an ACK
    or PUSH.  Encoded once per digest generation, handed to :func:`encode_ack_raw`."""
    items = tuple(entries)
    if len(items) > min(limit, MAX_DIGEST_ENTRIES):
        raise ProtocolError(f"{len(items)} entries exceed the limit of {limit}")
    parts = [_COUNT.pack(len(items)), *map(_encode_entry, items)]
    if len({e.key for e in items}) != len(items):
        raise ProtocolError("digest entries must have distinct keys")
    if (n := sum(map(len, parts))) > MAX_DIGEST_BODY_BYTES:
        raise ProtocolError(f"a digest of {n} bytes exceeds {MAX_DIGEST_BODY_BYTES}")
    return b"".join(parts)


def encode_ping(p: Ping, secret: Keys = None) -> bytes:
    """A PING frame; with ``secret``, tagged.  Raises ProtocolError for out-of-limit
    fields."""
    flags = 0 if secret is None else FLAG_AUTH
    addr = _text(p.address, MAX_ADDRESS_BYTES, "address")
    known = p.known_identity
    try:
        head = _PING_HEAD.pack(
            MAGIC, VERSION, PING, flags, 0, p.identity.boot_id, p.identity.board_inc,
            p.nonce, p.known_gen, _ZERO_BOOT if known is None else known.boot_id,
            0 if known is None else known.board_inc, len(addr))
        tail = _PING_TAIL.pack(p.challenge, p.echo, p.gen)
    except struct.error as exc:
        raise ProtocolError(f"ping field out of range ({exc})") from exc
    return seal([head, addr, tail], secret)


def encode_ack_raw(nonce: int, identity: Identity, address: str, gen: int,
                   body: bytes | None = None, secret: Keys = None,
                   cut: bool = False, body_age_ms: int = 0) -> bytes:
    """An ACK from parts: ``body`` is a cached :func:`encode_entries` result (full
    digest) or None (the pinger's copy of ``gen`` is current); ``cut``: that body left
    slots out (``Ack.cut``); in a full ack ``body_age_ms`` (saturated at 2**32-1).  The
    body is trusted, not re-parsed: this is the responder's fast path."""
    flags = 0 if secret is None else FLAG_AUTH
    addr = _text(address, MAX_ADDRESS_BYTES, "address")
    if body is None:
        full, body = 0, b""
    elif (not isinstance(body, bytes) or not _COUNT.size <= len(body) <= MAX_DIGEST_BODY_BYTES
          or _COUNT.unpack_from(body)[0] > MAX_DIGEST_ENTRIES):
        raise ProtocolError("body must be the bytes returned by encode_entries")
    else:
        full = FULL_CUT if cut else FULL
    try:
        head = _ACK_HEAD.pack(MAGIC, VERSION, ACK, flags, 0, identity.boot_id,
                              identity.board_inc, nonce, gen, full, len(addr))
        if full:
            addr += _BODY_AGE.pack(min(body_age_ms, U32_MAX))
    except struct.error as exc:
        raise ProtocolError(f"ack field out of range ({exc})") from exc
    return seal([head, addr, body], secret)


def encode_ack(a: Ack, secret: Keys = None) -> bytes:
    """An ACK frame from an :class:`Ack` (re-encodes the digest: prefer the raw path)."""
    if not a.full and a.entries:
        raise ProtocolError("an ack with full=False carries no entries")
    body = encode_entries(a.entries, MAX_DIGEST_ENTRIES) if a.full else None
    return encode_ack_raw(a.nonce, a.identity, a.address, a.gen, body, secret,
                          cut=a.full and a.cut, body_age_ms=a.body_age_ms)


def encode_refusal() -> bytes:
    """What a responder answers to a ping that failed authentication: an ACK header with
    the AUTH flag and 16 zero bytes where a tag would be, nothing else.  It decodes for
    no pinger (a decoder with a secret finds the tag wrong, one without refuses a tagged
    frame), so the pinger it goes to, whose ping failed here, counts it as ``auth`` on
    its connection to us and learns that the secrets differ, not that we are dead
    (docs/PROTOCOL.md, "REFUSAL").  Not a tag of ours: a pinger halfway through a
    rotation in the other order would otherwise accept it and see a truncated ack."""
    return _HEADER.pack(MAGIC, VERSION, ACK, FLAG_AUTH, 0) + bytes(TAG_BYTES)


def encode_push(p: Push, secret: Keys = None) -> bytes:
    """A PUSH frame carrying at most ``MAX_PUSH_ENTRIES`` changed entries."""
    flags = 0 if secret is None else FLAG_AUTH
    addr = _text(p.address, MAX_ADDRESS_BYTES, "address")
    body = encode_entries(p.entries, MAX_PUSH_ENTRIES)
    try:
        head = _PUSH_HEAD.pack(MAGIC, VERSION, PUSH, flags, 0, p.identity.boot_id,
                               p.identity.board_inc, p.seq, p.gen, len(addr))
    except struct.error as exc:
        raise ProtocolError(f"push field out of range ({exc})") from exc
    return seal([head, addr, body], secret)


# --- decoding -------------------------------------------------------------------------

def _read_text(buf: bytes, off: int, end: int, n: int, limit: int, what: str) -> tuple[str, int]:
    if n == 0 or n > limit:
        raise FrameRejected("malformed", f"{what} length {n}")
    stop = off + n
    if stop > end:
        raise FrameRejected("truncated", what)
    raw = buf[off:stop]
    if b"\x00" in raw:
        raise FrameRejected("malformed", f"NUL in {what}")
    try:
        return raw.decode("utf-8"), stop
    except UnicodeDecodeError:
        raise FrameRejected("malformed", f"{what} is not UTF-8") from None


def _read_entries(buf: bytes, off: int, end: int,
                  limit: int) -> tuple[tuple[DigestEntry, ...], int]:
    """The digest body at ``off``: ``_read_text`` inlined, as this loop is the hot one."""
    if end - off < _COUNT.size:
        raise FrameRejected("truncated", "entry count")
    (count,) = _COUNT.unpack_from(buf, off)
    off += _COUNT.size
    if count > limit:
        raise FrameRejected("malformed", f"{count} entries > {limit}")
    entries: dict[str, DigestEntry] = {}
    entry_size, unpack_entry = _ENTRY.size, _ENTRY.unpack_from
    try:
        for _ in range(count):
            if end - off < entry_size:
                raise FrameRejected("truncated", "entry")
            inc, pid, age, status, klen, neps = unpack_entry(buf, off)
            off += entry_size
            stop = off + klen
            if status not in STATUSES or neps > MAX_ENDPOINTS or not 0 < klen <= MAX_KEY_BYTES:
                raise FrameRejected("malformed", f"status {status}, {neps} endpoints, key {klen}")
            if stop > end:
                raise FrameRejected("truncated", "key")
            raw = buf[off:stop]
            eps: list[str] = []
            for _ in range(neps):
                if stop >= end:
                    raise FrameRejected("truncated", "endpoint")
                n = buf[stop]
                off, stop = stop + 1, stop + 1 + n
                if not 0 < n <= MAX_ENDPOINT_BYTES:
                    raise FrameRejected("malformed", f"endpoint length {n}")
                if stop > end:
                    raise FrameRejected("truncated", "endpoint")
                ep = buf[off:stop]
                if b"\x00" in ep:
                    raise FrameRejected("malformed", "NUL in endpoint")
                eps.append(ep.decode("utf-8"))
            off = stop
            if b"\x00" in raw:
                raise FrameRejected("malformed", "NUL in key")
            key = raw.decode("utf-8")
            if key in entries:
                raise FrameRejected("malformed", f"duplicate key {key!r}")
            if not key.isprintable():  # refused as check_key does: that entry, not the
                continue  # frame (one old row must not make a whole host read DEAD)
            entries[key] = DigestEntry(key, inc, status, pid, age, tuple(eps))
    except UnicodeDecodeError:
        raise FrameRejected("malformed", "key or endpoint is not UTF-8") from None
    return tuple(entries.values()), off


def _decode_ping(buf: bytes, end: int) -> Ping:
    if end < _PING_HEAD.size:
        raise FrameRejected("truncated", "ping header")
    _, _, _, _, _, boot, inc, nonce, known_gen, kboot, kinc, alen = _PING_HEAD.unpack_from(buf)
    addr, off = _read_text(buf, _PING_HEAD.size, end, alen, MAX_ADDRESS_BYTES, "address")
    if end - off != _PING_TAIL.size:
        raise FrameRejected("truncated" if end - off < _PING_TAIL.size else "malformed",
                            "ping tail")
    challenge, echo, gen = _PING_TAIL.unpack_from(buf, off)
    known = None if kboot == _ZERO_BOOT and kinc == 0 else Identity(kboot, kinc)
    return Ping(Identity(boot, inc), addr, nonce, known_gen, known, challenge, echo, gen)


def _decode_ack(buf: bytes, end: int) -> Ack:
    if end < _ACK_HEAD.size:
        raise FrameRejected("truncated", "ack header")
    _, _, _, _, _, boot, inc, nonce, gen, full, alen = _ACK_HEAD.unpack_from(buf)
    if full > FULL_CUT:
        raise FrameRejected("malformed", f"full={full}")
    addr, off = _read_text(buf, _ACK_HEAD.size, end, alen, MAX_ADDRESS_BYTES, "address")
    entries: tuple[DigestEntry, ...] = ()
    body_age = 0
    if full:
        if end - off < _BODY_AGE.size:
            raise FrameRejected("truncated", "body age")
        (body_age,) = _BODY_AGE.unpack_from(buf, off)
        off += _BODY_AGE.size
        entries, off = _read_entries(buf, off, end, MAX_DIGEST_ENTRIES)
    if off != end:
        raise FrameRejected("malformed", "trailing bytes")
    return Ack(nonce, Identity(boot, inc), addr, gen, bool(full), entries, full == FULL_CUT,
               body_age)


def _decode_push(buf: bytes, end: int) -> Push:
    if end < _PUSH_HEAD.size:
        raise FrameRejected("truncated", "push header")
    _, _, _, _, _, boot, inc, seq, gen, alen = _PUSH_HEAD.unpack_from(buf)
    addr, off = _read_text(buf, _PUSH_HEAD.size, end, alen, MAX_ADDRESS_BYTES, "address")
    entries, off = _read_entries(buf, off, end, MAX_PUSH_ENTRIES)
    if off != end:
        raise FrameRejected("malformed", "trailing bytes")
    return Push(Identity(boot, inc), addr, seq, gen, entries)


_DECODERS: dict[int, Callable[[bytes, int], Frame]] = {
    PING: _decode_ping, ACK: _decode_ack, PUSH: _decode_push}


def decode(frame: bytes | bytearray | memoryview, secret: Keys = None) -> Frame:
    """Parse one frame, or raise :class:`FrameRejected` (and nothing else for bad input).

    Order: size bound, header (magic, version, type, flags), then the tag (with a secret
    it must be present and valid under one of the secrets accepted; without one it must
    be absent, so a half-configured pair is noticed), and only then the body.  Replay
    is the caller's check."""
    if not isinstance(frame, bytes):
        if not isinstance(frame, (bytearray, memoryview)):
            raise TypeError(f"a frame is bytes, not {type(frame).__name__}")
        frame = bytes(frame)
    size = len(frame)
    if size > MAX_FRAME_BYTES:
        raise FrameRejected("oversized", f"{size} bytes")
    if size < _HEADER.size:
        raise FrameRejected("truncated", "header")
    magic, version, ftype, flags, reserved = _HEADER.unpack_from(frame)
    if magic != MAGIC:
        raise FrameRejected("magic")
    if version != VERSION:
        raise FrameRejected("version", f"version {version}")
    decoder = _DECODERS.get(ftype)
    if decoder is None:
        raise FrameRejected("type", f"type {ftype}")
    if flags & ~FLAG_AUTH or reserved:
        raise FrameRejected("malformed", f"flags {flags:#x}, reserved {reserved}")
    end = size
    if secret is not None:
        keys = secret.accepted() if isinstance(secret, Secrets) else (secret,)
        macs = [fresh_mac(k) for k in keys]  # validates the secrets
        if not flags & FLAG_AUTH:
            raise FrameRejected("auth", "no tag")
        end = size - TAG_BYTES
        if end < _HEADER.size:
            raise FrameRejected("truncated", "tag")
        tag = frame[end:]
        for mac in macs:  # the signing secret first: the second costs only in a rotation
            mac.update(memoryview(frame)[:end])
            if hmac.compare_digest(mac.digest()[:TAG_BYTES], tag):
                break
        else:
            raise FrameRejected("auth", "bad tag")
    elif flags & FLAG_AUTH:
        raise FrameRejected("auth", "tagged frame, no secret configured")
    return decoder(frame, end)


__all__ = [
    "ACK", "MAGIC", "MAX_DIGEST_BODY_BYTES", "MAX_DIGEST_ENTRIES", "MAX_FRAME_BYTES",
    "MIN_SECRET_BYTES", "PING", "PUSH", "REASONS", "STATUSES", "TAG_BYTES", "U64_MAX", "VERSION",
    "Ack", "DigestEntry", "Frame", "FrameRejected", "Identity", "Ping", "Push", "decode",
    "encode_ack", "encode_ack_raw", "encode_entries", "encode_ping", "encode_push",
    "encode_refusal", "fresh_mac", "Keys", "seal", "Secrets",
]
