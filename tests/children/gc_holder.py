"""``BOARD HOW``: keeps a board in use the way HOW says, prints ``ready`` and sleeps:
``attach`` (attached, no lock), ``mmap-only`` (mapped, its descriptor closed: only
/proc/PID/maps shows it), ``fd-only`` (open, not mapped)."""

import mmap, os, sys, time, posix_ipc, shmhb
how = sys.argv[2]
if how == "attach":          # a reader: the board attached, no lock taken
    b = shmhb.Board.attach(sys.argv[1])
elif how == "mmap-only":     # mapped, descriptor closed: only /proc/PID/maps shows it
    s = posix_ipc.SharedMemory("/" + sys.argv[1])
    m = mmap.mmap(s.fd, os.fstat(s.fd).st_size)
    os.close(s.fd)
elif how == "fd-only":       # open, not mapped
    s = posix_ipc.SharedMemory("/" + sys.argv[1])
print("ready", flush=True)
time.sleep(600)
