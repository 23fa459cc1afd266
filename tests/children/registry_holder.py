"""``BOARD``: takes the registry lock, prints ``held``, stops itself (SIGSTOP) while
holding it, and closes the board once continued."""

import os, signal, sys
import shmhb
from shmhb.board.core import board_words
b = shmhb.Board.attach(sys.argv[1])
with board_words(b).registry():
    print("held", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)  # stopped while it holds the registry lock
b.close()
