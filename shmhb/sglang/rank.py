"""A rank's place on its host's board: its slot (key ``sglang/<p|d>/...``, its endpoints),
the instance slot routers read (``shmhb.board.instances``), and the LinkReaper that
reports the peers it works with when the board drops them.  Shared by both roles."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..agent.embedded import Board  # its register joins the host's embedded agent
from ..board.address import format_address
from ..board.instances import register_instance
from ..board.reaper import DropReason, Link, LinkReaper
from ..errors import ShmhbError
from .settings import SglangSettings, rank_key

log = logging.getLogger(__name__)


def endpoint(host: str, port: int | str) -> str:
    """"host:port" as the board spells it ("[v6]:port")."""
    return format_address(host.strip("[]"), int(port))


@dataclass(frozen=True)
class RankInfo:
    """Who a rank is.  ``role``: "prefill" or "decode".  ``instance``: what names the
    server across restarts (a prefill's bootstrap address, a decode rank's own
    endpoint).  ``endpoints``: what peers reach it at (its rank port, its Mooncake
    session, a decode's go-ahead endpoint...).  ``bootstrap``: the bootstrap address,
    on the rank that registers the instance; ``first``: whether this rank registers it."""

    role: str
    instance: str
    dp: int
    tp: int
    pp: int
    endpoints: tuple[str, ...]
    bootstrap: str | None
    first: bool


class RankSlot:
    """Registers at construction, leaves the board on ``close`` (peers read LEFT)."""

    def __init__(self, settings: SglangSettings, info: RankInfo,
                 on_drop: Callable[[Link, DropReason], None]) -> None:
        self.settings = settings
        self.board = Board.attach(settings.board)
        self.key = rank_key(info.role, info.instance, info.dp, info.tp, info.pp)
        self.hb = self.board.register(self.key, endpoints=info.endpoints).start(
            settings.beat_interval_s)
        self.incarnation: int = self.hb.incarnation
        if info.first:
            self._register_instance(info)
        self.reaper = LinkReaper(self.board, on_drop, drop_suspect=settings.act_on_suspect)
        self.reaper.start(settings.poll_interval_s)
        log.info("shmhb: %s registered on board %s (incarnation %d, endpoints %s)",
                 self.key, self.board.name, self.incarnation, info.endpoints)

    def _register_instance(self, info: RankInfo) -> None:
        serving = self.settings.serving_url
        if serving is None and info.bootstrap is None:
            log.warning("shmhb: %s has no SHMHB_SGLANG_SERVING_URL and no bootstrap "
                        "address: routers fed by shmhb cannot match it", self.key)
            return
        token = "sglang-" + self.key.split("/", 2)[2].split("/dp", 1)[0].replace(
            "/", "-").replace(":", "-").strip("[]")
        try:
            register_instance(self.board, self.hb, info.role, token[:40], serving=serving,
                              bootstrap=info.bootstrap, interval_s=self.settings.beat_interval_s)
        except (ShmhbError, ValueError) as e:  # the rank works without it; routers miss it
            log.warning("shmhb: %s: no instance slot for routers (%s)", self.key, e)

    def track(self, ep: str, payload: Any, incarnation: int | None = None) -> bool:
        """Start following the peer at ``ep``; False (logged) where the board refused."""
        try:
            self.reaper.track(ep, payload=payload, incarnation=incarnation)
        except ShmhbError as e:  # e.g. the registry lock held by a stopped process
            log.warning("shmhb: could not track %s (%s); retried at its next room", ep, e)
            return False
        return True

    def close(self) -> None:
        self.reaper.stop()
        for link in self.reaper.links():
            self.reaper.untrack(link.endpoint)
        self.hb.close()
