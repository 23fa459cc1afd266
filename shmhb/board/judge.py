"""Judging: pure functions from board words and a clock reading to a ``Status``.

No I/O, no clock of its own: callers pass ``now`` in board time units (see
``layout.ts_units``).  This module is the one place that decides what a word means, so
every reader, the agent, the CLI and the tests judge alike.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import native
from .layout import (
    CODE_MASK, CODE_SHIFT, GEN_MASK, GEN_SHIFT, INC_MASK, INC_SHIFT, LEFT_BIT, TS39_MASK,
    TS40_MASK,
)
from ..status import Status

ALIVE, SUSPECT, DEAD, LEFT, UNKNOWN = (
    Status.ALIVE, Status.SUSPECT, Status.DEAD, Status.LEFT, Status.UNKNOWN,
)


class Thresholds(NamedTuple):
    """A board's policy in time units, read once from its header."""

    suspect: int
    dead: int
    agent_stale: int
    peer_suspect: int
    peer_dead: int


def judge_local(hb: int, verdict: int, now: int, th: Thresholds) -> tuple[Status, int]:
    """Status and age (units) of a local slot from its two words.

    ``hb`` is written only by the worker, ``verdict`` only by the agent; each names the
    incarnation it is about, so reading them at different moments is safe: a verdict
    about an older incarnation simply does not apply.
    """
    ts = hb & TS39_MASK
    age = now - ts if now > ts else 0
    if hb & LEFT_BIT:
        return LEFT, age
    if verdict and (verdict >> INC_SHIFT) == (hb >> INC_SHIFT):
        return DEAD, age
    if age >= th.dead:
        return DEAD, age
    if age >= th.suspect:
        return SUSPECT, age
    return ALIVE, age


def judge_agent(agent_hb: int, now: int, th: Thresholds) -> tuple[Status, int | None]:
    """The agent's own liveness: ALIVE while its heartbeat is fresh, SUSPECT when it is
    stale (stalled or gone), LEFT after a clean exit, UNKNOWN if no agent ever ran."""
    if agent_hb == 0:
        return UNKNOWN, None
    ts = agent_hb & TS39_MASK
    age = now - ts if now > ts else 0
    if agent_hb & LEFT_BIT:
        return LEFT, age
    return (ALIVE if age < th.agent_stale else SUSPECT), age


def agent_fresh(agent_hb: int, now: int, th: Thresholds) -> bool:
    return agent_hb != 0 and not agent_hb & LEFT_BIT and now - (agent_hb & TS39_MASK) < th.agent_stale


def judge_row(word: int, gen: int, agent_ok: bool, now: int) -> tuple[Status, int] | None:
    """Status and age of a peer or remote row written by the agent.

    None when the word does not belong to the record generation ``gen`` (the row is
    being rewritten: retry or skip).  UNKNOWN when this host's agent is not running,
    whatever the row says: nobody is observing, so the last verdict proves nothing.
    """
    if (word >> GEN_SHIFT) & GEN_MASK != gen & GEN_MASK:
        return None
    ts = word & TS40_MASK
    age = now - ts if now > ts else 0
    if not agent_ok:
        return UNKNOWN, age
    return Status.from_code((word >> CODE_SHIFT) & CODE_MASK), age


_STALE = frozenset((Status.SUSPECT, Status.DEAD, Status.LEFT))


def beat_age(word: int, gen: int, reported: Status, now: int) -> int | None:
    """A remote worker's own time since its last beat (units), from its row's beat word
    (``layout.REMOTE_ROW_DTYPE``), or None where it is not known.  Known only for a
    worker its host reported stale (SUSPECT, DEAD, LEFT): such a worker has not beaten
    since the report that gave the beat (else its host reports it ALIVE again), so the
    age grows with our clock.  An ALIVE one beat since, by an amount no report tells;
    a word of another row generation, or 0 (a v1 full ack told no beat), says nothing."""
    if reported not in _STALE or not word or (word >> GEN_SHIFT) & GEN_MASK != gen & GEN_MASK:
        return None
    ts = word & TS40_MASK
    return now - ts if now > ts else 0


def combine_remote(reported: Status, host: Status) -> Status:
    """A remote worker's status: what its host reported, bounded by the host's own.

    A dead host takes its workers with it; a host that left, its live ones with it (as
    left); a suspect host makes an alive worker suspect;
    UNKNOWN (no observer here) hides everything.
    """
    if host is UNKNOWN or host is DEAD:
        return host
    if reported is LEFT or reported is DEAD:
        return reported
    if host is LEFT:  # it said goodbye with none of its workers alive
        return LEFT
    if host is SUSPECT:
        return SUSPECT
    return reported


def peer_verdict(silent_units: int, th: Thresholds, *, self_suspect: bool) -> Status:
    """The pinger's verdict on a host from how long it stayed silent *while this pinger
    was healthy* (silence accrued during our own late loop does not count).

    ``self_suspect``: every watched host went silent at once, or our loop has just been
    late: the evidence more likely says something about us, so never convict (Cassandra
    refuses to convict after its own pause; Lifeguard doubts itself first) and stop at
    SUSPECT until at least one peer answers again.
    """
    if silent_units >= th.peer_dead and not self_suspect:
        return DEAD
    if silent_units >= th.peer_suspect:
        return SUSPECT
    return ALIVE


def hb_incarnation_tag(hb: int) -> int:
    return (hb >> INC_SHIFT) & INC_MASK


_U39 = np.uint64(TS39_MASK)
_ULEFT = np.uint64(LEFT_BIT)
_USHIFT = np.uint64(INC_SHIFT)


def judge_local_array(hb: np.ndarray, verdict: np.ndarray, now: int, th: Thresholds
                      ) -> tuple[np.ndarray, np.ndarray]:
    """``judge_local`` over whole arrays of words (1-D uint64, contiguous, one length:
    what ``snapshot()`` returns): status codes (``Status.code``, 0 for an empty slot)
    and ages in units.  Same rules, element by element (tested so): in one C pass
    (``shmhb.h``'s ``shmhb_judge_local``) on the native path, else in numpy."""
    ext = native.extension()
    if ext is None:
        return judge_local_array_numpy(hb, verdict, now, th)
    codes = np.empty(len(hb), np.uint8)
    age = np.empty(len(hb), np.uint64)
    ext.judge_local_array(hb, verdict, codes, age, int(now), th.suspect, th.dead)
    return codes, age


def judge_local_array_numpy(hb: np.ndarray, verdict: np.ndarray, now: int, th: Thresholds
                            ) -> tuple[np.ndarray, np.ndarray]:
    """``judge_local_array`` on the pure-Python path: as few whole-array operations as
    possible, since each costs about as much as its data on a board of a thousand
    slots."""
    now_u = np.uint64(now)
    age = hb & _U39
    np.minimum(age, now_u, out=age)
    np.subtract(now_u, age, out=age)
    # ALIVE=1, SUSPECT=2, DEAD=3 by age alone; a verdict on this incarnation is DEAD
    codes = (age >= th.suspect).view(np.uint8) + (age >= th.dead).view(np.uint8)
    codes += 1
    vdead = (verdict >> _USHIFT) == (hb >> _USHIFT)
    vdead &= verdict != 0
    np.maximum(codes, vdead.view(np.uint8) * np.uint8(DEAD.code), out=codes)
    left = (hb & _ULEFT) != 0
    np.putmask(codes, left, LEFT.code)
    np.putmask(codes, hb == 0, 0)
    return codes, age
