"""``SECONDS``: spins a CPU for SECONDS."""

import sys, time
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    pass
