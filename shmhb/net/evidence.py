"""When a followed host's own ping counts as evidence that its pinger runs, and the
challenges that make it so without a secret.  Pure.

docs/PROTOCOL.md, "Inbound pings as evidence", gives the rule and argues why it cannot
be forged or replayed into a false ALIVE.  In short, a ping that decoded and passed the
replay guard counts only if:

* frames are authenticated (a shared secret or CURVE), or else it echoes a challenge we
  sent in our own pings to that host's listen address (the challenges below): only that
  host's live pinger (or whoever could already answer our pings to it) knows one.  The
  TCP connection's source address proves nothing: another process on that host, or a
  container behind its NAT, connects from the same address;
* its identity is the one a followed host's acks to our own nonces established (a ping
  cannot introduce an identity).  That identity, not the address the ping names, says
  which host it is: a host behind NAT, or followed by a name, names an address we do
  not follow it by, and its pings count all the same;
* its nonce is above every nonce of that host that counted before (kept with the
  followed host, not in the bounded replay guard);
* it names our board and our *current* digest generation, which each pinger process
  starts at a random value: a ping recorded before we restarted never matches.
"""

from __future__ import annotations

import ipaddress
import os
from typing import Final

from .protocol import Identity, Ping


# --- challenges: what makes a followed host's own ping evidence without a secret ----------
#
# Without authentication nothing in a frame is secret, and the TCP connection a ping
# arrives on proves nothing either: a container behind the host's NAT, or any other
# process on that host, opens a connection from the host's address.
# So a ping from host B counts as evidence at A only if it carries something that only
# B's live pinger can know: the **challenge** A last sent in its own pings to B's listen
# address, echoed.  docs/PROTOCOL.md, "Inbound pings as evidence", states the rule and
# its proof; in short:
#
# * A draws each challenge from ``os.urandom`` (64 bits, never 0) and sends it only in
#   pings over the connection A opened to B's listen address.  Whoever reads those pings
#   is B's pinger, or whoever holds B's listen address or sits on the path: the parties
#   that could already answer A's pings to B (the documented risk without a secret).
#   A forger elsewhere (another process on B, a container behind B's NAT) sees none of
#   them; a guess hits one of the ``KEEP`` challenges A accepts 3 times in 2**64.
# * A challenge dies with the process that learned it: B's pinger killed, its successor
#   knows none, and its pings count again only after A's next ping to it (its next turn,
#   since the evidence stopped).  A stopped pinger sends nothing.
# * Every ping carries a challenge field (0: none); a pinger fills it only without a
#   secret, and only in pings to a followed host's listen address.
#
# With a secret (or CURVE), pings are authenticated and count as such; no challenge is
# sent.

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


# --- the rule -----------------------------------------------------------------------------


def host_ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address ``host`` names if it is an IP literal; None for a name (a name is
    never compared with a connection's source: resolving it is not ours to trust)."""
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def from_host(source: str | None, ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None
              ) -> bool:
    """Whether a connection whose remote address is ``source`` (libzmq's Peer-Address)
    comes from ``ip``, the address a followed host is known by."""
    if source is None or ip is None:
        return False
    try:
        got = ipaddress.ip_address(source.strip("[]"))
    except ValueError:
        return False
    if isinstance(got, ipaddress.IPv6Address) and got.ipv4_mapped is not None:
        got = got.ipv4_mapped  # an IPv4 peer on a dual-stack socket
    return got == ip


def passive(me: Identity, them: Identity) -> bool:
    """In a pair that follows each other, whether we (``me``) are the passive side:
    the one with the larger board identity.  Both sides compare the same two values
    (each learnt the other's from its acks), so exactly one of them is passive whatever
    addresses they know each other by (their listen addresses would not do: behind NAT
    or a name the two sides could both be active, or both passive)."""
    return (me.boot_id, me.board_inc) > (them.boot_id, them.board_inc)


def counts_as_evidence(ping: Ping, *, authenticated: bool, known: Identity | None,
                       last_nonce: int, me: Identity, my_gen: int,
                       echoed: bool = False) -> bool:
    """Whether ``ping`` (from the followed host whose acks established ``known``, and
    whose pings up to ``last_nonce`` counted before) is evidence that its pinger runs.
    ``echoed``: it echoes a challenge we sent that host (``echoed``);
    it stands in for authentication, never adds to it."""
    return ((authenticated or echoed) and known is not None
            and ping.identity == known and ping.nonce > last_nonce
            and ping.known_identity == me and ping.known_gen == my_gen)
