"""Drops, vetoes and fences by reason, exported through vLLM's connector stats."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics, KVConnectorStats,
)

#: counter names; reasons are appended: "drops.dead", "vetoes.left", ...
COUNTERS = ("failed_loads", "granted_loads", "denied_writes", "freed_sends", "fenced_requests",
            "expired_grants", "held_failures")


class Counts:
    """Thread-safe counters, taken whole by ``take()`` once per stats interval."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c: Counter[str] = Counter()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._c[name] += n

    def take(self) -> dict[str, int]:
        with self._lock:
            out, self._c = dict(self._c), Counter()
        return out


@dataclass
class ShmhbKVConnectorStats(KVConnectorStats):
    """``data = {"shmhb": {name: count}, "inner": inner stats or None}``."""

    data: dict[str, Any] = field(default_factory=lambda: {"shmhb": {}, "inner": None})

    def reset(self) -> None:
        self.data = {"shmhb": {}, "inner": None}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        mine: dict[str, int] = self.data.setdefault("shmhb", {})
        theirs = other.data.get("shmhb", {}) if isinstance(other.data, dict) else {}
        for k, v in theirs.items():
            mine[k] = mine.get(k, 0) + int(v)
        oi = other.data.get("inner") if isinstance(other.data, dict) else None
        si = self.data.get("inner")
        if oi is not None:
            self.data["inner"] = oi if si is None else si.aggregate(oi)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {f"shmhb_{k}": v for k, v in self.data.get("shmhb", {}).items()}
        inner = self.data.get("inner")
        if inner is not None and not inner.is_empty():
            out.update(inner.reduce())
        return out

    def is_empty(self) -> bool:
        inner = self.data.get("inner")
        return not self.data.get("shmhb") and (inner is None or inner.is_empty())

    def to_dict(self) -> dict[str, Any]:
        inner = self.data.get("inner")
        return {"shmhb": dict(self.data.get("shmhb", {})),
                "inner": None if inner is None else inner.to_dict()}


class InnerPromMetrics(KVConnectorPromMetrics):
    """The inner connector's Prometheus metrics, fed the inner part of
    ``ShmhbKVConnectorStats.to_dict()`` (``{"shmhb": ..., "inner": ...}``)."""

    def __init__(self, inner: KVConnectorPromMetrics, *args: Any) -> None:
        super().__init__(*args)
        self.inner = inner

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data.get("inner") if isinstance(transfer_stats_data, dict) else None
        if data:
            self.inner.observe(data, engine_idx)
