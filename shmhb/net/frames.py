"""The pinger wire protocol's records: what ``shmhb.net.protocol`` decodes frames into
and encodes them from, and the one error its decoder raises.  Pure data, no I/O."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Union

from shmhb.errors import ProtocolError

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
    to the responder, the last the responder issued to the sender (``shmhb.net.challenge``).
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
