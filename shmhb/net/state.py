"""The network half's state machine, pure: its failures and retry backoff.

The agent role holder runs the network half (the pinger) next to the local death
watch.  The local watch never depends on it; the network half goes through::

    off          no listen address configured: no network half at all (not an error)
    starting     settings being applied (sockets being made)
    listening    bound and pinging; every followed host has what it needs
    degraded     configured but not fully working: it cannot listen (port in use, bad
                 address), its secret or keys are unreadable or insecure, a followed
                 host was skipped (no key, unusable address), or an unexpected error
                 stopped it.  Retried with backoff; never weaker security instead.

The holder records the state in the board header (``layout.pack_net_state``), where
``shmhb status`` reads it (``shmhb.board.netword`` names the states and decodes the word);
this module decides when to retry.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import NamedTuple, Protocol

# the word's codes and its decoding live with the board (a lower layer); re-exported
from ..board.netword import NetAuth, NetReason, NetState, decode_network, working

__all__ = ["AgentWords", "Backoff", "NET_OFF", "NetAuth", "NetDown", "NetReason", "NetShown",
           "NetState", "decode_network", "working"]


class AgentWords(Protocol):
    """What the network half may write of the agent's header words (``AgentWriter``)."""

    def changed(self) -> None: ...
    def count(self, stat: str, n: int = 1) -> None: ...


class NetShown(NamedTuple):
    """The network half's state as the supervisor shows it (``shmhb.net.supervisor``) and the
    role holder records it in the board header (``AgentWriter.network``)."""

    state: NetState
    auth: NetAuth
    listening: bool
    reason: NetReason
    err: int  # the errno behind a failure, or 0
    skipped: int  # followed hosts skipped (no key, unusable address)
    error: str  # what went wrong, as ``shmhb status`` shows it


#: no network half: none configured, or an agent run without one
NET_OFF = NetShown(NetState.OFF, NetAuth.NONE, False, NetReason.NONE, 0, 0, "")


class NetDown(Exception):
    """Raised inside the network half when it cannot run as configured.  Not a
    ``ShmhbError``: it never leaves the agent, which records it and retries."""

    def __init__(self, reason: NetReason, message: str, err: int = 0) -> None:
        super().__init__(message)
        self.reason = reason
        self.err = err


@dataclass
class Backoff:
    """Retry delays: ``min_s`` doubling to ``max_s``, each with up to 25 % jitter (so
    the standbys of many hosts restarted together do not retry in step); ``reset`` after
    a success."""

    min_s: float = 0.25
    max_s: float = 10.0
    _next_s: float = 0.0

    def __post_init__(self) -> None:
        self._next_s = self.min_s

    def next_delay_ns(self, rng: random.Random | None = None) -> int:
        d = self._next_s
        self._next_s = min(self.max_s, self._next_s * 2)
        j = (rng or random).random() * 0.25 * d
        return int((d + j) * 1e9)

    def reset(self) -> None:
        self._next_s = self.min_s
