"""With smg 1.13.0 in front of SGLang's own P/D (``bench.sglang_smg``'s stack: prefills
p1, p2 and a decode d1, each rank process with its HTTP front), wrapped and fed by
``shmhb feed``: a killed or stopped prefill costs the client no request (stopped is the
case smg's own retries do not cover: stock, half the requests after the stop fail,
bench/results_sglang_smg.md)."""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import isolate, require_sglang

require_sglang()

pytestmark = pytest.mark.system


@pytest.mark.parametrize("scenario", ["killed", "stopped"])
def test_a_killed_or_stopped_prefill_costs_the_client_nothing_behind_smg(
        tmp_path: Any, scenario: str) -> None:
    from bench.sglang_smg import measure
    from tests.routers.stack import router_binary
    assert router_binary("smg") is not None, "smg not installed: pip install smg==1.13.0"
    isolate()
    o = measure(scenario, True, window_s=3.0, rate_hz=20.0, tmp=str(tmp_path))
    print(f"wrapped + fed, p1 {scenario}: {o}")
    assert o.sent >= 40, o  # the client kept sending through the window
    assert o.failed == 0, o
