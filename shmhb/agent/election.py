"""The election of the agent role: terms as lock bytes, and how a stalled holder is
replaced.

Term T of the role is held by whoever holds the OFD lock byte ``term_byte(T)``
(``LOCK_TERM_BASE + T % TERM_RING``); the board's ``agent_term`` names the current one.
The kernel drops the byte when its holder dies, as it did the single role lock before.

**Who writes ``agent_term``.**  A process takes term t+1 only through ``claim(t)``: it
try-locks ``term_byte(t+1)``, *then* re-reads ``agent_term``, and writes t+1 only if it
still reads t.  So every value of ``agent_term`` is written once, by the holder of its
byte, right after it read the value before it:

* two processes cannot both write t+1: both would need ``term_byte(t+1)`` at once, and the
  second to get it (after the first released it, a syscall after its write) re-reads
  t+1 or later, not t, and backs off (the kernel's lock hand-over orders the first's
  store before the second's load: a release and an acquire of the same lock);
* while the claimer holds the byte of t+1 and reads t, nobody can write any other value:
  writing t' + 1 needs to read t', and the word holds t until the claimer writes t+1;
  the word only grows, so "still t" means "nobody took t+1 meanwhile".

So exactly one process ever took term t+1, and only it believes it holds the current
term: a holder compares ``agent_term`` with its own term before it writes (the agent's
per-step check) and stands down once it moved on.

**When a standby claims.**  When the current term's byte is free (its holder released
it or died), at once (embedded standbys leave it a while to a waiting daemon).  When it
is held but the holder's heartbeat word ``agent_hb`` has not moved for
``stall_bound_ns`` (``STALL_FACTOR`` times the board's ``agent_stale_ns``, which readers
already use to call the agent stale; 3 s by default) as the standby watches it: the
holder is stalled as a whole -- SIGSTOPped, or a C call holds its GIL so neither its
loop nor its watchdog runs.  Embedded standbys wait ``DAEMON_GRACE_NS`` longer, so with a
``shmhb pinger`` running the daemon wins.  If the byte of t+1 is held by someone else (a
racing standby, or a holder of term t+1-TERM_RING still stalled) the claim fails this
round; a standby logs it (rate-limited) when it persists.

**The stale writer, and its repair.**  A stalled holder that resumes may write a few
words between its last check and its stop (check-then-write is not atomic): at most one
step of its loop (it checks at the start of a step, after the poll, before its tick and
between the components' ticks).  Anything the role writes may be hit: ``agent_hb``,
``agent_id``, ``agent_gen``, counters, ``net_*``, ``net_counter``, peer and remote rows,
slot verdicts.  The new holder bounds and repairs that damage:

* at its takeover it records ``held_others``: every term byte held by another process,
  the stalled holders that may still write (a holder keeps its byte until it has stopped
  writing; any holder not holding its byte then can never write again);
* it polls those bytes; once all are free -- each was released by a syscall *after* its
  holder's last write, or by the kernel at its death -- it takes a fresh term (claim t+1
  again, from itself) and sets every component up anew, exactly as after a holder's
  crash: peer verdicts forgotten, its words written for the new term, the network half
  restarted (until then it listened beside the stalled holder, which kept the listen
  address: ``shmhb.net.listener``; now the address is its alone).  The takeover
  path already has to be correct on a board left mid-step by a holder killed anywhere,
  and that is all the stale writer can have left: its last write precedes its release.
  The send counter (``net_counter``) is raised back to the highest reservation this
  process made, in case the stale writer stored a lower one.

Meanwhile readers may see, for that bounded window (the stale writer's one step, then
until the new holder's next poll of the bytes, ~0.1 s), the old term's heartbeat (the
agent's pid then reads 0: its id word names another term), its ``net_state`` (named by
its term, so shown as not the holder's), or a peer or remote verdict of its frozen view;
no word has two writers at once outside that window.  (One window stays as it was:
the in-process watchdog of a loop stuck mid-step lets its byte go at once, so that loop,
should its call return, may finish that step after a plain takeover; see ``Agent``.)
"""

from __future__ import annotations

import logging

