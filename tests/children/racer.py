"""``BOARD KEY,KEY,...``: on the first stdin line registers each key, prints a JSON
list of ``[key, index, incarnation]`` (``[key, -1, 0]`` where the key was in use),
and holds them until the next line."""

import json, sys
import shmhb
b = shmhb.Board.attach(sys.argv[1])
sys.stdin.readline()  # all start together
got, hbs = [], []
for key in sys.argv[2].split(","):
    try:
        hb = b.register(key, agent=False)
        hbs.append(hb)
        got.append([key, hb.index, hb.incarnation])
    except shmhb.KeyInUse:
        got.append([key, -1, 0])
print(json.dumps(got), flush=True)
sys.stdin.readline()
