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

from collections.abc import Callable
from dataclasses import dataclass

from ..board.handle import Board
from ..board.core import board_words
from ..board.layout import row_code
from ..status import Status
from .protocol import U32_MAX, DigestEntry
from .rowwriter import RowWriter
from .state import AgentWords
from .following import Target, host_of, own_endpoints

_DEAD_OR_LEFT = (Status.DEAD.code, Status.LEFT.code)


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
        responder's), every other row of ``t``'s freed.  The slots past the share are
        not stored: counted in ``t``'s capped word, where readers learn that a worker of
        ``t`` with no row is unknown here, not gone.  The word is written before any of
        ``t``'s rows is given back, so a reader never sees a row gone for a slot its
        host still lists while the word says all are stored.  Returns whether slots
        within the share found no free row (others hold more than theirs until their
        next digest): then ask again."""
        kept = entries[:max(0, share)]
        over = len(entries) - len(kept)
        if over:
            self.rows.peer_capped(t.row, t.gen, over)
        seen = {e.key for e in kept}
        changed = False
        for key in list(t.remotes):  # first: the rows it gives back make room for its own
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
        capped = over + missed
        self.rows.peer_capped(t.row, t.gen, capped)
        if capped != t.capped:
            changed = True
        t.capped = capped
        if capped:
            self.w.count("remote_capped", capped)
            self._warn(f"capped {t.address}", "pinger: %s lists %d workers; %d are not stored "
                       "here (its share of this board's remote table is %d of %d rows), and "
                       "read unknown: create the board with more remote_slots",
                       t.address, len(entries), capped, share, self.b.sizes.nremote)
        if changed:
            self.w.changed()
        return missed > 0

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
