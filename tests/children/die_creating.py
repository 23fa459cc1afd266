"""``BOARD``: creates the segment and is killed before it is READY, holding the
registry lock."""

import os, signal, sys
from shmhb.board import segment
from shmhb.board.config import Capacity
from shmhb.board.layout import Sizes
c = Capacity()
segment.Segment.create(sys.argv[1], Sizes(c.slots, c.peers, c.remote_slots, c.watches), 0o600)
os.kill(os.getpid(), signal.SIGKILL)  # before READY, holding the registry lock
