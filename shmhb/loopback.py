"""Loopback addresses for simulated hosts (the demo, the example, the benchmarks).

Each simulated host binds its own address in 127.0.0.0/8 (all of it is loopback on
Linux).  By default host ``i`` is 127.0.0.(2+i); ``$SHMHB_LOOPBACK_BASE`` (or a
``--base-addr`` flag of the tool, which sets it for its children) moves the whole range,
e.g. to 127.0.5.1 when 127.0.0.2-6 are taken on a shared machine.  Anything outside
127.0.0.0/8 is refused: these tools must never send traffic off the host.
"""

from __future__ import annotations

import ipaddress
import os

from .errors import InvalidConfig

LOOPBACK_ENV = "SHMHB_LOOPBACK_BASE"
DEFAULT_BASE = "127.0.0.2"
_NET = ipaddress.ip_network("127.0.0.0/8")


def loopback_addrs(n: int, base: str | None = None) -> list[str]:
    """``n`` consecutive loopback addresses from ``base`` (default: ``$SHMHB_LOOPBACK_BASE``
    or 127.0.0.2), all inside 127.0.0.0/8 and none of them 127.0.0.0 or 127.255.255.255."""
    chosen = base if base is not None else (os.environ.get(LOOPBACK_ENV) or DEFAULT_BASE)
    try:
        first = ipaddress.IPv4Address(chosen.strip())
    except ValueError:
        raise InvalidConfig(f"invalid loopback base address {chosen!r}: use an IPv4 address "
                            f"in 127.0.0.0/8 such as {DEFAULT_BASE}") from None
    last = first + max(n - 1, 0) if int(first) + max(n - 1, 0) <= int(_NET.broadcast_address) else None
    if first not in _NET or first == _NET.network_address or last is None \
            or last == _NET.broadcast_address:
        raise InvalidConfig(f"loopback base {chosen!r} with {n} hosts leaves 127.0.0.1-127.255.255.254: "
                            f"pick a base such as {DEFAULT_BASE}")
    return [str(first + i) for i in range(n)]


def set_base(base: str | None) -> None:
    """Validate ``base`` and export it to this process's children (None: leave as is)."""
    if base is not None:
        loopback_addrs(1, base)
        os.environ[LOOPBACK_ENV] = base
