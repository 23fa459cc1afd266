"""The agent's loop, one step at a time: poll the components' fds and sockets, hand
what is ready to its owner (deaths first), flush, and tick when the tick is due.

``Agent`` (``shmhb.agent.role``) runs ``step()`` until it is stopped; a test drives the very
same code with ``step(0)`` while it advances a ``FakeClock``.  Every time the loop
acts on is read from the injected clock, never from the wall: in a test, fake time
passes only when the test says so.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import zmq

from .writer import AgentWriter
from ..clock import Clock

__all__ = ["AgentLoop", "Component", "NetComponent"]

#: lateness is recorded in the header as the worst of each window this long
_WINDOW_NS = 1_000_000_000


class Component(Protocol):
    """A part of the agent's loop: sockets or fds to poll, and a periodic tick.
    ``pollables_gen`` moves whenever ``pollables()`` would return another set."""

    @property
    def pollables_gen(self) -> int: ...

    def pollables(self) -> list[zmq.Socket | int]: ...
    def on_ready(self, what: zmq.Socket | int, now_ns: int) -> None: ...
    def tick(self, now_ns: int, late_ns: int) -> None: ...
    def flush(self, now_ns: int) -> None:
        """Act at once on what the last readiness events changed."""
    def close(self) -> None: ...


class NetComponent(Component, Protocol):
    """The network half's component (``netsup.NetSupervisor``): it also takes the
    errors the loop's poll meets on its sockets."""

    def failed(self, e: BaseException) -> None: ...
    def leave(self) -> None: ...


def _no_check() -> None:
    return None


class AgentLoop:
    """The loop of one holder of the agent role over the local watch ``local`` and,
    optionally, the network half ``net``.

    ``check`` is called before the loop writes anything (the start of a step, after the
    poll, before the tick): the agent's watchdog raises there when it gave the role up
    while the loop was stuck, so a stuck loop never writes the next holder's words.
    """

    def __init__(self, writer: AgentWriter, local: Component, clock: Clock, tick_ns: int,
                 *, net: NetComponent | None = None,
                 check: Callable[[], None] = _no_check) -> None:
        if tick_ns <= 0:
            raise ValueError("tick_ns must be positive")
        self.w = writer
        self.local = local
        self.net = net
        self.comps: list[Component] = [local] if net is None else [local, net]
        self.clock = clock
        self.tick_ns = tick_ns
        self._check = check
        self._poller = zmq.Poller()
        self._registered: dict[object, Component] = {}
        self._seen_gen = -1
        self.next_tick_ns = clock.monotonic_ns()  # the first step ticks at once
        self._worst_late = 0
        self._window_end = self.next_tick_ns + _WINDOW_NS
        self.steps = 0
        self.ticks = 0
        self._closed = False

    def _sync(self) -> None:
        """Poll exactly the components' current fds and sockets.  Costs one sum per step
        while the set is unchanged."""
        gen = sum(c.pollables_gen for c in self.comps)
        if gen == self._seen_gen:
            return
        self._seen_gen = gen
        want = {p: c for c in self.comps for p in c.pollables()}
        for p in list(self._registered):
            if p not in want:
                self._poller.unregister(p)
                del self._registered[p]
        for p, c in want.items():
            if p not in self._registered:
                self._poller.register(p, zmq.POLLIN)
                self._registered[p] = c

    def timeout_ms(self) -> int:
        """Milliseconds until the next tick is due, rounded up: pyzmq truncates, and a
        timeout that falls short of the tick makes the loop spin until it comes."""
        return max(0, -(-(self.next_tick_ns - self.clock.monotonic_ns()) // 1_000_000))

    def step(self, timeout_ms: int | None = None) -> bool:
        """One pass: poll for at most ``timeout_ms`` (None: until the next tick is due),
        handle what is ready, and tick if the tick is due.  Returns whether it ticked."""
        now = self.clock.monotonic_ns
        self.steps += 1
        self._check()
        self._sync()
        if timeout_ms is None:
            timeout_ms = self.timeout_ms()
        try:
            if self._registered:
                events = self._poller.poll(timeout_ms)
            else:
                # pyzmq returns at once from a poll of nothing (no worker watched
                # through a pidfd, no host followed): without this wait the agent's
                # loop spun a whole core until the next tick
                # (at most a tick: a clock of another kind may be driving it)
                time.sleep(min(timeout_ms, -(-self.tick_ns // 1_000_000)) / 1000)
                events = []
        except zmq.ZMQError as e:
            # Only the network half's sockets can make a poll fail: contain it there;
            # the local watch goes on with the next step.
            if self.net is None:
                raise
            self.net.failed(e)
            self._seen_gen = -1
            return False
        self._check()
        # Deaths first: a pidfd's notice is handled before any network frame, and the
        # network half's work per wake-up is bounded by time (its drain budget), so a
        # flood of frames delays the record of a death by at most that budget.
        local_events = False
        registered = self._registered
        for what, _ev in events:
            if registered.get(what) is self.local:
                self.local.on_ready(what, now())
                local_events = True
        for what, _ev in events:
            owner = registered.get(what)
            if owner is not None and owner is not self.local:
                owner.on_ready(what, now())
        if local_events:
            # Deaths seen now are pushed now (after the local watch wrote them, so the
            # digest the push is built from holds them), all of this poll's in one batch.
            t = now()
            for c in self.comps:
                c.flush(t)
        t = now()
        if t < self.next_tick_ns:
            return False
        self._tick(t)
        return True

    def _tick(self, t: int) -> None:
        late = t - self.next_tick_ns
        self._worst_late = max(self._worst_late, late)
        if late > 4 * self.tick_ns:
            self.w.count("loop_late")
        self._check()
        self.w.alive(t)
        for c in self.comps:
            self._check()  # a tick writes much: the role may have moved on meanwhile
            c.tick(t, late)
        self.ticks += 1
        # On time (or a little late): keep the phase.  Later than a whole tick: start
        # again from now, rather than tick in a burst to catch up.
        self.next_tick_ns = self.next_tick_ns + self.tick_ns if late < self.tick_ns else t + self.tick_ns
        if t >= self._window_end:
            self.w.lateness(self._worst_late // 1000)
            self._worst_late, self._window_end = 0, t + _WINDOW_NS

    def close(self, *, leaving: bool = False) -> None:
        """Close every component, the local watch first.  ``leaving``: a graceful stop,
        so the network half says goodbye first (``NetworkHalf.leave``)."""
        if self._closed:
            return
        self._closed = True
        if leaving and self.net is not None:
            self.net.leave()
        for c in self.comps:
            c.close()
