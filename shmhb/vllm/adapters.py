"""Which adapter serves which inner connector (the contract: ``inner``)."""

from __future__ import annotations

from typing import Any

from .inner import InnerAdapter
from .mooncake_adapter import MooncakeAdapter

__all__ = ["ADAPTERS", "adapter_for"]

ADAPTERS: list[type[InnerAdapter]] = [MooncakeAdapter]


def adapter_for(name: str, connector: Any) -> InnerAdapter:
    for cls in ADAPTERS:
        if name in cls.names:
            a = cls(connector)
            a.check()
            return a
    raise TypeError(f"shmhb has no adapter for inner connector {name!r} (it has: "
                    f"{sorted(n for c in ADAPTERS for n in c.names)}); write one "
                    "(docs/VLLM.md, 'Writing an adapter')")
