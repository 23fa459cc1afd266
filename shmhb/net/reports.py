"""What a followed host reports about its workers, applied to their rows: the digest of
a full ack, the entries of a push.  An object the network half (``pinger.NetworkHalf``)
constructs and owns, given the board, the row writer, the agent's words and the
bad-input counter.

Each entry's age (``age_ms``, its worker's time since its last beat when the sender
took it) becomes that worker's last beat on our clock (``beat_ns``), written beside its
status: readers then show a remote worker's own age, not only its host's.
A push's ages are taken when it is built, so its receipt is their base (off by at most
the push gap and one trip); a full ack says how old its cached body is
(``Ack.body_age_ms``; saturated: what it lists has no beat time, 0: unknown).  The trust rules are ``shmhb.net.following``'s: an endpoint counts only from
the host it names, a push never revives a worker nor creates a row.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from ..board.handle import Board
from ..board.core import board_words
from ..board.layout import row_code
from ..status import Status
from .protocol import U32_MAX, DigestEntry
from .rowwriter import RowWriter
from .state import AgentWords
from .following import Target, host_of, own_endpoints

_DEAD_OR_LEFT = (Status.DEAD.code, Status.LEFT.code)


class Stored(NamedTuple):
    """What writing a digest's rows did (``Reports._store``)."""
    missed: int  # entries that found no free row
    changed: bool  # a row was freed, added, or changed its incarnation, gen or status


#: how long a host's capped word leads the rows given back for its share, and trails the
#: rows stored once all fit (``Reports.digest``): far more than a store takes to reach
#: another core, so no order between the stores of two words is relied on
SETTLE_NS = 250_000_000


def beat_ns(e: DigestEntry, base_ns: int | None) -> int | None:
    """``e``'s worker's last beat on our clock, its ages having been taken at
    ``base_ns`` (None: not known); None where it cannot be told (a saturated age)."""
    if base_ns is None or e.age_ms >= U32_MAX:
        return None
    return base_ns - e.age_ms * 1_000_000



@dataclass(frozen=True, slots=True)
class PushOutcome:
    """What applying a push did: ``changed`` rows; met a key the last full ack did not
    list (``unlisted``); or a change only an ack may tell, SUSPECT or ALIVE again
    (``ask``)."""

    changed: bool
    unlisted: bool
    ask: bool

