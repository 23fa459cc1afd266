"""``BOARD``: the first steps of storing the board's settings under the registry lock,
then killed: torn settings (listen address ``127.0.0.99:1``)."""

import os, signal, sys
import shmhb
from shmhb.board.core import board_words
b = shmhb.Board.attach(sys.argv[1])
w = board_words(b)
with w.registry():
    h = w.header
    h["cfg_checksum"] = 0
    h["cfg_gen"] = int(h["cfg_gen"]) + 1
    h["cfg_listen"] = b"127.0.0.99:1"
    os.kill(os.getpid(), signal.SIGKILL)
