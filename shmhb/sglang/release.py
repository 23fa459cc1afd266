"""The one SGLang release the wrapper is written against: it subclasses SGLang's Mooncake
manager and relies on how that release fails a room, keeps its connection tables and
parses a transfer request, which no attribute check can see."""

from __future__ import annotations

import importlib.metadata
import sys

from ..errors import ShmhbError

SUPPORTED = "0.5.23"
HINT = (f"install sglang=={SUPPORTED} (the release shmhb.sglang is tested against), or "
        "unset SHMHB_SGLANG to run SGLang without shmhb")


class UnsupportedRelease(ShmhbError, RuntimeError):
    """SGLang is absent or not the release the wrapper supports."""


def installed() -> str | None:
    """The SGLang version this process runs (its module's, where imported), or None."""
    mod = sys.modules.get("sglang")
    v = getattr(mod, "__version__", None)
    if isinstance(v, str):
        return v
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def refusal(have: str | None) -> str | None:
    """Why a process running SGLang ``have`` (None: none) may not be wrapped, or None."""
    if have == SUPPORTED:
        return None
    return (f"shmhb.sglang supports sglang {SUPPORTED} only; this process runs "
            f"{have or 'no sglang'}: {HINT}")


def check() -> None:
    """``UnsupportedRelease`` naming what to install, unless SGLang is ``SUPPORTED``."""
    why = refusal(installed())
    if why is not None:
        raise UnsupportedRelease(why)
