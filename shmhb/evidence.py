"""When a followed host's own ping counts as evidence that its pinger runs.  Pure.

docs/PROTOCOL.md, "Inbound pings as evidence", gives the rule and argues why it cannot
be forged or replayed into a false ALIVE.  In short, a ping that decoded and passed the
replay guard counts only if:

* frames are authenticated (a shared secret or CURVE): without it, anyone who can reach
  our port could claim any host, a risk larger than the documented one;
* its identity is the one that host's acks to our own nonces established (a ping
  cannot introduce an identity);
* its nonce is above every nonce of that host that counted before (kept with the
  followed host, not in the bounded replay guard);
* it names our board and our *current* digest generation, which each pinger process
  starts at a random value: a ping recorded before we restarted never matches.
"""

from __future__ import annotations

from .protocol import Identity, Ping


def counts_as_evidence(ping: Ping, *, authenticated: bool, known: Identity | None,
                       last_nonce: int, me: Identity, my_gen: int) -> bool:
    """Whether ``ping`` (from the followed host whose acks established ``known``, and
    whose pings up to ``last_nonce`` counted before) is evidence that its pinger runs."""
    return (authenticated and known is not None and ping.identity == known
            and ping.nonce > last_nonce and ping.known_identity == me
            and ping.known_gen == my_gen)
