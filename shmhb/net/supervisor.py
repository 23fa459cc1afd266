"""Runs the network half inside the agent loop, contains its faults, records its state.

The local death watch (pidfds, slot locks) is another component of the same loop and
never depends on this one: whatever the network half does -- cannot bind, cannot read
its secret or keys, runs out of file descriptors, meets an unexpected ZMQ error -- it is
closed (never blocking: LINGER 0, every socket closed), its peer rows read UNKNOWN (no
observer of those hosts now, invariant 5), the failure is recorded in the board header
and logged (rate-limited), and a new one is tried after a backoff (0.25 s doubling to
10 s, reset after 30 s of good running).  It never runs with weaker security than
configured: a secret that cannot be read means no network half, not one without a
secret.  No listen address configured means no network half at all ("not configured",
not degraded): an agent never pings hosts on a port nobody chose.
"""

from __future__ import annotations

import logging
from typing import Protocol

import zmq

from ..board.handle import Board
from ..board.core import board_words
from ..clock import Clock
from ..board.config import PingerConfig
from ..errors import FD_ERRNOS, InvalidConfig
from ..board.layout import header_index
from .settings import load_config
from .state import NET_OFF, Backoff, NetAuth, NetDown, NetReason, NetShown, NetState
from .pinger import NetworkHalf
from ..ratelog import RateLimitedLog
from .rowwriter import RowWriter
from .transport import Transport, TransportFactory

log = logging.getLogger(__name__)

_CFG_GEN_I = header_index("cfg_gen")
_CFG_CK_I = header_index("cfg_checksum")
#: how long the stored settings may fail their checksum before they are called torn: a
#: writer holds the registry lock for microseconds while it writes them, so a mismatch
#: that lasts this long is a writer killed (or stopped) between the checksum and the fields
TORN_AFTER_NS = 1_000_000_000
_GOOD_RUN_NS = 30 * 10**9  # running this long resets the backoff


class NetWords(Protocol):
    """The agent's header words the supervisor writes (``agent.AgentWriter``)."""

    def changed(self) -> None: ...
    def count(self, stat: str, n: int = 1) -> None: ...
    def network(self, shown: NetShown, cfg_gen: int, listen: str) -> None: ...


