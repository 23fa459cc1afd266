"""The connector's settings (``kv_connector_extra_config``), validated at the door, and
the board key a worker rank registers under."""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from typing import Any

from ..board.address import check_endpoint
from ..errors import InvalidAddress, InvalidConfig
from ..board.layout import KEY_BYTES
from ..kv.grants import check_lease

#: what a consumer does with a request whose producer engine the board reports gone
ON_DEAD_PEER = ("recompute", "fail")


@dataclass(frozen=True)
class ConnectorSettings:
    """``inner``: the wrapped connector's own ``kv_transfer_config`` (its
    ``kv_connector``, ``kv_connector_extra_config``, ...).  ``board``: the host's board
    (None: ``$SHMHB_BOARD`` or "shmhb").  ``on_dead_peer``: "recompute" (the scheduler
    computes the prompt locally) or "fail" (the load is started and failed at once, so
    vLLM's ``kv_load_failure_policy`` decides).  ``act_on_suspect``: treat SUSPECT as a
    drop (off by default: a flap must not fail requests).  ``grant_timeout_s``: how
    long a producer waits for its consumer's go-ahead before it gives the write up.
    ``grant_lease_s``: what a consumer's go-ahead promises: the producer writes only
    within it (counted from its ask), and the consumer holds a granted load's blocks at
    least that long (shmhb.kv.grants, "The lease"); longer than the producer's wait
    for the answer, so a late answer still serves.  ``serving_url``: the engine's API server as routers reach it (``http://host:port``),
    recorded in its instance slot for ``shmhb feed`` (shmhb.board.instances).
    ``drain_timeout_s``: on SIGTERM the engine reads draining (fed routers drop it) and
    keeps serving what it owes, the requests it runs and the KV its peers have not read,
    for at most this long before the stack's own shutdown (shmhb.board.drain); 0: no
    drain, SIGTERM acts at once."""

    inner: dict[str, Any]
    board: str | None = None
    on_dead_peer: str = "recompute"
    act_on_suspect: bool = False
    grant_timeout_s: float = 2.0
    grant_lease_s: float = 30.0
    beat_interval_s: float = 0.1
    serving_url: str | None = None  # "host:port" the engine's API server serves at
    drain_timeout_s: float = 30.0
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        extra = dict(extra or {})
        inner = extra.get("inner")
        if not isinstance(inner, dict) or not isinstance(inner.get("kv_connector"), str):
            raise InvalidConfig(
                'ShmhbConnector needs kv_connector_extra_config["inner"] = '
                '{"kv_connector": "MooncakeConnector", "kv_connector_extra_config": {...}}')
        if inner["kv_connector"] == "ShmhbConnector":
            raise InvalidConfig("ShmhbConnector cannot wrap itself")
        board = extra.get("board")
        if board is not None and not isinstance(board, str):
            raise InvalidConfig(f"board must be a board name, got {board!r}")
        on_dead = extra.get("on_dead_peer", "recompute")
        if on_dead not in ON_DEAD_PEER:
            raise InvalidConfig(f"on_dead_peer must be one of {ON_DEAD_PEER}, got {on_dead!r}")
        suspect = extra.get("act_on_suspect", False)
        if not isinstance(suspect, bool):
            raise InvalidConfig(f"act_on_suspect must be true or false, got {suspect!r}")
        grant = _seconds(extra, "grant_timeout_s", 2.0, 0.01, 60.0)
        lease = _seconds(extra, "grant_lease_s", 30.0, 1.0, 3600.0)
        check_lease(lease, grant, ("grant_lease_s", "grant_timeout_s"))
        beat = _seconds(extra, "beat_interval_s", 0.1, 0.005, 5.0)
        serving = _serving(extra.get("serving_url"))
        drain = _seconds(extra, "drain_timeout_s", 30.0, 0.0, 86400.0)
        return cls(inner, board, on_dead, suspect, grant, lease, beat, serving, drain, extra)


def _seconds(extra: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    v = extra.get(name, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise InvalidConfig(f"{name} must be a number of seconds in [{lo}, {hi}], got {v!r}")
    return float(v)


def _serving(v: object) -> str | None:
    """``serving_url``: the engine's API server as routers reach it, ``http://host:port``
    (or bare ``host:port``); kept as "host:port"."""
    if v is None:
        return None
    if not isinstance(v, str):
        raise InvalidConfig(f"serving_url must be 'http://host:port', got {v!r}")
    text = v[len("http://"):] if v.startswith("http://") else v
    try:
        return check_endpoint(text.rstrip("/"))
    except InvalidAddress as e:
        raise InvalidConfig(f"serving_url must be 'http://host:port': {e}") from None


@dataclass(frozen=True, slots=True)
class Rank:
    """A worker's place in its engine: its data-, tensor- and pipeline-parallel ranks."""

    dp: int
    tp: int
    pp: int


#: the rank that speaks for its engine where nothing else names one
FIRST_RANK = Rank(dp=0, tp=0, pp=0)


def rank_key(engine_id: str, dp_rank: int, tp_rank: int, pp_rank: int) -> str:
    """The board key of one worker rank: names its engine and ranks.  An engine id too
    long for a key (at most 63 bytes) is shortened to a digest, the same for every
    reader."""
    tail = f"/dp{dp_rank}/tp{tp_rank}/pp{pp_rank}"
    key = f"vllm/{engine_id}{tail}"
    if len(key.encode()) < KEY_BYTES:
        return key
    digest = hashlib.sha256(engine_id.encode()).hexdigest()[:24]
    return f"vllm/~{digest}{tail}"


@functools.lru_cache(maxsize=1024)
def engine_prefix(engine_id: str) -> str:
    """What every rank key of ``engine_id`` starts with."""
    return rank_key(engine_id, 0, 0, 0).rsplit("/dp", 1)[0] + "/"


def engine_token(engine_id: str) -> str:
    """How the board names engine ``engine_id`` in its rank and instance keys (the id,
    or its digest where the id is too long for a key)."""
    return engine_prefix(engine_id)[len("vllm/"):-1]
