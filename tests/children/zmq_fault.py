"""``shmhb`` ARGS...: the command, with the network half's first tick raising an
unexpected ZMQError (EPROTO)."""

import errno, sys
import zmq
from shmhb.net import pinger
orig = pinger.NetworkHalf.tick
fired = []
def tick(self, now_ns, late_ns):
    if not fired:
        fired.append(1)
        raise zmq.ZMQError(errno.EPROTO)
    return orig(self, now_ns, late_ns)
pinger.NetworkHalf.tick = tick
from shmhb.cli.main import main
sys.exit(main(sys.argv[1:]))
