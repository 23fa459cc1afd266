"""``BOARD``: becomes user and group 65534 (nobody) and attaches BOARD; prints
``refused WHY`` where the board refuses it with a BoardPermissionError (which must be
a PermissionError)."""

import os, shmhb, sys
os.setgid(65534)
os.setuid(65534)
try:
    shmhb.Board.attach(sys.argv[1])
except shmhb.BoardPermissionError as e:
    assert isinstance(e, PermissionError)
    print("refused", e)
