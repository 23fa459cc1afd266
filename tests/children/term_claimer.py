"""``BOARD``: claims the agent role's term on command, to race others.  Prints
``ready``; on ``go TERM FLAG`` prints ``armed``, spins until FLAG exists, claims TERM
and prints 1 or 0; on ``release TERM 0`` lets the term's byte go (``released``)."""

import os, sys
import shmhb
from shmhb.board.core import board_words
from shmhb.agent import election
from shmhb.board import locks
from shmhb.board.layout import term_byte
b = shmhb.Board.attach(sys.argv[1])
fd = board_words(b).new_fd()
print("ready", flush=True)
for line in sys.stdin:
    cmd, t, flag = line.split()
    if cmd == "go":  # armed: spin until the flag appears, then all claim at once
        print("armed", flush=True)
        while not os.path.exists(flag):
            pass
        print(1 if election.claim(fd, board_words(b).words, int(t)) else 0, flush=True)
    else:  # let the term's byte go, as a holder standing down does
        locks.unlock(fd, term_byte(int(t)))
        print("released", flush=True)
