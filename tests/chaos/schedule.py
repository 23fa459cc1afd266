"""The fault schedule: a list of faults drawn from one seed, fixed before the run starts.

The schedule is a pure function of (seed, duration, hosts, workers, timing): the same
seed gives the same faults at the same offsets on every machine.  What a fault then
does depends on the state it finds (a target that is busy with an earlier fault, or a
fault this machine cannot inject, is skipped and counted as skipped), so a run is
reproducible in what it asks for, not to the millisecond in what the kernel does.

Fault kinds and what they stand for:

=====================  ==================================================================
worker_kill            SIGKILL a worker; it is started again (same key, new incarnation)
                       after ``duration_s``
worker_restart         SIGKILL a worker and start it again at once (kills may hit a
                       stopped worker: a hung worker is what gets killed and restarted)
worker_kill_early      restart a worker and SIGKILL the new process ``duration_s`` after it
                       starts: while it imports, registers, or has just registered
worker_leave           SIGTERM: the worker closes its slot (LEFT) and exits; it registers
                       again after ``duration_s``
worker_stop_short      SIGSTOP a worker for less than the board's dead-after, then SIGCONT
worker_stop_long       SIGSTOP a worker past dead-after (it is legitimately DEAD meanwhile)
pinger_kill            SIGKILL the pinger holding the agent role: the standby takes over
                       (a new standby is started at once)
pinger_term            SIGTERM the holder: a graceful hand-over to the standby
pinger_stop_short      SIGSTOP the holder below peer-dead-after (observers: SUSPECT at most)
pinger_stop_long       SIGSTOP the holder past peer-dead-after (observers: host DEAD)
host_outage            SIGKILL every pinger of a host for ``duration_s``: no agent at all
registry_stall         a process takes a host's registry lock and stops for ``duration_s``
                       (registrations go on without it, watches may fail with LockTimeout
                       meanwhile; nothing else may break)
watcher_kill           a connector process watches another host and is SIGKILLed after
                       ``duration_s`` (or when a registry_stall begins on its host): the
                       agent must reclaim its watches, once it can take the lock
garbage                ``n`` malformed frames at a pinger's ROUTER from a foreign DEALER
cpu_hog                one busy process per core for ``duration_s``
shm_full               create a board in a private mount namespace whose /dev/shm is a
                       tiny tmpfs: must fail with BoardSpaceError (root only)
partition              take the veth between the two namespaced hosts down for
                       ``duration_s`` (root with iproute2 only)
conn_flood             1100 TCP connections (half of them half a ZMTP greeting) at a
                       pinger that has 1024 file descriptors, for ``duration_s``
forged_ping            learn host X's identity from an ack, ping host Y as X with nonce
                       2^64-1 (no secret): Y must not lock X's real pings out
push_flood             the liar (a followed host) pushes 64 new keys a push, as fast as
                       it can, for ``duration_s``
relay                  the liar answers pings with another host's acks to the same nonce
spoof                  the liar lists every other host's worker endpoints ALIVE
bad_watch              a watch address libzmq refuses, written straight into the watch
                       table past the doors, for ``duration_s``
long_endpoint          a worker registers a 72-byte endpoint (a Kubernetes service name)
bad_config             a throwaway host next to the cluster whose pinger cannot run as
                       configured (port in use, secret missing or readable by others,
                       no CURVE secret key, a listen address not on this host)
big_digest             a throwaway host with 300 slots (260 dead) next to the cluster: the
                       300th worker's kill must be seen on another throwaway host
embedded_stall         a throwaway board: a daemon takes the role from a worker's embedded
                       agent; that worker SIGSTOPped, a kill is still DEAD within 1 s;
                       then the worker stopped while it holds the role: a daemon started
                       then replaces it within 10 s and the worker, resumed, stands down
registry_attach        a throwaway board: attach, ``status`` and a new worker's registration
                       do not wait for a stopped registry holder; its kill is DEAD in 1 s
torn_settings          a throwaway host: settings torn by a SIGKILL read degraded for a
                       bare standby and are healed by a pinger with options
forget_fds             a throwaway host: ``forget_after_s`` under a connection flood at 96
                       fds; the pinger keeps running and forgets once fds are back
settings_conflict      a throwaway host with a secret: a stray pinger with other flags and
                       no secret is refused (exit 2) and changes no stored setting
stopped_holder         two throwaway hosts: B's daemon holder SIGSTOPped, a worker's
                       embedded standby takes over; A must hear B again meanwhile
nat_forgery            host X's holder is SIGSTOPped for ``duration_s`` while a forger
                       connected from X's own address (bound as its source)
                       pings host Y as X with Y's current digest every 0.2 s: Y must
                       read X DEAD on time all the same
clock_step             host X's wall clock steps back an hour for every pinger started
                       there from now on: its standby is replaced by one so stepped,
                       which takes the role over 6 s later (the holder SIGKILLed);
                       peers must not drop its pings or pushes as replays
two_addresses          throwaway hosts: B listens on 0.0.0.0 and A follows it as two of
                       its addresses: both read ALIVE past a dead-after window, and B's
                       killed worker reads DEAD on A within 5 s, no ack dropped as spoofed
secret_rotation        throwaway hosts that follow each other rotate their secret host by
                       host in the documented three steps (never anything but ALIVE),
                       then one gets a secret the other lacks: UNKNOWN, never DEAD
=====================  ==================================================================
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Timing:
    """The board policy and pinger settings of a chaos run, and the stop lengths that
    stay clear of each threshold (a stop near a threshold would make the expected
    verdict a coin toss)."""

    suspect_after_s: float = 1.0
    dead_after_s: float = 3.0
    agent_stale_s: float = 1.0
    peer_suspect_after_s: float = 1.0
    peer_dead_after_s: float = 3.0
    interval_s: float = 0.2
    tick_s: float = 0.02
    beat_s: float = 0.05

    def short_stop(self, rng: random.Random) -> float:
        """Well below dead-after: the worker may read SUSPECT, never DEAD."""
        return rng.uniform(0.2, max(0.3, self.dead_after_s - 1.2))

    def long_stop(self, rng: random.Random) -> float:
        """Well past dead-after: the worker reads DEAD while stopped."""
        return rng.uniform(self.dead_after_s + 0.8, self.dead_after_s + 3.0)

    def short_pinger_stop(self, rng: random.Random) -> float:
        return rng.uniform(0.2, max(0.3, self.peer_dead_after_s - 1.5))

    def long_pinger_stop(self, rng: random.Random) -> float:
        return rng.uniform(self.peer_dead_after_s + 1.0, self.peer_dead_after_s + 3.0)


#: relative frequencies
WEIGHTS: dict[str, float] = {
    "worker_kill": 10,
    "worker_restart": 8,
    "worker_kill_early": 3,
    "worker_leave": 6,
    "worker_stop_short": 8,
    "worker_stop_long": 5,
    "pinger_kill": 5,
    "pinger_term": 2,
    "pinger_stop_short": 4,
    "pinger_stop_long": 2.5,
    "host_outage": 2,
    "registry_stall": 2,
    "watcher_kill": 2,
    "garbage": 4,
    "cpu_hog": 1.5,
    "shm_full": 1,
    "partition": 2,
    "conn_flood": 1.5,
    "forged_ping": 2,
    "push_flood": 2,
    "relay": 1.5,
    "spoof": 2,
    "bad_watch": 1.5,
    "long_endpoint": 1.5,
    "bad_config": 1.5,
    "big_digest": 0.5,
    # host-side faults (localfaults.py), each on a throwaway board
    "embedded_stall": 1,
    "registry_attach": 1,
    "torn_settings": 1,
    "forget_fds": 0.7,
    "settings_conflict": 0.7,
    "stopped_holder": 0.7,
    "nat_forgery": 1.5,
    "clock_step": 1,
    "two_addresses": 0.5,
    "secret_rotation": 0.5,
}
KINDS = tuple(WEIGHTS)
#: faults that need the namespaced pair of hosts, or root
NEEDS_NETNS = frozenset({"partition"})
NEEDS_ROOT = frozenset({"shm_full", "partition"})


@dataclass(frozen=True)
class Fault:
    """One scheduled fault.  ``at_s``: offset from the start of the chaos phase.
    ``host``/``worker``: indices into the run's hosts and a host's workers (the harness
    maps them to live processes when the fault fires).  ``n``: frames for ``garbage``.
    ``salt``: per-fault randomness (garbage bytes) derived from the seed."""

    at_s: float
    kind: str
    host: int
    worker: int
    duration_s: float
    n: int = 0
    salt: int = 0

    def describe(self) -> str:
        what = {"worker": f"h{self.host}/w{self.worker}", "host": f"h{self.host}"}
        if self.kind.startswith("worker_"):
            tgt = what["worker"]
        elif self.kind in ("cpu_hog", "shm_full", "partition"):
            tgt = "-"
        else:
            tgt = what["host"]
        extra = f" n={self.n}" if self.kind == "garbage" else (
            f" {self.duration_s:.2f}s" if self.duration_s else "")
        return f"{self.kind} {tgt}{extra}"


def hostile_duration(kind: str, rng: random.Random) -> float | None:
    """Durations of the hostile-input kinds (``hostile.py``); None for the others."""
    lo_hi = {"conn_flood": (1.0, 5.0), "push_flood": (0.5, 3.0), "relay": (1.0, 4.0),
             "spoof": (1.0, 6.0), "bad_watch": (1.0, 6.0), "long_endpoint": (0.5, 4.0),
             "forged_ping": None, "bad_config": None, "big_digest": None,
             "nat_forgery": (4.0, 8.0), "clock_step": None, "two_addresses": None,
             "secret_rotation": None}
    if kind not in lo_hi:
        return None
    r = lo_hi[kind]
    return 0.0 if r is None else rng.uniform(*r)


def make_schedule(seed: int, duration_s: float, n_hosts: int, n_workers: int,
                  timing: Timing = Timing(), *, mean_gap_s: float = 1.0) -> list[Fault]:
    """Every fault of a run of ``duration_s`` seconds, in order.  Host indices cover
    all ``n_hosts`` hosts (the namespaced pair, if the run has it, is the last two)."""
    rng = random.Random(seed)
    kinds = list(WEIGHTS)
    weights = [WEIGHTS[k] for k in kinds]
    out: list[Fault] = []
    t = rng.uniform(0.5, 1.5)
    while t < duration_s:
        kind = rng.choices(kinds, weights)[0]
        host = rng.randrange(n_hosts)
        worker = rng.randrange(n_workers)
        n = 0
        if kind == "worker_kill":
            d = rng.uniform(0.5, 4.0)  # down time before the restart
        elif kind == "worker_kill_early":
            d = rng.uniform(0.0, 1.0)
        elif kind == "worker_leave":
            d = rng.uniform(0.5, 4.0)
        elif kind == "worker_stop_short":
            d = timing.short_stop(rng)
        elif kind == "worker_stop_long":
            d = timing.long_stop(rng)
        elif kind == "pinger_stop_short":
            d = timing.short_pinger_stop(rng)
        elif kind == "pinger_stop_long":
            d = timing.long_pinger_stop(rng)
        elif kind == "host_outage":
            d = rng.uniform(0.5, timing.peer_dead_after_s + 3.0)
        elif kind == "cpu_hog":
            d = rng.uniform(1.0, 4.0)
        elif kind == "partition":
            d = rng.uniform(1.0, timing.peer_dead_after_s + 3.0)
        elif kind == "watcher_kill":
            d = rng.uniform(0.2, 8.0)
        elif kind == "registry_stall":
            d = rng.uniform(1.0, 8.0)
        elif kind == "garbage":
            d = 0.0
            n = rng.randrange(20, 400)
        elif (hd := hostile_duration(kind, rng)) is not None:
            d = hd
        else:
            d = 0.0
        out.append(Fault(round(t, 3), kind, host, worker, round(d, 3), n, rng.getrandbits(32)))
        t += max(0.15, rng.expovariate(1.0 / mean_gap_s))
    return out
