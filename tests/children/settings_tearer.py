"""``BOARD LISTEN``: the first steps of storing the board's settings (checksum zeroed,
generation bumped, LISTEN written) under the registry lock, then killed: torn
settings."""

import os, signal, sys
import shmhb
from shmhb.board.core import board_words
b = shmhb.Board.attach(sys.argv[1])
w = board_words(b)
with w.registry():                  # store_config's first steps, then killed
    h = w.header
    h["cfg_checksum"] = 0
    h["cfg_gen"] = int(h["cfg_gen"]) + 1
    h["cfg_listen"] = sys.argv[2].encode()
    os.kill(os.getpid(), signal.SIGKILL)
