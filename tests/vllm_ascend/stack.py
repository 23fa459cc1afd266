"""A prefill host (127.0.0.2) and a decode host (127.0.0.3), each with its own board and
pinger, running vllm-ascend engines (``tests/vllm_ascend/engine.py``): the stack of
``tests/vllm/stack.py`` with the engine program, its environment and the helpers of a
pull connector (the decode side reads, with the transfer params the prefill's
``request_finished`` returned, as a proxy hands them over).

Used by the tests in this folder and by ``python -m bench.vllm_ascend``.  Every wait has
a deadline.
"""

from __future__ import annotations

import os
from typing import Any

from tests.conftest import ROOT, wait_until
from tests.vllm.stack import EngineProc, Stack, new_ids

from shmhb import Status

STUB = os.path.join(ROOT, "tests", "vllm_ascend", "npu_stub")
#: what every engine process runs with: the device stub, vLLM's plugins off (they would
#: activate vllm-ascend's NPU platform), and nothing that may look up a model hub
ENV = {
    "PYTHONPATH": os.pathsep.join([ROOT, STUB, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    "VLLM_PLUGINS": "none",
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9",
    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
}


class AscendStack(Stack):
    def __init__(self, cluster: Any, log_dir: str, *, wrapped: bool,
                 env: dict[str, str] | None = None) -> None:
        super().__init__(cluster, log_dir, wrapped=wrapped, env={**ENV, **(env or {})},
                         inner="ascend")

    def start(self, role: str, engine_id: str | None = None, **kw: Any) -> EngineProc:
        kw.setdefault("module", "tests.vllm_ascend.engine")
        return super().start(role, engine_id, **kw)


def side(p: EngineProc) -> str:
    """The producer's side channel ("host:port"), where its board slot is watched."""
    return p.bootstrap.split("://", 1)[1]


def alive_on(stack: Stack, p: EngineProc, timeout_s: float = 20.0) -> None:
    """Until the decode host's board reads ``p`` ALIVE at its side channel."""
    ep = side(p)
    stack.decode_host.board.watch(ep)
    wait_until(lambda: (s := stack.decode_host.board.remote(ep)) is not None
               and s.status is Status.ALIVE and p.engine_id in s.key,
               timeout_s=timeout_s, what=f"{p.engine_id} alive on the decode host")


def dead_on(stack: Stack, p: EngineProc, timeout_s: float = 10.0) -> None:
    ep = side(p)
    stack.decode_host.board.watch(ep)
    wait_until(lambda: (s := stack.decode_host.board.remote(ep)) is not None
               and s.status in (Status.DEAD, Status.LEFT),
               timeout_s=timeout_s, what=f"{p.engine_id} dead on the decode host")


def prefilled(p: EngineProc, seed: int = 0, prompt: list[int] | None = None
              ) -> tuple[str, dict[str, Any], str]:
    """A request computed and finished on ``p``: its id, the transfer params its
    ``request_finished`` returned (what the decode side pulls with), and the digest of
    its blocks (what a right pull moves)."""
    rid, xid = new_ids()
    ev = p.request("prefill", "prefilled", rid=rid, transfer_id=xid, seed=seed, prompt=prompt)
    p.send("finish", rid=rid)
    return rid, dict(p.expect("finished", rid=rid)["params"]), str(ev["digest"])


def load(d: EngineProc, p: EngineProc, rid: str, params: dict[str, Any]) -> str:
    """Start loading ``rid`` on the hand-driven decode ``d``: "loading" or "vetoed"."""
    d.send("load", rid=rid, transfer_id="-", engine_id=p.engine_id, bootstrap=p.bootstrap,
           params=params)
    return str(d.expect("loading", "vetoed", rid=rid)["ev"])


def params_for(p: EngineProc, rid: str, blocks: list[list[int]] | None = None,
               host_port: tuple[str, int] | None = None) -> dict[str, Any]:
    """Transfer params naming ``p`` for ``rid`` without asking it (a producer that is
    already gone): what its ``request_finished`` would have returned."""
    host, port = host_port or (p.ip, int(side(p).rsplit(":", 1)[1]))
    return {"do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": blocks or [[0, 1, 2]], "remote_engine_id": p.engine_id,
            "remote_request_id": rid, "remote_host": host, "remote_port": port,
            "remote_pcp_size": 1, "remote_dcp_size": 1, "remote_ptp_size": 1,
            "last_token_id": 3, "remote_multi_nodes_meta_mapping": {},
            "num_prompt_blocks": len((blocks or [[0, 1, 2]])[0]),
            "remote_block_size": 32}


