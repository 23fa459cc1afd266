"""``BOARD ADDRESS``: watches ADDRESS, prints ``watching``, and exits on a line on
stdin."""

import shmhb, sys
b = shmhb.Board.attach(sys.argv[1])
b.watch(sys.argv[2])
print("watching", flush=True)
sys.stdin.readline()
