"""Challenges: what makes a followed host's own ping evidence without a secret.  Pure.

Without authentication nothing in a frame is secret, and the TCP connection a ping
arrives on proves nothing either: a container behind the host's NAT, or any other
process on that host, opens a connection from the host's address.
So a ping from host B counts as evidence at A only if it carries something that only
B's live pinger can know: the **challenge** A last sent in its own pings to B's listen
address, echoed.  docs/PROTOCOL.md, "Inbound pings as evidence", states the rule and
its proof; in short:

* A draws each challenge from ``os.urandom`` (64 bits, never 0) and sends it only in
  pings over the connection A opened to B's listen address.  Whoever reads those pings
  is B's pinger, or whoever holds B's listen address or sits on the path: the parties
  that could already answer A's pings to B (the documented risk without a secret).
  A forger elsewhere (another process on B, a container behind B's NAT) sees none of
  them; a guess hits one of the ``KEEP`` challenges A accepts 3 times in 2**64.
* A challenge dies with the process that learned it: B's pinger killed, its successor
  knows none, and its pings count again only after A's next ping to it (its next turn,
  since the evidence stopped).  A stopped pinger sends nothing.
* Who may send the extension: a responder advertises that it decodes it by setting
  ``CAPABLE`` (bit 63) in the digest generation of its acks (a generation is opaque to
  every version: a v1 pinger holds and echoes it unchanged).  A pinger sends an
  extended ping to a host only after an ack with that bit, and falls back to a plain
  v1 ping whenever its previous ping went unanswered (a host that went back to v1
  drops extended pings as malformed: one lost ping, then plain ones).  A v1 host's
  pings never count without a secret: both sides ping, as before the saving existed.

With a secret (or CURVE), pings are authenticated and count as before; the extension is
not sent.
"""

from __future__ import annotations

import os
from typing import Final

#: Bit of an ack's (and a push's) digest generation that says "I decode PING challenges".
#: Generations start below 2**61 (``shmhb.net.digest``; 2**62 before version 2) and grow
#: by one per change.
CAPABLE: Final = 1 << 63
#: Bit 62: "I answer version-2 pings" (docs/PROTOCOL.md, "Version 2").  A pinger sends a
#: v2 ping only to a host whose last ack had it, and a plain v1 one after an unanswered
#: ping (a host that went back to v1 drops v2 frames as ``version``).  Responders of
#: version 1 never set it: their generations start below 2**62 and grow by one.
SPEAKS_V2: Final = 1 << 62
#: Challenges issued to a host that its echo may name: the newest and those before it
#: (a ping of B may cross A's next ping to B on the wire).
KEEP: Final = 3


def new_challenge() -> int:
    """A fresh challenge: 64 random bits from the kernel, never 0 (0 means none)."""
    return int.from_bytes(os.urandom(8), "little") or 1


def issue(issued: tuple[int, ...], challenge: int) -> tuple[int, ...]:
    """The challenges kept for a host after ``challenge`` was sent to it."""
    return (challenge, *issued[:KEEP - 1])


def echoed(issued: tuple[int, ...], echo: int) -> bool:
    """Whether ``echo`` (a ping's echo field) is one of the challenges we issued."""
    return echo != 0 and echo in issued


def advertised(gen: int) -> int:
    """The generation a responder puts on the wire for its digest generation ``gen``:
    with the bits that say it decodes challenges and answers v2 pings."""
    return gen | CAPABLE | SPEAKS_V2


def capable(gen: int) -> bool:
    """Whether an ack's generation says that its sender decodes PING challenges."""
    return bool(gen & CAPABLE)


def speaks_v2(gen: int) -> bool:
    """Whether an ack's generation says that its sender answers v2 pings."""
    return bool(gen & SPEAKS_V2)


__all__ = ["CAPABLE", "KEEP", "SPEAKS_V2", "advertised", "capable", "echoed", "issue",
           "new_challenge", "speaks_v2"]
