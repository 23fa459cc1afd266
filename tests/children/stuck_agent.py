"""``BOARD FLAG``: an agent (local half) whose loop blocks for good once the file FLAG
exists; prints ``ready`` once it holds the role, ``deposed`` once its watchdog gave
the role up."""

import os, signal, sys, threading
import shmhb
from shmhb.agent import localwatch
from shmhb.agent.role import Agent
name, flag = sys.argv[1], sys.argv[2]
orig = localwatch.LocalWatch.tick
def tick(self, now_ns, late_ns):
    if os.path.exists(flag):
        threading.Event().wait()  # a call that blocks for good (a hung /proc read)
    return orig(self, now_ns, late_ns)
localwatch.LocalWatch.tick = tick
a = Agent(name, config=shmhb.AgentConfig(tick_s=0.02, watchdog_s=1.0), network=False).start()
assert a.holding.wait(5)
print("ready", flush=True)
a.deposed.wait()
print("deposed", flush=True)
signal.pause()
