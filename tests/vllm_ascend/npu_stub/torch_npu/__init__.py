"""A stand-in for Ascend's ``torch_npu``: the device layer only, for tests on a CPU machine.

vllm-ascend imports ``torch_npu`` at module level and, on the path of its P/D Mooncake
connector (TP 1 to TP 1, no MLA, not layerwise), calls exactly three things of the device
layer: ``torch.npu.set_device`` (the consumer's receiving pool runs it in each of its
threads), ``torch.npu.is_available()`` (asked once ``torch_npu`` imports) and
``torch.npu.Stream`` (named in annotations).  This package provides those and nothing
else: every line of the connector runs unmodified.  It is put on ``PYTHONPATH`` for the
test engines only (``tests/vllm_ascend/engine.py``), never installed.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch


class Stream:
    """An NPU stream: named by annotations, never made on the connector's path."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("torch_npu stub: no NPU streams on a CPU machine")


def set_device(device: Any) -> None:
    """The receiving pool's thread initializer: the KV caches are CPU tensors here."""


def is_available() -> bool:
    return False


def device_count() -> int:
    return 0


npu = types.ModuleType("torch.npu")
npu.Stream = Stream  # type: ignore[attr-defined]
npu.set_device = set_device  # type: ignore[attr-defined]
npu.is_available = is_available  # type: ignore[attr-defined]
npu.device_count = device_count  # type: ignore[attr-defined]
torch.npu = npu  # type: ignore[attr-defined]
sys.modules["torch.npu"] = npu
