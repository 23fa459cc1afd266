"""What stock SGLang 0.5.23 does in the scenarios the wrapper fixes, measured on the same
stack (``SHMHB_SGLANG=0``: the plugin loads and installs nothing).  They make the wrapped
tests' deadlines mean something: each stock figure is far past them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from .conftest import make_stack, require_sglang

require_sglang()

from .stack import Stack, new_room  # noqa: E402
from .test_scenarios import FAST_S, served  # noqa: E402

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def stack(tmp_path_factory: Any) -> Iterator[Stack]:
    yield from make_stack(tmp_path_factory, wrapped=False)


def test_stock_prefill_killed_while_the_decode_waits_fails_at_the_health_check(
        stack: Stack) -> None:
    p, d = stack.start("prefill"), stack.start("decode")
    assert d.ready["manager"] == "sglang.srt.disaggregation.mooncake.conn"
    served(p, d)
    room = new_room()
    p.send("prefill", room=room, seed=2, hold=True)
    d.send("recv", room=room, bootstrap=p.bootstrap)
    p.expect("waiting", room=room)
    t_kill = p.kill()
    ev = d.expect("recv_failed", room=room, timeout_s=60)
    print(f"stock: room failed {ev['t'] - t_kill:.3f} s after the kill: {ev['reason']}")
    assert ev["t"] - t_kill > FAST_S + 3, "stock SGLang failed as fast as the wrapper?"
    assert "Lost connection with prefill" in ev["reason"], ev
