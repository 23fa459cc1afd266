"""The instance slot a vLLM engine registers for routers (``shmhb.board.instances``): called by
``WorkerGuard.register`` once the rank's own slot is up.

One rank per engine registers it: the rank that runs the engine's KV bootstrap server
(a Mooncake prefill's dp0/tp0/pp0), or rank dp0/tp0/pp0 of an engine without one.  Its
role comes from the connector's ``kv_role``; its serving address from the connector
setting ``serving_url`` (the API server's ``http://host:port``; without it only the
bootstrap address is recorded and ``shmhb feed`` matches the router's configured worker
by host and bootstrap port).
"""

from __future__ import annotations

import logging
from typing import Any

from ..board.config import format_hostport, parse_hostport
from ..errors import ShmhbError
from ..board.instances import register_instance
from .settings import FIRST_RANK, ConnectorSettings, Rank, engine_token

log = logging.getLogger(__name__)


def role_of(producer: bool, consumer: bool) -> str:
    """prefill, decode or both, from what the rank does (its adapter says)."""
    if producer and consumer:
        return "both"
    return "prefill" if producer else "decode"


def routable_bootstrap(endpoints: dict[str, str]) -> str | None:
    """The bootstrap endpoint as a router reaches it: vLLM reports the address its
    server was told (often ``data_parallel_master_ip``, 127.0.0.1 on one node, or a
    wildcard); a loopback or wildcard host is replaced by the rank's own host (its
    transfer engine's), which is what a router's ``--prefill URL PORT`` names and what
    a followed host's digest accepts."""
    boot = endpoints.get("bootstrap")
    engine = endpoints.get("engine")
    if boot is None or engine is None:
        return boot
    host, port = parse_hostport(boot)
    if host.startswith("127.") or host.strip("[]") in ("0.0.0.0", "::", "::1", "localhost"):
        return format_hostport(parse_hostport(engine)[0], port)
    return boot


def register_engine_instance(board: Any, rank_hb: Any, endpoints: dict[str, str],
                             rank: Rank, role: str, engine_id: str,
                             settings: ConnectorSettings) -> Any:
    """The instance slot's heartbeat, or None when this rank is not the one that
    registers it, or when it cannot be registered (logged: the rank itself is up and
    the connector works without it; only routers fed by shmhb miss the instance).
    ``role``: prefill, decode or both (``role_of``)."""
    bootstrap = routable_bootstrap(endpoints)
    if bootstrap is None and rank != FIRST_RANK:
        return None
    serving = settings.serving_url
    if serving is None and bootstrap is None:
        log.warning("shmhb: engine %s has no serving_url setting and no bootstrap server: "
                    "routers fed by shmhb cannot match it", engine_id)
        return None
    try:
        return register_instance(board, rank_hb, role, engine_token(engine_id), serving=serving,
                                 bootstrap=bootstrap, interval_s=settings.beat_interval_s)
    except (ShmhbError, ValueError) as e:
        log.warning("shmhb: engine %s: no instance slot for routers (%s)", engine_id, e)
        return None
