"""Challenges: what makes a followed host's own ping evidence without a secret.  Pure.

Without authentication nothing in a frame is secret, and the TCP connection a ping
arrives on proves nothing either: a container behind the host's NAT, or any other
process on that host, opens a connection from the host's address (issue 23, case 1).
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
* Every ping carries a challenge field (0: none); a pinger fills it only without a
  secret, and only in pings to a followed host's listen address.

With a secret (or CURVE), pings are authenticated and count as such; no challenge is
sent.
"""

from __future__ import annotations

import os
from typing import Final

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


__all__ = ["KEEP", "echoed", "issue", "new_challenge"]
