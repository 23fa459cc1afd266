"""The local digest a new holder of the agent role answers with."""

from __future__ import annotations

import os

import shmhb
from shmhb.digest import LocalDigest
from shmhb.protocol import Ack, Identity, decode, encode_ack_raw


def test_a_new_digest_lists_the_live_slots_before_its_first_flush(board: shmhb.Board) -> None:
    # A standby taking the role over answers pings before its first flush; a body built
    # empty read to every watcher as "all of this host's workers are gone".
    hbs = [board.register(f"rank-{i}", endpoints=(f"127.0.0.1:{7000 + i}",), agent=False)
           for i in range(3)]
    try:
        for hb in hbs:
            hb.beat()
        d = LocalDigest(board)
        frame = encode_ack_raw(1, Identity(os.urandom(16), 9), "127.0.0.1:1", d.gen, d.body, None)
        ack = decode(frame)
        assert isinstance(ack, Ack) and ack.entries is not None
        got = {e.key: e.incarnation for e in ack.entries}
        assert got == {hb.key: hb.incarnation for hb in hbs}
        assert d.rebuild() == []  # nothing new for the first flush to push
    finally:
        for hb in hbs:
            hb.close()
