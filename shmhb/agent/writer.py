"""What the holder of the agent role writes into the board header: its heartbeat and
id words, the change counter, its counters, and the network half's state.

Every word here has one writer, the role holder (the role lock excludes any other);
see the ownership table in ``shmhb.board.layout``.
"""

from __future__ import annotations

import os

from ..board.handle import Board
from ..board.core import board_words
from ..board.layout import (
    ADDR_BYTES, NET_ERROR_BYTES, STAT_NAMES, header_index, net_checksum, pack_agent_id,
    NetStateWord, pack_hb, pack_net_gen, pack_net_state, ts_units,
)
from ..net.state import NetShown

_STAT = {n: i for i, n in enumerate(STAT_NAMES)}


class AgentWriter:
    """What the role holder may write into the header: its words and its counters."""

    def __init__(self, board: Board, term: int) -> None:
        self.board = board
        self.bw = board_words(board)
        self.term = term
        q = board_words(board).words
        self._q = q
        self._hb_i = header_index("agent_hb")
        self._gen_i = header_index("agent_gen")
        self._late_i = header_index("agent_lateness_us")
        self._stats0 = header_index("stats")
        self._net_i = header_index("net_state")
        q[header_index("agent_id")] = pack_agent_id(term, os.getpid())

    def alive(self, now_ns: int) -> None:
        self._q[self._hb_i] = pack_hb(self.term, ts_units(now_ns))

    def left(self, now_ns: int) -> None:
        self._q[self._hb_i] = pack_hb(self.term, ts_units(now_ns), left=True)

    def changed(self) -> None:
        """Bump the change counter readers use to skip work when nothing moved."""
        self._q[self._gen_i] = self._q[self._gen_i] + 1

    def count(self, stat: str, n: int = 1) -> None:
        i = self._stats0 + _STAT[stat]
        self._q[i] = self._q[i] + n

    def lateness(self, late_us: int) -> None:
        self._q[self._late_i] = late_us

    def network(self, shown: NetShown, cfg_gen: int, listen: str) -> None:
        """Record the network half's state, for settings generation ``cfg_gen``, listening
        on ``listen`` ("" if not).  Only the role holder writes these words.
        Order: the details' checksum is cleared, the details written, then the state
        word, then the checksum over all of them.  A reader judges by the state word
        alone (one aligned word) and shows details only when the checksum matches, so
        it never needs an order between words: a mismatch just hides the details."""
        h = self.bw.header
        s = shown
        word = pack_net_state(NetStateWord(
            term=self.term, state=int(s.state), auth=int(s.auth), listening=s.listening,
            reason=int(s.reason), errno=s.err, skipped=s.skipped))
        gen_word = pack_net_gen(self.term, cfg_gen)
        lb = listen.encode()[: ADDR_BYTES - 1]
        eb = s.error.encode()[: NET_ERROR_BYTES - 1]
        h["net_ck"] = 0
        h["net_gen"] = gen_word
        h["net_listen"] = lb
        h["net_error"] = eb
        self._q[self._net_i] = word
        h["net_ck"] = net_checksum(word, gen_word, lb, eb)
