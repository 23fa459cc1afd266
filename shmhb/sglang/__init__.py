"""shmhb inside SGLang's P/D: the Mooncake transfer backend's manager and receiver,
wrapped so that a dead, stopped or restarted peer fails its rooms within milliseconds of
the board's verdict instead of SGLang's HTTP health polls (see docs/SGLANG.md).

**How it gets into every process.**  SGLang 0.5.23 loads the ``sglang.srt.plugins``
entry points in every scheduler process it starts (``load_plugins()``, before the KV
manager is built), and shmhb registers ``register`` there: no launcher, no
``sitecustomize``, and nothing to change in how the server is started.  Installed
plugins are always loaded, so the wrapper is switched on by configuration,
``SHMHB_SGLANG=1`` in the server's environment (settings: ``shmhb.sglang.settings``).
SGLang only logs a plugin that raises and carries on, so a wrapper asked for on another
SGLang release does not raise from ``register``: it installs a manager that refuses to
start, naming what to install, and the server fails at startup instead of running
unwrapped.

Importing this package imports no SGLang; ``install`` does.  ``import shmhb`` never does.
"""

from __future__ import annotations

import logging
from typing import Any

from .release import SUPPORTED, UnsupportedRelease, check
from .settings import enabled

__all__ = ["SUPPORTED", "install", "register", "shutdown"]

log = logging.getLogger(__name__)


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: installs the wrapper when
    ``SHMHB_SGLANG=1``, or a refusal on an unsupported release."""
    if not enabled():
        return
    try:
        install()
    except UnsupportedRelease as e:
        log.error("shmhb: %s", e)
        _refuse(str(e))


def install() -> None:
    """Put the wrapped manager and receiver where ``get_kv_class`` finds them
    (``UnsupportedRelease`` on any SGLang but ``SUPPORTED``)."""
    check()
    import sglang.srt.disaggregation.mooncake as mooncake

    from .manager import ShmhbMooncakeKVManager, ShmhbMooncakeKVReceiver
    mooncake.MooncakeKVManager = ShmhbMooncakeKVManager
    mooncake.MooncakeKVReceiver = ShmhbMooncakeKVReceiver
    log.info("shmhb: SGLang %s's Mooncake backend is wrapped in this process", SUPPORTED)


def shutdown() -> None:
    """Every wrapped rank of this process leaves its board (peers read LEFT at once)."""
    import sys
    manager = sys.modules.get(f"{__name__}.manager")
    if manager is not None:
        manager.close_all()


def _refuse(why: str) -> None:
    import sglang.srt.disaggregation.mooncake as mooncake

    class RefusedMooncakeKVManager:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise UnsupportedRelease(why)

    mooncake.MooncakeKVManager = RefusedMooncakeKVManager
