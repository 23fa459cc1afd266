"""``forget_after_s`` while the agent is out of file descriptors.

A real ``shmhb pinger`` under a low RLIMIT_NOFILE whose fds a connection flood keeps
used up (what it does at a systemd unit's 1024), and a worker killed so that its slot is
due to be forgotten: the agent must keep running, say so at a bounded rate, retry the
forget later, and still record a new death meanwhile."""

from __future__ import annotations

import dataclasses
import sys


from shmhb import Status

from ..conftest import Procs, wait_until
from ..hosts import FAST, FLOODER, KILL_BOUND_S, Cluster, open_fds

LIMIT = 96


def test_forget_while_out_of_fds_neither_stops_the_agent_nor_is_given_up(
        cluster: Cluster, procs: Procs) -> None:
    a = cluster.host(policy=dataclasses.replace(FAST, forget_after_s=0.5), start=False)
    p = cluster.spawn(["prlimit", f"--nofile={LIMIT}:{LIMIT}", *a.pinger_cmd()],
                      f"{a.name}-limited")
    a.wait_pinger(p)
    victim = a.worker("victim")
    flooder = cluster.spawn_text([sys.executable, FLOODER, a.ip, str(a.port),
                                  str(LIMIT + 50)])
    assert flooder.stdout is not None and flooder.stdin is not None
    assert flooder.stdout.readline().startswith("ready")
    try:
        wait_until(lambda: open_fds(p.pid) >= LIMIT - 1, timeout_s=20, poll_s=0.005,
                   what="the agent's fds used up")
        victim.kill()
        victim.wait()
        wait_until(lambda: a.board.status("victim") is Status.DEAD, timeout_s=KILL_BOUND_S,
                   poll_s=0.001, what="victim DEAD within 1 s")
        # past forget_after_s, several times over: each forget needs an fd it cannot have
        wait_until(lambda: p.poll() is not None or (s := a.board.slot("victim")) is None
                   or s.age_s > 3.0, timeout_s=20, what="forget_after_s passed")
        assert p.poll() is None, "the pinger stopped:\n" + cluster.log_tail(p)
        assert a.board.agent().pid == p.pid and a.board.agent().status is Status.ALIVE
        second = a.worker("second")
        second.kill()
        wait_until(lambda: a.board.status("second") is Status.DEAD, timeout_s=KILL_BOUND_S,
                   poll_s=0.001, what="a later death recorded during the flood")
    finally:
        flooder.stdin.write("hold\nquit\n")
        flooder.stdin.flush()
    # fds back: the forget is retried, not given up
    wait_until(lambda: a.board.slot("victim") is None and a.board.slot("second") is None,
               timeout_s=30, what="the dead forgotten once fds are back")
    assert p.poll() is None
    tail = cluster.log_tail(p, 400)
    assert tail.count("could not forget") <= 3, tail  # rate-limited, not once per tick
