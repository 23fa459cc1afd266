"""``BOARD``: registers ``ns-worker``; prints ``registered``, or ``refused: WHY`` where
the board refuses it (a process in another time namespace)."""

import shmhb, sys
b = shmhb.Board.attach(sys.argv[1])
try:
    b.register('ns-worker', agent=False)
except shmhb.InvalidConfig as e:
    print('refused:', e)
else:
    print('registered')
