"""The instance slot ShmhbConnector's worker guard registers for routers
(shmhb.vllm.instance), on a real board, with a stand-in for the inner connector."""

from __future__ import annotations


import pytest

from .conftest import require_vllm

require_vllm()

import shmhb  # noqa: E402
from shmhb.errors import InvalidConfig  # noqa: E402
from shmhb.board.instances import board_instances  # noqa: E402
from shmhb.vllm.instance import register_engine_instance, role_of, routable_bootstrap  # noqa: E402
from shmhb.vllm.settings import FIRST_RANK, ConnectorSettings, Rank, rank_key  # noqa: E402

INNER = {"kv_connector": "MooncakeConnector"}


def settings(**kw: object) -> ConnectorSettings:
    return ConnectorSettings.from_extra_config({"inner": INNER, **kw})


def test_serving_url_is_validated() -> None:
    assert settings(serving_url="http://127.0.0.7:8000/").serving_url == "127.0.0.7:8000"
    assert settings().serving_url is None
    for bad in ("http://a b:1", "https://127.0.0.7", 8000, "http://127.0.0.7"):
        with pytest.raises(InvalidConfig):
            settings(serving_url=bad)


def test_roles_and_the_routable_bootstrap_address() -> None:
    assert role_of(True, False) == "prefill"
    assert role_of(False, True) == "decode"
    assert role_of(True, True) == "both"
    eps = {"engine": "127.0.0.7:17000", "bootstrap": "0.0.0.0:8998"}
    assert routable_bootstrap(eps) == "127.0.0.7:8998"
    assert routable_bootstrap({"engine": "10.0.0.2:1", "bootstrap": "127.0.0.1:8998"}) == "10.0.0.2:8998"
    assert routable_bootstrap({"engine": "10.0.0.2:1", "bootstrap": "10.0.0.3:8998"}) == "10.0.0.3:8998"


def test_the_bootstrap_rank_registers_the_instance_and_closes_it_with_itself(board: shmhb.Board) -> None:
    eps = {"engine": "127.0.0.7:17000", "bootstrap": "127.0.0.7:8998"}
    hb = board.register(rank_key("eng-1", 0, 0, 0), endpoints=tuple(eps.values()), agent=False)
    inst = register_engine_instance(board, hb, eps, FIRST_RANK, "prefill", "eng-1",
                                    settings(serving_url="http://127.0.0.7:8000"))
    assert inst is not None
    (got,) = board_instances(board)
    assert (got.engine, got.role, got.serving, got.bootstrap, got.ranks) == \
        ("eng-1", "prefill", "127.0.0.7:8000", "127.0.0.7:8998", 1)
    # another rank of the engine registers none
    assert register_engine_instance(board, hb, {"engine": "127.0.0.7:17001"},
                                    Rank(dp=0, tp=1, pp=0), "prefill", "eng-1", settings()) is None
    hb.close()
    assert board_instances(board)[0].status is shmhb.Status.LEFT
