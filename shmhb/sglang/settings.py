"""The wrapper's settings, read from the environment of each SGLang process (SGLang has no
place for a backend's own options: its plugins are called with no argument), validated at
the door; and the board key a rank registers under."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass

from ..board.address import check_endpoint
from ..board.layout import KEY_BYTES
from ..kv.grants import check_lease
from ..errors import InvalidAddress, InvalidConfig

#: the variable that turns the wrapper on (SGLang loads every installed plugin)
ENABLE = "SHMHB_SGLANG"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")
#: rank keys start with this (``shmhb status`` groups them by it)
KEY_PREFIX = "sglang/"


@dataclass(frozen=True)
class SglangSettings:
    """``board``: the host's board (None: ``$SHMHB_BOARD`` or "shmhb").
    ``act_on_suspect``: treat SUSPECT as a drop (off: a flap fails no room).
    ``grant_timeout_s``: how long a prefill waits for its decode's go-ahead before it
    gives the write up.  ``grant_lease_s``: what a decode's go-ahead promises (read
    from the decode's setting; ``shmhb.sglang.lease``): the prefill writes a granted
    room's chunks only within it (counted from its ask), and the decode fails a granted
    room no earlier than that after granting it; over twice ``grant_timeout_s``, so an
    answer read at the end of the wait leaves time to write.  ``beat_interval_s``: the
    rank's heartbeat.  ``poll_interval_s``: how often the decode reads the board's
    verdicts on its prefills (each read is one counter when nothing changed).  ``serving_url``: the server's API address as routers
    reach it (``http://host:port``), recorded in its instance slot for ``shmhb feed``."""

    board: str | None = None
    act_on_suspect: bool = False
    grant_timeout_s: float = 2.0
    grant_lease_s: float = 30.0
    beat_interval_s: float = 0.1
    poll_interval_s: float = 0.005
    serving_url: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SglangSettings:
        e = os.environ if env is None else env
        board = e.get("SHMHB_BOARD") or None
        suspect = _flag(e, "SHMHB_SGLANG_ACT_ON_SUSPECT")
        serving = e.get("SHMHB_SGLANG_SERVING_URL") or None
        if serving is not None:
            try:
                check_endpoint(serving.removeprefix("http://").rstrip("/"))
            except InvalidAddress as err:
                raise InvalidConfig(f"SHMHB_SGLANG_SERVING_URL: {err}") from None
        grant = _seconds(e, "SHMHB_SGLANG_GRANT_TIMEOUT_S", 2.0, 0.01, 60.0)
        lease = _seconds(e, "SHMHB_SGLANG_GRANT_LEASE_S", 30.0, 1.0, 3600.0)
        check_lease(lease, grant, ("SHMHB_SGLANG_GRANT_LEASE_S", "SHMHB_SGLANG_GRANT_TIMEOUT_S"))
        return cls(board=board, act_on_suspect=suspect, grant_timeout_s=grant,
                   grant_lease_s=lease,
                   beat_interval_s=_seconds(e, "SHMHB_SGLANG_BEAT_INTERVAL_S", 0.1, 0.005, 5.0),
                   poll_interval_s=_seconds(e, "SHMHB_SGLANG_POLL_INTERVAL_S", 0.005, 0.001, 1.0),
                   serving_url=serving)


def enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``SHMHB_SGLANG`` asks for the wrapper (``InvalidConfig`` on a value that
    is neither yes nor no: a typo must not run a server unwrapped in silence)."""
    return _flag(os.environ if env is None else env, ENABLE)


def _flag(env: Mapping[str, str], name: str) -> bool:
    v = env.get(name, "").strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise InvalidConfig(f"{name} must be 1 or 0 (true/false, yes/no, on/off), got {v!r}")


def _seconds(env: Mapping[str, str], name: str, default: float, lo: float, hi: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        v = float(raw)
    except ValueError:
        raise InvalidConfig(f"{name} must be a number of seconds, got {raw!r}") from None
    if not lo <= v <= hi:
        raise InvalidConfig(f"{name} must be within [{lo}, {hi}] s, got {v}")
    return v


def rank_key(role: str, instance: str, dp: int, tp: int, pp: int) -> str:
    """``sglang/<p|d>/<instance>/dp<d>/tp<t>/pp<p>``: ``instance`` is the prefill's
    bootstrap address (a restart on it is a new incarnation of the same keys) or the
    decode rank's own endpoint; an instance too long for the key is replaced by a digest."""
    tail = f"/dp{dp}/tp{tp}/pp{pp}"
    head = f"{KEY_PREFIX}{role[0]}/"
    if len((head + instance + tail).encode()) > KEY_BYTES - 1:
        instance = hashlib.blake2b(instance.encode(), digest_size=8).hexdigest()
    return head + instance + tail
