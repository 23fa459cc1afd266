"""``BOARD KEY``: takes the lock of KEY's registration bucket, prints ``held`` and
stops itself (SIGSTOP)."""

import os, signal, sys
import shmhb
from shmhb.board.core import board_words
from shmhb.board import locks
from shmhb.board.registration import key_bucket
b = shmhb.Board.attach(sys.argv[1])
fd = board_words(b).new_fd()
assert locks.try_lock(fd, key_bucket(sys.argv[2].encode()))
print("held", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
