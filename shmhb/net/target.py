"""What a followed host may speak for: the trust rules the pinger applies to what
arrives on its connection to that host (pure functions, no I/O).

An ack counts only on the connection to the address that was pinged (the caller
matches it to a nonce sent there), from a board identity no other followed host uses,
naming that address -- or a wildcard listen address, which says nothing -- as its own:
otherwise it is another host's ack relayed.  An endpoint counts only from the host it
names: a followed host cannot make another host's killed worker read ALIVE by listing
that worker's endpoint.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..board.config import parse_hostport
from ..errors import InvalidConfig
from .protocol import DigestEntry, Identity
from .rowwriter import RemoteRow
from .suspicion import PeerState

_WILDCARDS = frozenset(("-", "0.0.0.0", "::", "*"))


@dataclass
class Target:
    """A followed host: its routing id on our client socket, our verdict, its rows."""

    address: str
    host: str
    rid: bytes
    endpoint: str
    state: PeerState
    row: int
    gen: int
    next_ping_ns: int  # retries while its connection is down (turns: the ping plan)
    reachable: bool = True
    evidence_nonce: int = 0  # highest nonce of its pings that counted as evidence
    #: acks to pings from this nonce on measure a round trip; earlier ones were sent
    #: while the host was not answering and waited for it to come back (see _on_ack)
    rtt_from_nonce: int = 0
    identity: Identity | None = None
    digest_gen: int = 0
    remotes: dict[str, RemoteRow] = field(default_factory=dict)
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None = None  # ``host`` if an IP literal
    confirm_ns: int = -(1 << 62)  # when a push last made us ping at once (pinger._on_push)
    # Challenges (shmhb.net.evidence), without a secret: the ones we sent it lately, and
    # the last one it sent us (echoed in our pings).
    issued: tuple[int, ...] = ()
    their_challenge: int = 0


#: at most one ping per host per this period is sent at once to confirm a push
CONFIRM_GAP_NS = 50_000_000


def confirm_now(t: Target, now_ns: int) -> bool:
    """Whether a push from ``t`` that told of what only an ack may say (a new key,
    ALIVE again: a push answers no nonce of ours) is confirmed by a ping sent now.  One
    round trip, so a new registration reaches the hosts that watch it about as fast as
    a death does: a KV connector must not take the dead predecessor at an address for
    the engine that replaced it.  A stream of forged pushes costs at most one such ping
    per ``CONFIRM_GAP_NS`` per host; past that the host's next turn asks."""
    if not t.reachable or now_ns - t.confirm_ns < CONFIRM_GAP_NS:
        return False
    t.confirm_ns = now_ns
    return True


def host_of(text: str) -> str | None:
    try:
        return parse_hostport(text)[0].lower()
    except InvalidConfig:
        return None


def speaks_for_another(t: Target, identity: Identity, address: str,
                       targets: Iterable[Target]) -> bool:
    """Whether a frame on ``t``'s connection speaks for another host: a board identity
    another followed host uses, or an address other than ``t``'s."""
    # O(1) per ack in the common case: an ack repeating the identity ``t`` already
    # holds cannot be another host's.  A target's identity is set only from an ack that
    # passed this check (pinger._on_ack), so no two followed hosts ever hold the same
    # one: if ``identity == t.identity`` no other target holds it.  Only a new identity
    # (first ack, a reboot) costs the scan of every followed host.
    if identity != t.identity:
        for o in targets:
            if o is not t and o.identity == identity:
                return True
    if address == t.address or address in _WILDCARDS:
        return False
    h = host_of(address)
    return h is None or h not in _WILDCARDS and address.lower() != t.address.lower()


def own_endpoints(t: Target, e: DigestEntry) -> DigestEntry:
    """``e`` with only the endpoints on ``t``'s own host (``e`` itself if all are)."""
    eps = tuple(ep for ep in e.endpoints if host_of(ep) == t.host)
    if len(eps) == len(e.endpoints):
        return e
    return DigestEntry(e.key, e.incarnation, e.status, e.pid, e.age_ms, eps)