class NetSupervisor:
    """A component of the agent loop (``agent.Component``) wrapping one NetworkHalf at a
    time.

    ``beside``: the listen address (host:port) of a stalled holder of this board that
    this one replaces, which keeps listening there while it is stopped: the halves of
    this term listen beside it (``shmhb.net.listener``)."""

    def __init__(self, board: Board, writer: NetWords, clock: Clock, *,
                 retry_min_s: float = 0.25, retry_max_s: float = 10.0,
                 transport: TransportFactory = Transport, beside: str | None = None) -> None:
        self.b = board
        self.bw = board_words(board)
        self.transport = transport
        self._beside = beside
        self.w = writer
        self.clock = clock
        self.half: NetworkHalf | None = None
        self._base_gen = 0
        self._seen_cfg_word: tuple[int, int] | None = None  # (cfg_gen, cfg_checksum)
        self._mismatch_since_ns: int | None = None
        self._cfg_gen = 0
        self._cfg: PingerConfig | None = None  # settings to run; None: off
        self._next_try_ns = 0
        self._up_since_ns: int | None = None
        self.backoff = Backoff(retry_min_s, retry_max_s)
        self._down: tuple[NetReason, int, str] | None = None
        self._published: NetShown | None = None
        self._published_gen = -1
        self._ratelog = RateLimitedLog(log, now_ns=clock.monotonic_ns)  # per NetReason
        self.failures = 0
        self._settled = False  # settings not read yet: "starting"
        self._reserved = 0  # the highest send-counter reservation of our closed halves
        self._publish()

    # -- Component interface ----------------------------------------------------------------

    @property
    def pollables_gen(self) -> int:
        return self._base_gen + (self.half.pollables_gen if self.half is not None else 0)

    def pollables(self) -> list[zmq.Socket[bytes] | int]:
        return self.half.pollables() if self.half is not None else []

    def on_ready(self, what: zmq.Socket[bytes] | int, now_ns: int) -> None:
        if self.half is not None:
            self._guard(self.half.on_ready, what, now_ns)

    def flush(self, now_ns: int) -> None:
        if self.half is not None:
            self._guard(self.half.flush, now_ns)

    def tick(self, now_ns: int, late_ns: int) -> None:
        self._settings(now_ns)
        if self.half is None and self._cfg is not None and now_ns >= self._next_try_ns:
            self._start(now_ns)
        if self.half is not None:
            self._guard(self.half.tick, now_ns, late_ns)
            if (self._up_since_ns is not None and self.half is not None
                    and now_ns - self._up_since_ns >= _GOOD_RUN_NS):
                self.backoff.reset()
        self._publish()

    def leave(self) -> None:
        """A graceful stop of the agent: the half says goodbye (``NetworkHalf.leave``)."""
        if self.half is not None:
            self._guard(self.half.leave, self.clock.monotonic_ns())

    def close(self) -> None:
        self._stop()

    def reserved(self) -> int:
        """The highest ``net_counter`` reservation any of our halves stored (the agent
        restores it after a stale writer may have stored a lower one: shmhb.agent.election)."""
        h = self.half
        return max(self._reserved, h.counter.reserved if h is not None else 0)

    # -- failures from outside the half (the agent's poll) ----------------------------------

    def failed(self, e: BaseException) -> None:
        """An error the agent met on the half's sockets (e.g. in its poll)."""
        self._fail(*self._classify(e), self.clock.monotonic_ns())

    # -- internals ----------------------------------------------------------------------------

    def _settings(self, now_ns: int) -> None:
        self._settled = True
        # Two words, each loaded whole: a completed write moves the checksum even where
        # a torn one already moved the generation (a writer stopped, then resumed).
        word = (int(self.bw.words[_CFG_GEN_I]), int(self.bw.words[_CFG_CK_I]))
        if word == self._seen_cfg_word:
            return  # unchanged settings cost two loads per tick
        if word[0] == 0:  # never configured: no network half
            self._seen_cfg_word = word
            self._set_cfg(0, None)
            return
        try:
            got = load_config(self.b)
        except InvalidConfig as e:
            self._seen_cfg_word = word  # reported once per stored generation
            self._set_cfg(word[0], None)
            self._fail(NetReason.CONFIG, 0, f"the stored pinger settings are invalid ({e}); "
                       "run `shmhb pinger` with valid options", now_ns, retry=False)
            return
        if got is None:
            # Caught mid-write: read again next tick.  Unless it lasts: then the writer
            # died (or is stopped) half-way and nobody will finish the write.  Saying
            # "not configured" would hide a host that was meant to be followed; it is
            # degraded until a pinger with settings of its own rewrites them (a new
            # generation) or the stopped writer completes them (a new checksum).
            if self._mismatch_since_ns is None:
                self._mismatch_since_ns = now_ns
                self._settled = False  # "starting" meanwhile, never "not configured"
            elif now_ns - self._mismatch_since_ns >= TORN_AFTER_NS:
                self._seen_cfg_word = word  # reported once per torn state
                self._mismatch_since_ns = None
                if self._cfg is not None:
                    # We run settings read whole before the tear: they stay valid, and
                    # stopping a working half over a torn copy would take the host off
                    # the network for nothing.  The next holder reports the tear.
                    self._settled = True
                    log.warning("pinger: the stored settings are torn (their writer was "
                                "killed while writing them); running on those applied "
                                "before; run `shmhb pinger --listen ...` to rewrite them")
                    return
                self._set_cfg(word[0], None)
                self._fail(NetReason.CONFIG, 0, "the stored pinger settings are torn (their "
                           "writer was killed while writing them); run `shmhb pinger "
                           "--listen ...` with this host's options to write them again",
                           now_ns, retry=False)
            return
        self._mismatch_since_ns = None
        self._seen_cfg_word = word
        gen, cfg = got
        self._set_cfg(gen, cfg if cfg.listen else None)
        self._next_try_ns = now_ns
        self.backoff.reset()

    def _set_cfg(self, gen: int, cfg: PingerConfig | None) -> None:
        self._stop()
        self._down = None
        self._cfg_gen, self._cfg = gen, cfg
        if cfg is None:
            RowWriter(self.b).forget_peer_verdicts()  # no observer of remote hosts now
            self.w.changed()

    def _start(self, now_ns: int) -> None:
        assert self._cfg is not None
        try:
            self.half = NetworkHalf(self.b, self.w, self.clock, self._cfg_gen, self._cfg,
                                    transport=self._transport)
        except BaseException as e:
            if not isinstance(e, Exception):
                raise
            self._fail(*self._classify(e), now_ns)
            return
        self._base_gen += 1
        self._down = None
        self._up_since_ns = now_ns
        if self.failures:
            log.info("pinger: network half running again (listening on %s)", self._cfg.listen)

    def _transport(self, curve_keys: str | None) -> Transport:
        t = self.transport(curve_keys)
        if self._beside is not None:
            t.listen_beside(self._beside)
        return t

    def _guard(self, fn: object, *args: object) -> None:
        try:
            fn(*args)  # type: ignore[operator]
        except Exception as e:
            self._fail(*self._classify(e), self.clock.monotonic_ns())

    def _classify(self, e: BaseException) -> tuple[NetReason, int, str]:
        if isinstance(e, NetDown):
            return e.reason, e.err, str(e)
        err = getattr(e, "errno", None) or 0
        if err in FD_ERRNOS:
            return NetReason.FDS, err, f"out of file descriptors: {e}"
        log.error("pinger: the network half stopped on an unexpected error; it is "
                  "restarted, the local watch goes on", exc_info=e)
        return NetReason.ERROR, err if isinstance(err, int) else 0, f"{type(e).__name__}: {e}"

    def _fail(self, reason: NetReason, err: int, msg: str, now_ns: int, *,
              retry: bool = True) -> None:
        self._stop()
        self.failures += 1
        self.w.count("net_failures")
        self._down = (reason, err, msg)
        delay = self.backoff.next_delay_ns()
        if retry:
            self._next_try_ns = now_ns + delay
        else:
            self._next_try_ns = 1 << 62  # until the settings change
        RowWriter(self.b).forget_peer_verdicts()  # nobody observes those hosts now
        self.w.changed()
        self._ratelog.error(reason.name, "pinger: network half degraded (%s): %s; %s",
                            reason.label, msg, f"retrying in {delay / 1e9:.2f} s" if retry
                            else "waiting for new settings")
        self._publish()

    def _stop(self) -> None:
        h, self.half = self.half, None
        self._up_since_ns = None
        if h is not None:
            self._reserved = max(self._reserved, h.counter.reserved)
            self._base_gen += 1 + h.pollables_gen
            h.close()

    def _publish(self) -> None:
        cfg = self._cfg
        auth = (NetAuth.HMAC if cfg and cfg.secret_file else
                NetAuth.CURVE if cfg and cfg.curve_keys else NetAuth.NONE)
        listen = cfg.listen if cfg and cfg.listen else ""
        if self._down is not None:
            reason, err, error = self._down
            s = NetShown(NetState.DEGRADED, auth, False, reason, err, 0, error)
        elif self.half is not None and self.half.skipped:
            reasons = sorted({r for r, _ in self.half.skipped.values()})
            addr, (_r, why) = next(iter(sorted(self.half.skipped.items())))
            s = NetShown(NetState.DEGRADED, auth, True, reasons[0], 0, len(self.half.skipped),
                         f"{addr}: {why}")
        elif self.half is not None:
            s = NetShown(NetState.LISTENING, auth, True, NetReason.NONE, 0, 0, "")
        elif cfg is None and self._settled:
            s = NET_OFF
        else:
            s = NetShown(NetState.STARTING, auth, False, NetReason.NONE, 0, 0, "")
        if s == self._published and self._cfg_gen == self._published_gen:
            return
        if self._published is not None and s.state is not self._published.state:
            log.info("pinger: network half %s -> %s", self._published.state.label, s.state.label)
        self._published, self._published_gen = s, self._cfg_gen
        self.w.network(s, self._cfg_gen, listen if s.listening else "")
