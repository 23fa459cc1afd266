"""SGLang's own P/D on its Mooncake backend: SGLang 0.5.23's real disaggregation classes,
the real Mooncake transfer engine (TCP), CPU only, with one stand-in (an import-time
``torchvision``, ``torchvision_stub/``).

Skipped when SGLang is absent (it lives in a venv of its own, built by the project's
script, which then runs this folder; CI does the same):

    bash .ci/sglang DIR             # or: bash .ci/sglang DIR --install, then
    . DIR/venv/bin/activate && python -m pytest -q tests/sglang

``SHMHB_REQUIRE_SGLANG=1`` (set by that script) turns a missing package into a failure.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from typing import Any

import pytest

HOW = ("sglang 0.5.23 not installed: run tests/sglang in its own venv (bash .ci/sglang DIR; "
       "see tests/sglang/conftest.py)")


def require_sglang() -> None:
    """At the top of each test module here: skip it with the reason above when SGLang or
    Mooncake is absent; with ``SHMHB_REQUIRE_SGLANG=1`` absent is a failure."""
    if os.environ.get("SHMHB_REQUIRE_SGLANG"):
        for mod in ("sglang", "mooncake.engine"):
            if importlib.util.find_spec(mod.split(".")[0]) is None:
                pytest.fail(f"{mod} not installed, and SHMHB_REQUIRE_SGLANG is set")
        return
    for mod in ("sglang", "mooncake"):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(HOW, allow_module_level=True)


def isolate() -> None:
    """As root, move this test process (and so every rank and pinger it starts) into a
    network namespace with nothing but loopback; any other user runs with the hubs'
    offline switches alone (``shmhb.testing.loopback.OFFLINE_ENV``, set in every rank)."""
    from tests.routers.stack import only_loopback, private_network
    if private_network():
        assert only_loopback()
    elif os.geteuid() == 0:
        pytest.fail("running as root, yet not in a network namespace of loopback only")


def make_stack(tmp_path_factory: Any, *, wrapped: bool) -> Iterator[Any]:
    from tests.conftest import Procs
    from tests.hosts import Cluster

    from .stack import Stack
    isolate()
    tmp = str(tmp_path_factory.mktemp("sglang-wrapped" if wrapped else "sglang-stock"))
    procs = Procs()
    cluster = Cluster(tmp, procs)
    s = Stack(cluster, tmp, wrapped=wrapped)
    try:
        yield s
    finally:
        try:
            s.close()
        finally:
            procs.cleanup()
            cluster.close()
