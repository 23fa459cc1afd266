"""The local digest: what this host's pinger tells its watchers about local slots.

Rebuilt only when a slot's status or incarnation changed; its encoded body is cached per
generation so an ack costs a header and a copy.  Whether anything changed costs one
vectorised judgement of the whole board, and that judgement itself runs only when the
board's change counter moved or ``rejudge_ns`` passed since the last one (see
``rebuild``): an idle pinger judged its 16 slots 20 times a second for nothing.  The generation starts at a random value, not 0: the board's
identity outlives this process, so a restarted pinger (or a standby taking over) that
counted from 0 again could reach the very generation number a watcher already holds,
with different contents (a worker died meanwhile), and answer "unchanged": the watcher
would keep a stale ALIVE for good.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

import numpy as np

from ..board.handle import Board
from ..board.core import board_words
from ..board.judge import Thresholds, judge_local_array
from ..board.layout import (
    hb_ts, inc_tag, ts_units, units_to_ms, units_to_ns, word_tag, word_tag_array,
)
from ..errors import ProtocolError
from .protocol import MAX_DIGEST_BODY_BYTES, MAX_DIGEST_ENTRIES, DigestEntry, encode_entries
from ..ratelog import RateLimitedLog

log = logging.getLogger(__name__)

#: The longest wait between two judgements of the board when its change counter stands
#: still: a slot turning SUSPECT or DEAD by age alone (a hung worker) reaches the digest
#: and the pushes at most this late.
REJUDGE_MAX_NS = 250_000_000
_COUNT_BYTES = len(encode_entries(()))  # a digest body's entry count


_REJUDGE_PARTS = 8  # judgements per suspect_after while only time moves


def rejudge_ns(th: Thresholds) -> int:
    """How long the digest may go without a judgement while nothing but time changed:
    an eighth of ``suspect_after`` (a worker's staleness is seen within 1/8 of the time
    it takes), at most ``REJUDGE_MAX_NS`` (250 ms at the default 2 s)."""
    return max(1, min(REJUDGE_MAX_NS, units_to_ns(th.suspect) // _REJUDGE_PARTS))


class LocalDigest:
    def __init__(self, board: Board, count: Callable[[str, int], None] | None = None) -> None:
        self.b = board
        self.bw = board_words(board)
        self._count = count  # the agent's counters (AgentWords.count), if any
        self.cut = 0  # slots left out of the current generation (they did not fit)
        self.gen = random.getrandbits(61) | 1  # never 0 (a ping's 0 says: none)
        self.body = encode_entries(())
        self.body_units = 0  # board time (units) when the body's ages were taken
        self._key: tuple[bytes, bytes] | None = None
        self._entries: dict[str, DigestEntry] = {}
        self._ratelog = RateLimitedLog(log, now_ns=board_words(board).now_ns)  # the board's clock
        self.rejudge_ns = rejudge_ns(board.thresholds)
        self._seen_changes: int | None = None
        self._next_judge_ns = 0
        # Built from the board before anyone can read it: a standby that took the role
        # over answered its first pings (the responder drains before it flushes) with a
        # fresh generation and an empty body, and every watcher dropped this host's live
        # workers as GONE until the next ack.  The changes found now are nobody's news:
        # no watcher has pinged this holder yet.
        self.rebuild(force=True)

    def rebuild(self, now_ns: int | None = None, *, force: bool = False) -> list[DigestEntry]:
        """Rebuild the digest if a local slot changed; returns the changes worth a push:
        new incarnations and every change of status.  A receiver applies only deaths,
        leaves and restarts from a push; any other change makes it ask for the whole
        digest at its next turn (``pinger._on_push``), which matters to the passive side
        of a mutual pair: it hears our acks only once per ``peer_dead_after``.

        Skipped (returns ``[]`` at once) unless ``force``, ``now_ns`` is None, the
        board's change counter moved since the last judgement, or ``rejudge_ns`` passed.
        Why that is enough: every change a digest shows moves the counter, except the
        ones by age (a worker going stale, or beating again after a stall) -- a
        registration, a leave or a forget moves ``reg_gen`` (after its words are
        written), a verdict the agent writes moves ``agent_gen``.  The counter
        and the slot words are separate words, and on aarch64 another core may see the
        counter move before the words it follows; then this judgement finds nothing new
        and the next one, at most ``rejudge_ns`` later, does.  So the counter only ever
        makes a change seen sooner; the period alone bounds how late (the same bound
        that covers changes by age).  No order between words is relied on."""
        b = self.b
        ch = b.changes()
        if not force and now_ns is not None:
            if ch == self._seen_changes and now_ns < self._next_judge_ns:
                return []
            self._next_judge_ns = now_ns + self.rejudge_ns
        self._seen_changes = ch
        hb, v, now = b.snapshot()
        codes, _ = judge_local_array(hb, v, int(now), b.thresholds)
        key = (codes.tobytes(), word_tag_array(hb).tobytes())
        if key == self._key:
            return []
        self._key = key
        entries, cut = self._collect(hb, codes, int(now))
        news = [e for k, e in entries.items()
                if (old := self._entries.get(k)) is None or old.incarnation != e.incarnation
                or old.status != e.status]
        if [(e.key, e.incarnation, e.status) for e in entries.values()] == [
                (e.key, e.incarnation, e.status) for e in self._entries.values()]:
            return []
        self._entries = entries
        self.gen += 1
        self.body, self.body_units = encode_entries(entries.values()), int(now)
        self._report_cut(cut)
        return news

    def _collect(self, hb: np.ndarray, codes: np.ndarray, now: int
                 ) -> tuple[dict[str, DigestEntry], int]:
        """The entries of the slots judged ``codes`` that fit one ACK, and how many did
        not.  Live slots first, then dead, then left (the status codes' order; by slot
        within one): if the digest cannot hold every slot, what is cut is the least
        worth carrying -- a left or dead slot cut reads GONE at the watcher, never ALIVE."""
        used, cut = _COUNT_BYTES, 0
        entries: dict[str, DigestEntry] = {}
        order = np.flatnonzero(codes)
        for i in order[np.argsort(codes[order], kind="stable")]:
            info = self.bw.read_slot(int(i))
            if info is None:
                continue
            k, pid, inc, eps = info
            w = int(hb[i])
            if word_tag(w) != inc_tag(inc):
                continue
            e = DigestEntry(k, inc, int(codes[i]), pid, int(units_to_ms(now - hb_ts(w))), eps)
            if (n := self._fits(e)) and used + n <= MAX_DIGEST_BODY_BYTES \
                    and len(entries) < MAX_DIGEST_ENTRIES:
                entries[k], used = e, used + n
            elif n:
                cut += 1
        return entries, cut

    def body_age_ms(self) -> int:
        """How long ago the body's ages were taken (a full ack says so: its receiver
        then knows each listed worker's own beat time, not only its host's)."""
        return max(0, int(units_to_ms(ts_units(self.bw.now_ns()) - self.body_units)))

    def _report_cut(self, cut: int) -> None:
        """Never silent: slots that did not fit the digest are counted (``digest_cut``,
        per new generation that left some out) and logged, rate-limited."""
        self.cut = cut
        if not cut:
            return
        if self._count is not None:
            self._count("digest_cut", cut)
        self._ratelog.warn("cut", "board %s: %d slot(s) left out of the digest (it holds %d "
                           "entries or %d bytes at most; live slots go first): other hosts "
                           "see them as gone; forget dead and left slots (`shmhb forget`) "
                           "or use fewer slots per board", self.b.name, cut,
                           MAX_DIGEST_ENTRIES, MAX_DIGEST_BODY_BYTES)

    def _fits(self, e: DigestEntry) -> int:
        """The bytes ``e`` takes in a digest, or 0 if it does not fit the wire's limits.  A slot whose stored record the wire
        refuses (damaged, or an endpoint over 63 bytes, say) is left out of the digest with a rate-limited log,
        never allowed to stop the digest, and with it the agent (every standby would
        read the same slot)."""
        try:
            return len(encode_entries((e,))) - _COUNT_BYTES
        except ProtocolError as err:
            self._ratelog.warn("unfit", "board %s: slot %r left out of the digest: %s",
                               self.b.name, e.key, err)
            return 0
