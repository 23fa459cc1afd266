"""``BOARD``: holds the legacy agent lock byte (what a holder of an earlier version
holds), prints ``held``, and keeps it until a line on stdin."""

import sys
import shmhb
from shmhb.board import locks
from shmhb.board.layout import LOCK_AGENT
b = shmhb.Board.attach(sys.argv[1])
fd = b.new_fd()
assert locks.try_lock(fd, LOCK_AGENT)  # what a holder of an earlier version holds
print("held", flush=True)
sys.stdin.readline()
