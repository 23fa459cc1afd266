"""One rule for both roles: is a load from a producer engine futile, judged by the board
slot that serves the producer's address?

The scheduler asks it before a request's load starts (``ShmhbConnector.veto_reason``),
the worker before each transfer request leaves (``WorkerGuard.load_started``).  The slot
is the newest one on this host's board that advertises the address; it may belong to
another engine than the one the request names:

* the requested engine's own slot: DEAD or LEFT vetoes (SUSPECT only with
  ``act_on_suspect``);
* another engine's slot that is ALIVE: that engine serves the address now, so the
  requested one is not there any more (``gone``);
* another engine's slot that is not ALIVE (its dead predecessor, say, while the
  requested engine's own registration is still on its way here): the board knows
  nothing about the requested engine.  No veto: the load goes ahead, and the worker's
  LinkReaper still fails it fast if the engine it reaches dies.

UNKNOWN (this host's agent is not observing) never vetoes.
"""

from __future__ import annotations

from ..status import SlotStatus, Status
from .settings import engine_prefix

#: reasons, as counted in ``vetoes.<reason>``
DEAD, LEFT, SUSPECT, GONE = "dead", "left", "suspect", "gone"


def producer_verdict(slot: SlotStatus | None, engine_id: object, act_on_suspect: bool) -> str | None:
    """Why a load from ``engine_id`` at the address ``slot`` serves is futile, or None."""
    if slot is None or slot.status is Status.UNKNOWN:
        return None
    if isinstance(engine_id, str) and engine_id and not slot.key.startswith(engine_prefix(engine_id)):
        return GONE if slot.status is Status.ALIVE else None
    if slot.status is Status.DEAD:
        return DEAD
    if slot.status is Status.LEFT:
        return LEFT
    if slot.status is Status.SUSPECT and act_on_suspect:
        return SUSPECT
    return None


def may_hold_blocks(reason: str) -> bool:
    """Whether a producer vetoed for ``reason`` may still be alive and hold the request's
    blocks (then it is told it gets no pull: the stock empty pull releases them)."""
    return reason == SUSPECT
