"""When a followed host's own ping counts as evidence that its pinger runs.  Pure.

docs/PROTOCOL.md, "Inbound pings as evidence", gives the rule and argues why it cannot
be forged or replayed into a false ALIVE.  In short, a ping that decoded and passed the
replay guard counts only if:

* frames are authenticated (a shared secret or CURVE), or else it echoes a challenge we
  sent in our own pings to that host's listen address (``shmhb.net.challenge``): only that
  host's live pinger (or whoever could already answer our pings to it) knows one.  The
  TCP connection's source address proves nothing: another process on that host, or a
  container behind its NAT, connects from the same address (issue 23);
* its identity is the one a followed host's acks to our own nonces established (a ping
  cannot introduce an identity).  That identity, not the address the ping names, says
  which host it is: a host behind NAT, or followed by a name, names an address we do
  not follow it by, and its pings count all the same (issue 27);
* its nonce is above every nonce of that host that counted before (kept with the
  followed host, not in the bounded replay guard);
* it names our board and our *current* digest generation, which each pinger process
  starts at a random value: a ping recorded before we restarted never matches.
"""

from __future__ import annotations

import ipaddress

from .protocol import Identity, Ping


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
    ``echoed``: it echoes a challenge we sent that host (``shmhb.net.challenge.echoed``);
    it stands in for authentication, never adds to it."""
    return ((authenticated or echoed) and known is not None
            and ping.identity == known and ping.nonce > last_nonce
            and ping.known_identity == me and ping.known_gen == my_gen)