class Reports:
    """Digests and pushes of followed hosts, applied to their remote rows."""

    def __init__(self, board: Board, rows: RowWriter, writer: AgentWords,
                 bad: Callable[[str, str], None],
                 alias_hosts: Callable[[Target], set[str]], warn: Callable[..., None]) -> None:
        """``alias_hosts(t)``: the hosts of every followed address that holds ``t``'s
        identity (``Following.alias_hosts``); ``warn(kind, msg, *args)``: the half's
        rate-limited log."""
        self.b = board
        self._alias_hosts = alias_hosts
        self._warn = warn
        #: hosts whose slots are all stored again: (host, when its capped word clears)
        self._uncapping: dict[str, tuple[Target, int]] = {}
        self.bw = board_words(board)
        self.rows = rows
        self.w = writer
        self._bad = bad

    def own(self, t: Target, e: DigestEntry, aliases: set[str] | None = None) -> DigestEntry:
        """``e`` less the endpoints of other hosts (counted as ``spoofed``).  Endpoints
        on another address we reach the same host at are that address's to report (its
        own rows), and no spoofing."""
        kept = own_endpoints(t, e)
        if kept is e:
            return e
        if aliases is None:
            aliases = self._alias_hosts(t)
        if any(host_of(ep) not in aliases for ep in e.endpoints):
            self._bad("spoofed", t.address)  # it listed another host's endpoint
        return kept

    def digest(self, t: Target, entries: tuple[DigestEntry, ...], now_ns: int,
               base_ns: int | None, share: int) -> bool:
        """A full digest: its slots written, up to ``share`` rows (``t``'s fair share of
        the remote table, ``Following.share``), in its order (live ones first: the
        responder's), every other row of ``t``'s freed.  The slots not stored are
        counted in ``t``'s capped word, where readers learn that a worker of ``t`` with
        no row is unknown here, not gone.  Returns whether to ask for the whole digest
        again at the next ping: slots within the share found no free row (another host
        holds more than its share until its next digest), or rows past the share wait
        to be given back (``SETTLE_NS``).

        The word and the rows are separate words, so the word leads and trails the rows
        it speaks for by ``SETTLE_NS``, never by an order of stores: it is set at least
        that long before a row is given back for the share, and cleared at least that
        long after the last row it counted was stored (``settle``).  Readers read the
        word both before and after the remote rows (``remotereads.RemoteReads.peers``),
        so one that finds a row missing for either reason reads the word set, however
        long its read takes and in whatever order two stores reach its core."""
        share = max(0, share)
        over = max(0, len(entries) - share)
        if over and not t.capped_since_ns:
            t.capped_since_ns = now_ns
            self._set_capped(t, max(over, t.capped))  # before any row is given back
        if over and now_ns - t.capped_since_ns < SETTLE_NS:
            # the word is too new: what it holds past its share, it keeps for now
            kept = entries[:share] + tuple(e for e in entries[share:] if e.key in t.remotes)
        else:
            kept = entries[:share]
        stored = self._store(t, kept, now_ns, base_ns)
        missed, changed = stored.missed, stored.changed
        # past its share, whether or not given back yet: the word stays set meanwhile
        capped = max(len(entries) - len(kept) + missed, over)
        if capped:
            self._uncapping.pop(t.address, None)
            if not t.capped_since_ns:
                t.capped_since_ns = now_ns
            if capped != t.capped:
                self._set_capped(t, capped)
                changed = True
            self.w.count("remote_capped", capped)
            self._warn(f"capped {t.address}", "pinger: %s lists %d workers; %d are not stored "
                       "here (its share of this board's remote table is %d of %d rows), and "
                       "read unknown: create the board with more remote_slots",
                       t.address, len(entries), capped, share, self.b.sizes.nremote)
        elif t.capped and t.address not in self._uncapping:
            self._uncapping[t.address] = (t, now_ns + SETTLE_NS)  # the word trails the rows
        if changed:
            self.w.changed()
        return missed > 0 or len(kept) > share

    def _store(self, t: Target, kept: tuple[DigestEntry, ...], now_ns: int,
               base_ns: int | None) -> Stored:
        """``kept``'s rows written for ``t``, every other row of ``t``'s freed first (the
        rows it gives back make room for its own)."""
        seen = {e.key for e in kept}
        changed = False
        for key in list(t.remotes):
            if key not in seen:
                self.rows.free_remote(t.remotes.pop(key).row)
                changed = True
        missed = 0
        aliases = self._alias_hosts(t)  # once per digest: O(followed hosts)
        for e in kept:  # at most MAX_DIGEST_ENTRIES (decode refuses more)
            e = self.own(t, e, aliases)
            held = t.remotes.get(e.key)
            # The status code this row held before: read it before put_remote rewrites
            # the word, or a status-only change (ALIVE -> SUSPECT) would compare equal
            # to itself and never bump the change counter that readers rely on.
            before = row_code(int(self.bw.remote_table[held.row]["status"])) if held else None
            got = self.rows.put_remote(t.row, t.gen, held, e, now_ns, beat_ns(e, base_ns))
            if got is None:
                missed += 1
                continue
            if held is None or got.incarnation != held.incarnation or got.gen != held.gen \
                    or before != e.status:
                changed = True
            t.remotes[e.key] = got
        return Stored(missed, changed)

    def _set_capped(self, t: Target, count: int) -> None:
        t.capped = count
        self.rows.peer_capped(t.row, t.gen, count)

    def settle(self, now_ns: int, targets: Mapping[str, Target]) -> None:
        """Clear the capped word of hosts all of whose slots have been stored for
        ``SETTLE_NS`` (see ``digest``); the network half calls this every tick with the
        hosts it follows (one no longer followed has no row to clear)."""
        if not self._uncapping:
            return
        for address, (t, due_ns) in list(self._uncapping.items()):
            if targets.get(address) is not t:
                del self._uncapping[address]
            elif now_ns >= due_ns:
                del self._uncapping[address]
                t.capped_since_ns = 0
                self._set_capped(t, 0)
                self.w.changed()

    def push(self, t: Target, entries: tuple[DigestEntry, ...], now_ns: int) -> PushOutcome:
        """A push's entries: deaths, leaves and restarts applied.  Never makes anything
        ALIVE that was not, never creates a row: a flood of pushes cannot fill the
        remote table."""
        changed = unlisted = ask = False
        for e in entries:
            held = t.remotes.get(e.key)
            if held is None:
                unlisted = True
            elif e.incarnation > held.incarnation:
                got = self.rows.put_remote(t.row, t.gen, held, self.own(t, e), now_ns,
                                           beat_ns(e, now_ns))
                if got is not None:
                    t.remotes[e.key] = got
                    changed = True
            elif e.incarnation == held.incarnation and e.status in _DEAD_OR_LEFT:
                self.rows.remote_status(held, e.status, now_ns, beat_ns(e, now_ns))
                changed = True
            else:
                ask = True
        if changed:
            self.w.changed()
        return PushOutcome(changed=changed, unlisted=unlisted, ask=ask)
