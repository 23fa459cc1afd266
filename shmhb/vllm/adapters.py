"""Which adapter serves which inner connector (the contract: ``inner``)."""

from __future__ import annotations

from typing import Any

from .ascend_adapter import REFUSED, AscendMooncakeAdapter
from .inner import InnerAdapter
from .mooncake_adapter import MooncakeAdapter
from .nixl_adapter import NixlAdapter

__all__ = ["ADAPTERS", "adapter_class", "adapter_for"]

ADAPTERS: list[type[InnerAdapter]] = [MooncakeAdapter, NixlAdapter, AscendMooncakeAdapter]


def adapter_class(name: str) -> type[InnerAdapter]:
    """The adapter that serves inner connector ``name`` (``TypeError`` if none does, with
    the reason where a connector is refused on purpose)."""
    if name in REFUSED:
        raise TypeError(REFUSED[name])
    for cls in ADAPTERS:
        if name in cls.names:
            return cls
    raise TypeError(f"shmhb has no adapter for inner connector {name!r} (it has: "
                    f"{sorted(n for c in ADAPTERS for n in c.names)}); write one "
                    "(docs/VLLM.md, 'Writing an adapter')")


def adapter_for(name: str, connector: Any) -> InnerAdapter:
    """The adapter of a built inner connector, checked against what it uses."""
    a = adapter_class(name)(connector)
    a.check()
    return a
