"""The real routers' stage: vllm-router, sglang-router and smg (Rust extensions in Python
packages, CPU only) in PD mode on loopback, in front of stand-in prefill and decode
instances that register on their host's board as ShmhbConnector does.

Skipped when the router packages are absent.  To run them (the routers stage of .ci/run
does exactly this):

    python3 -m venv .venv-routers && . .venv-routers/bin/activate
    pip install -e '.[test,routers]' && python -m pytest -q tests/routers
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from .stack import PdStack, only_loopback, private_network, router_binary

HOW = ("router packages not installed: run tests/routers in their own venv "
       "(pip install '.[test,routers]'; see tests/routers/conftest.py, or .ci/run)")


def require_router(kind: str) -> None:
    """Skip with a clear reason when the router is absent; in CI's routers stage
    (``SHMHB_REQUIRE_ROUTERS=1``) absent is a failure."""
    if router_binary(kind) is None:
        if os.environ.get("SHMHB_REQUIRE_ROUTERS"):
            pytest.fail(f"{kind} router not installed, and SHMHB_REQUIRE_ROUTERS is set")
        pytest.skip(HOW)


def isolate() -> None:
    """As root, move this test process (and so every router, stand-in and pinger it
    starts) into a network namespace with nothing but loopback, so nothing can leave the
    host even if a router tries; any other user runs with the hubs' offline switches
    alone (``shmhb.testing.loopback.OFFLINE_ENV``).  The namespace lasts as long as the process: the
    tests after these run in it too, and need nothing but loopback either."""
    if private_network():
        assert only_loopback()
    elif os.geteuid() == 0:
        pytest.fail("running as root, yet not in a network namespace of loopback only")


@pytest.fixture
def stack(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[PdStack]:
    """Hosts with boards and agents, in a private network namespace where the test runs as
    root; skips first when the test's router is absent.  At the end, every router's log
    must show no attempt to reach a model hub."""
    callspec = getattr(request.node, "callspec", None)
    require_router(callspec.params.get("kind", "vllm") if callspec else "vllm")
    isolate()
    s = PdStack(str(tmp_path))
    try:
        yield s
    finally:
        s.close()
    assert s.hub_lookups() == {}, f"a router tried to reach a model hub: {s.hub_lookups()}"
