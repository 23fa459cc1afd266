"""systemd's notify protocol, for ``Type=notify`` units: readiness and the watchdog.

A message is one datagram of ``KEY=VALUE`` lines to the AF_UNIX socket named by
``$NOTIFY_SOCKET`` (a path, or ``@name`` in the abstract namespace); systemd sets it
for the service's processes.  ``WATCHDOG_USEC`` (and ``WATCHDOG_PID``, when set, naming
this process) says how often ``WATCHDOG=1`` must come.  Outside systemd there is no
socket and every call is a no-op.  A failed send is logged (rate-limited) and never
raised: the host's death watch must not depend on its supervisor's socket.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

from ..ratelog import RateLimitedLog

log = logging.getLogger(__name__)
_failed = RateLimitedLog(log, 60.0)


def _address(env: Mapping[str, str]) -> str | None:
    addr = env.get("NOTIFY_SOCKET", "")
    if addr.startswith("@"):
        return "\0" + addr[1:]  # the abstract namespace
    if addr.startswith("/"):
        return addr
    return None  # unset, or a kind this module does not speak (vsock)


def notify(state: str, env: Mapping[str, str] | None = None) -> bool:
    """Send ``state`` (e.g. ``"READY=1"``, ``"WATCHDOG=1"``) to systemd; True if sent,
    False where there is no notify socket or the send failed."""
    addr = _address(os.environ if env is None else env)
    if addr is None:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(state.encode())
    except OSError as e:
        _failed.warn("notify", "sd_notify %r to %r failed: %s", state.split("\n")[0], addr, e)
        return False
    return True


def watchdog_interval_s(env: Mapping[str, str] | None = None) -> float | None:
    """The watchdog period systemd asks of this process (``WatchdogSec=``), or None."""
    e = os.environ if env is None else env
    try:
        usec = int(e.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    pid = e.get("WATCHDOG_PID")
    if usec <= 0 or (pid and pid != str(os.getpid())):
        return None
    return usec / 1e6