from ..board import locks
from ..board.config import Policy
from ..errors import InvalidConfig
from ..board.layout import LOCK_TERM_BASE, TERM_RING, TERM_WORD, header_index, term_byte

log = logging.getLogger(__name__)

#: indices among the header's u64 words (``BoardWords.words``); TERM_WORD is layout's
HB_WORD = header_index("agent_hb")
STALE_WORD = header_index("agent_stale_ns")

#: a holder whose heartbeat stands still for this many ``agent_stale_ns`` is replaced
STALL_FACTOR = 3
#: the bound is kept within these, whatever the header says (nothing outside trusted)
STALL_MIN_NS = 1_000_000_000
STALL_MAX_NS = 60_000_000_000


#: an agent beats once per tick: a tick may be at most this share of agent_stale_s, so
#: that a few late ticks still keep its heartbeat fresh for readers
TICKS_PER_STALE = 4


def max_tick_s(policy: Policy) -> float:
    """The longest tick of an agent on a board with ``policy``."""
    return policy.agent_stale_s / TICKS_PER_STALE


def check_tick(tick_s: float, policy: Policy, *, what: str = "tick_s") -> None:
    """``InvalidConfig`` naming the bound if an agent ticking every ``tick_s`` would read
    stale (or be replaced as stalled) on a board with ``policy``, while healthy."""
    bound = max_tick_s(policy)
    if tick_s > bound:
        stale = policy.agent_stale_s
        raise InvalidConfig(
            f"{what} {tick_s:g} s is too long for this board: at most {bound:g} s, "
            f"agent_stale_s / {TICKS_PER_STALE} (the board's agent_stale_s is {stale:g} s). "
            "The agent beats once per tick; readers call it stale once its beat is older "
            f"than agent_stale_s, and a standby replaces it as stalled after "
            f"{STALL_FACTOR} x agent_stale_s ({STALL_FACTOR * stale:g} s, the stall bound)")


def stall_bound_ns(words: memoryview) -> int:
    """How long the holder's heartbeat may stand still before a standby replaces it."""
    return min(max(STALL_FACTOR * int(words[STALE_WORD]), STALL_MIN_NS), STALL_MAX_NS)


def claim(fd: int, words: memoryview, t: int) -> bool:
    """Take term t+1, having read ``agent_term == t``: lock its byte, re-read, write.
    True: this fd holds ``term_byte(t + 1)`` and ``agent_term`` is t+1 (written here).
    False: the byte is held by another, or the term moved on (the byte is let go)."""
    b = term_byte(t + 1)
    if not locks.try_lock(fd, b):
        return False
    if int(words[TERM_WORD]) != t:
        locks.unlock(fd, b)
        return False
    # Sole writer of this word: we hold t+1's byte and read t after taking it (see the
    # module text); one aligned 64-bit store.
    words[TERM_WORD] = t + 1
    return True


def held_others(fd: int, mine: int) -> set[int]:
    """The term bytes other than ``mine`` held by other processes: holders of older terms,
    stalled, that may still write (one F_OFD_GETLK each, only at a takeover)."""
    out = set()
    for k in range(TERM_RING):
        b = LOCK_TERM_BASE + k
        if b != mine and locks.is_held(fd, b):
            out.add(b)
    return out


class StallWatch:
    """A standby's view of the holder's heartbeat word: how long it has stood still, by
    this process's own clock (no other process's clock or time namespace involved).

    The count is of one term's heartbeat: a new term (``agent_term`` moved) starts it
    afresh, whatever the heartbeat word reads.  A new holder writes that word only at
    its first step, after ``claim`` moved the term; counted on, the silence of the
    holder it replaced would be charged to it, and a second standby would take the role
    from a holder still setting up (seen under load: the second one could not listen
    beside the stopped daemon, which the first would have, and the host went unheard)."""

    __slots__ = ("_term", "_word", "_since_ns")

    def __init__(self) -> None:
        self._term = -1
        self._word = -1
        self._since_ns = 0

    def still_for_ns(self, term: int, word: int, now_ns: int) -> int:
        if word != self._word or term != self._term:
            self._term, self._word, self._since_ns = term, word, now_ns
        return now_ns - self._since_ns

    def reset(self) -> None:
        self._term = self._word = -1
