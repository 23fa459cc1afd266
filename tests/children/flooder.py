"""``HOST PORT N``: a connection flood at a pinger (see its comment)"""
# Keeps up to N TCP connections open to host:port, reconnecting those the server
# drops, every other one sending half a ZMTP greeting and then nothing; on the
# first stdin line it stops reconnecting and holds what it has; on the second, exits.
import selectors, socket, sys, threading
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sel = selectors.DefaultSelector()
hold = threading.Event()
quit_ = threading.Event()
def stdin():
    sys.stdin.readline(); hold.set(); sys.stdin.readline(); quit_.set()
threading.Thread(target=stdin, daemon=True).start()
opened = [0]
def one(k):
    s = socket.socket()
    s.setblocking(False)
    try:
        s.connect((host, port))
    except BlockingIOError:
        pass
    sel.register(s, selectors.EVENT_READ | selectors.EVENT_WRITE, k)
    opened[0] += 1
for k in range(n):
    one(k)
print("ready", flush=True)
while not quit_.is_set():
    for key, ev in sel.select(0.05):
        s, k = key.fileobj, key.data
        if ev & selectors.EVENT_WRITE:
            sel.modify(s, selectors.EVENT_READ, k)
            if k % 2:
                try:
                    s.send(bytes([0xFF]) + bytes(8) + bytes([0x7F]))  # half a greeting
                except OSError:
                    pass
        elif ev & selectors.EVENT_READ:
            try:
                data = s.recv(4096)
            except OSError:
                data = b""
            if not data:  # dropped by the server: come back (unless holding)
                sel.unregister(s)
                s.close()
                if not hold.is_set():
                    one(k)
