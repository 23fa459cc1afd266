"""``BOARD``: beats ``torn`` as fast as it can with a clock whose every value carries
its own check (so a reader can tell a torn word); prints ``ready INC INDEX NATIVE``."""

import sys, shmhb
class PatternClock:
    # ts units k carry their own check: bits 20..38 repeat bits 0..18, so a value
    # stitched from two different stores fails the check
    def __init__(self): self.k = 0
    def monotonic_ns(self):
        self.k = (self.k + 0x9E3779B1) & 0x7FFFF
        return (self.k | (self.k << 20)) << 20
b = shmhb.Board.attach(sys.argv[1], clock=PatternClock())
hb = b.register("torn", agent=False)
print("ready", hb.incarnation, hb.index, shmhb.native, flush=True)
beat = hb.beat
while True:
    for _ in range(10000):
        beat()
