"""Instances: what a router in front of P/D serving routes to, read off the board.

An *instance* is one serving engine: its ranks (board slots keyed ``vllm/<engine>/...``,
as ``shmhb.vllm`` registers them), its role (prefill, decode or both), the address it
serves HTTP at, its KV bootstrap address and its incarnation.  The rank that runs the
engine's bootstrap server (or rank 0 of a decode engine) registers one more slot for
the instance itself, keyed

    inst/<role>/<bootstrap port or ->/<engine>

with the serving address (``host:port``) as its one endpoint, or none.  The bootstrap
address is the bootstrap port on the host of the engine's ranks (their endpoints name
it; else the serving address's).  The slot advertises no endpoint a rank advertises:
lookups by endpoint (``Board.remote``, the LinkReaper) must keep finding the rank.
An instance needs a serving address or a bootstrap port.  The instance slot beats from the
same process as that rank and closes with it, so the pinger's digest carries it to
other hosts like any worker.

An instance is *draining* while a slot keyed ``drain/`` and the rest of its instance key
(``register_drain``: held by whoever asked for the drain, the engine itself on SIGTERM or
``shmhb drain``) reads ALIVE, SUSPECT or UNKNOWN: routers fed by the board send it no new
request, while it finishes what it owes and leaves.  A drain ends when its slot closes
or its holder dies; the instance is then judged as before.

An instance reads DEAD or LEFT as soon as its own slot or any of its ranks does, ALIVE
only while its slot and every rank are, and UNKNOWN when the board cannot say.  A
restart registers the slot anew: a new incarnation (and, with vLLM's default, a new
engine id).  Everything here is pure logic over ``SlotStatus`` rows, so the same rule
judges local slots and a followed host's rows alike; a row whose key or endpoints do
not fit the format is skipped with a rate-limited warning, never fatal.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from collections.abc import Iterable
from typing import Any

from .address import check_endpoint, format_address, parse_address
from .handle import Board
from .heartbeat import Heartbeat
from ..errors import InvalidConfig
from ..ratelog import RateLimitedLog
from .records import check_key
from ..status import SlotStatus, Status

__all__ = [
    "DRAIN_PREFIX", "INSTANCE_PREFIX", "Instance", "RANK_PREFIX", "ROLES", "drain_key",
    "instance_key", "instances_from", "judge_instance", "parse_instance_key", "register_drain",
    "register_instance",
]

log = logging.getLogger(__name__)
skipped = RateLimitedLog(log)

INSTANCE_PREFIX = "inst/"
DRAIN_PREFIX = "drain/"
RANK_PREFIX = "vllm/"
ROLES = ("prefill", "decode", "both")
#: the order of badness when an instance's rows disagree: the first that any row has wins
_WORST = (Status.DEAD, Status.LEFT, Status.UNKNOWN, Status.SUSPECT)


@dataclass(frozen=True, slots=True, kw_only=True)
class Instance:
    """One engine as a router sees it.  ``host``: "" for this host's board, else the
    followed host's pinger address.  ``engine``: the engine id as its rank keys carry
    it (vLLM's id, or ``~`` and a digest when the id is too long for a key).
    ``serving``/``bootstrap``: "host:port" or None.  ``ranks``: how many rank slots it
    has on the board."""

    host: str
    key: str
    engine: str
    role: str
    serving: str | None
    bootstrap: str | None
    incarnation: int
    status: Status
    ranks: int
    draining: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "host": self.host, "key": self.key, "engine_id": self.engine, "role": self.role,
            "url": None if self.serving is None else f"http://{self.serving}",
            "serving": self.serving, "bootstrap": self.bootstrap,
            "incarnation": self.incarnation, "status": self.status.value, "ranks": self.ranks,
            "draining": self.draining,
        }


def instance_key(role: str, engine_token: str, *, bootstrap_port: int | None,
                 serving: bool = True) -> str:
    """The board key of an instance slot; ``InvalidConfig`` for a role outside ``ROLES``,
    a bad port, or neither a serving address nor a bootstrap port; ``InvalidKey`` if it
    does not fit a key."""
    if role not in ROLES:
        raise InvalidConfig(f"an instance's role is one of {ROLES}, got {role!r}")
    if bootstrap_port is not None and (isinstance(bootstrap_port, bool)
                                       or not isinstance(bootstrap_port, int)
                                       or not 0 < bootstrap_port < 65536):
        raise InvalidConfig(f"a bootstrap port is in 1..65535, got {bootstrap_port!r}")
    if bootstrap_port is None and not serving:
        raise InvalidConfig("an instance needs a serving address or a bootstrap port (or both)")
    if not engine_token or "/" in engine_token:
        raise InvalidConfig(f"an engine token is non-empty and has no '/', got {engine_token!r}")
    port = "-" if bootstrap_port is None else str(bootstrap_port)
    key = f"{INSTANCE_PREFIX}{role}/{port}/{engine_token}"
    check_key(key)
    return key


def parse_instance_key(key: str) -> tuple[str, int | None, str] | None:
    """(role, bootstrap port or None, engine token) of an instance key, or None if
    ``key`` is not one."""
    if not key.startswith(INSTANCE_PREFIX):
        return None
    parts = key[len(INSTANCE_PREFIX):].split("/")
    if len(parts) != 3 or parts[0] not in ROLES or not parts[2]:
        return None
    if parts[1] == "-":
        return parts[0], None, parts[2]
    p = parts[1]
    if not p.isascii() or not p.isdigit() or p.startswith("0") or not 0 < int(p) < 65536:
        return None
    return parts[0], int(p), parts[2]


def drain_key(key: str) -> str:
    """The key of the drain slot of instance ``key`` (``InvalidConfig`` if ``key`` is not
    an instance key, ``InvalidKey`` if the drain key does not fit)."""
    if parse_instance_key(key) is None:
        raise InvalidConfig(f"not an instance key (inst/<role>/<port>/<engine>): {key!r}")
    out = DRAIN_PREFIX + key[len(INSTANCE_PREFIX):]
    check_key(out)
    return out


def judge_instance(own: Status, ranks: Iterable[Status]) -> Status:
    """An instance's status from its own slot's and its ranks' statuses: the worst of
    them (DEAD, then LEFT, then UNKNOWN, then SUSPECT), ALIVE only when all are."""
    seen = {own, *ranks}
    for st in _WORST:
        if st in seen:
            return st
    return Status.ALIVE


def instances_from(slots: Iterable[SlotStatus], host: str = "") -> list[Instance]:
    """Every instance among one host's slots (its own board's, or a followed host's
    rows), judged with its ranks.  Rows that look like instances but do not parse are
    skipped (logged at most every 10 s)."""
    rows = list(slots)
    drains = {INSTANCE_PREFIX + r.key[len(DRAIN_PREFIX):] for r in rows
              if r.key.startswith(DRAIN_PREFIX)
              and r.status in (Status.ALIVE, Status.SUSPECT, Status.UNKNOWN)}
    out = []
    for s in rows:
        if not s.key.startswith(INSTANCE_PREFIX):
            continue
        parsed = parse_instance_key(s.key)
        if parsed is None or len(s.endpoints) > 1 or (parsed[1] is None and not s.endpoints):
            skipped.warn("instance", "skipping instance row %r on %s: key or endpoints %r do "
                         "not fit inst/<role>/<bootstrap port>/<engine>", s.key,
                         host or "this host", s.endpoints)
            continue
        role, bport, token = parsed
        prefix = f"{RANK_PREFIX}{token}/"
        mine = [r for r in rows if r.key.startswith(prefix)]
        serving = s.endpoints[0] if s.endpoints else None
        boot = None
        if bport is not None:
            where = next((r.endpoints[0] for r in mine if r.endpoints), serving)
            if where is not None:
                boot = format_address(parse_address(where).host, bport)
        out.append(Instance(host=host, key=s.key, engine=token, role=role, serving=serving,
                            bootstrap=boot, incarnation=s.incarnation,
                            status=judge_instance(s.status, [r.status for r in mine]),
                            ranks=len(mine), draining=s.key in drains))
    return out


def board_instances(board: Any, *, remote: bool = True) -> list[Instance]:
    """The instances on ``board`` (a ``shmhb.Board``): its own slots, and with ``remote``
    those of every host its pinger follows (``host`` set to the host's address)."""
    out = instances_from(board.slots())
    if remote:
        for p in board.peers():
            out.extend(instances_from(p.slots, p.address))
    return out


def register_instance(board: Board, rank_hb: Heartbeat, role: str, engine_token: str, *,
                      serving: str | None, bootstrap: str | None,
                      interval_s: float = 0.1) -> Heartbeat:
    """Register the instance slot beside the rank whose heartbeat is ``rank_hb`` (same
    process): it beats every ``interval_s`` and closes when the rank's heartbeat closes,
    so a graceful shutdown reads LEFT and a crash DEAD.  Returns its ``Heartbeat``.
    ``serving``/``bootstrap``: "host:port" (validated like every endpoint; ``serving``
    may also be written ``http://host:port``, as the connector's ``serving_url`` is); of
    the bootstrap address only the port is stored, its host is the ranks'."""
    if serving is not None and serving.startswith("http://"):
        serving = serving[len("http://"):].rstrip("/")
    eps = () if serving is None else (check_endpoint(serving),)
    bport = None if bootstrap is None else parse_address(bootstrap, need_port=True).port
    key = instance_key(role, engine_token, bootstrap_port=bport, serving=serving is not None)
    # The storage layer's register, also on the package's Board: an instance slot never
    # joins the election for the agent role (its rank's own slot does, where it should).
    hb = Board.register(board, key, endpoints=eps).start(interval_s)
    rank_hb.on_close(hb.close)
    log.info("instance %s registered (incarnation %d, endpoints %s)", key, hb.incarnation, eps)
    return hb


def register_drain(board: Board, key: str, *, interval_s: float = 0.1) -> Heartbeat:
    """Start a drain of instance ``key`` on ``board``: a slot beating every ``interval_s``
    from this process, the drain lasting until its ``Heartbeat`` closes or this process
    dies.  ``KeyInUse`` if a drain of it is under way already."""
    hb = Board.register(board, drain_key(key)).start(interval_s)  # no agent: see above
    log.info("drain of %s started", key)
    return hb
