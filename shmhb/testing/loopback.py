"""Loopback hosts for simulated clusters: the demo, the example, the tests, the benchmarks.

Each simulated host binds its own address in 127.0.0.0/8 (all of it is loopback on
Linux).  By default host ``i`` is 127.0.0.(2+i); ``$SHMHB_LOOPBACK_BASE`` (or a
``--base-addr`` flag of the tool, which sets it for its children) moves the whole range,
e.g. to 127.0.5.1 when 127.0.0.2-6 are taken on a shared machine.  Anything outside
127.0.0.0/8 is refused: these tools must never send traffic off the host.

This is also the one home of the other things every simulated cluster needs: a port
free on all of its hosts at once (:func:`free_port`), the environment its child
processes run in (:func:`child_env`, offline for every model hub: :data:`OFFLINE_ENV`).  It lives in the package, not in tests/ or bench/,
because ``shmhb demo`` (shipped with the library) needs the port too, and tests/, bench/
and examples/ all import the package already: one copy, one behaviour.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import random
import socket
from collections.abc import Collection, Sequence
from pathlib import Path

from ..errors import InvalidConfig

LOOPBACK_ENV = "SHMHB_LOOPBACK_BASE"
DEFAULT_BASE = "127.0.0.2"
_NET = ipaddress.ip_network("127.0.0.0/8")
# Ports are drawn below Linux's ephemeral range (32768-60999), so no outgoing
# connection's kernel-chosen port can take one between the check and the bind.
PORT_LO, PORT_HI = 20000, 32000
_CHECKOUT = Path(__file__).resolve().parents[2]  # the directory holding the package


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


def free_port(addrs: Sequence[str], span: int = 1, rng: random.Random | None = None,
              tries: int = 200, avoid: Collection[int] = ()) -> int:
    """A port P such that P..P+span-1 can be bound (TCP) on every one of ``addrs`` right
    now and none of them is in ``avoid``: random in [PORT_LO, PORT_HI), retried ``tries``
    times, else ``OSError`` (EADDRINUSE).  Only a check: another process may still take it
    before the caller binds, so callers that can retry on EADDRINUSE should.

    ``avoid`` is for ports the caller owns but has not bound at this moment (a server
    between a kill and its restart): a check by binding cannot see them.  Pass
    ``"0.0.0.0"`` in ``addrs`` for a port that will be bound on every address (torch's
    TCPStore does that): the check then conflicts with a bind on any one of them."""
    if span < 1 or span > PORT_HI - PORT_LO:
        raise InvalidConfig(f"a port span of {span} does not fit in {PORT_LO}..{PORT_HI}")
    rng = rng or random.Random()
    for _ in range(tries):
        port = rng.randrange(PORT_LO, PORT_HI - span + 1)
        if any(q in avoid for q in range(port, port + span)):
            continue
        socks: list[socket.socket] = []
        try:
            for a in addrs:
                for q in range(port, port + span):
                    s = socket.socket()
                    socks.append(s)
                    s.bind((a, q))
            return port
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise OSError(errno.EADDRINUSE, f"no {span} free port(s) in a row on {', '.join(addrs)} "
                                    f"after {tries} tries: free some, or move the hosts with "
                                    f"${LOOPBACK_ENV}")


#: What a simulated cluster's processes run with, so that nothing they start looks a model
#: up on a hub or reports home: the Hugging Face libraries' offline switches (Python's ``huggingface_hub``
#: and ``transformers``; the routers' Rust hub clients read ``HF_HUB_OFFLINE`` and
#: ``HF_ENDPOINT``), and the hub's address on a loopback port where nothing listens
#: (port 9, discard), for a client that ignores the offline switch: its request is refused
#: on this host instead of leaving it.  vLLM's usage report (sent to its authors from every
#: engine) is switched off the two ways vLLM reads.
OFFLINE_ENV: dict[str, str] = {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "HF_ENDPOINT": "http://127.0.0.1:9",
}


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment with the directory that holds this package first on
    ``PYTHONPATH`` (so a child process imports this very checkout, and its tests/ and
    bench/), the hubs' offline switches (:data:`OFFLINE_ENV`), plus ``extra``: for the
    subprocesses of tests, benchmarks and the demo."""
    path = os.pathsep.join(filter(None, [str(_CHECKOUT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, **OFFLINE_ENV, "PYTHONPATH": path, **extra}
