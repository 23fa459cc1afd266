"""A decode engine driven through vLLM's real ``Scheduler`` (``--scheduler``).

What an engine core does around a KV connector, with the model replaced by the
deterministic stand-in of ``tests/vllm/model.py``:

* requests go to ``Scheduler.add_request``; ``Scheduler.schedule()`` asks the
  scheduler-role connector (which the Scheduler builds itself, as in vLLM) how much to
  load, allocates blocks in its real ``KVCacheManager``, and builds the connector
  metadata;
* the worker-role connector runs inside vLLM's own ``KVConnectorModelRunnerMixin``
  context (bind, start_load_kv, get_transfer_results, get_block_ids_with_load_errors,
  stats, clear), exactly as vLLM's model runners call it;
* the "forward" writes each scheduled token's KV (``model.kv_rows``) into the blocks
  the KVCacheManager gave the request, and samples ``model.next_token`` of the request's
  whole KV once every known token is computed;
* ``Scheduler.update_from_output`` takes the result, so a failed load is handled by
  vLLM's own policy (``kv_load_failure_policy``): the request is recomputed or finished
  as an error.

Events: ``served`` (rid, tokens, finish_reason, added_t, t) when a request finishes;
``blocks`` (free blocks and live requests of the KVCacheManager).
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from .engine import Engine, emit, token_at
from .model import BLOCK_SIZE, kv_rows, next_token


class ScheduledEngine(Engine):
    def __init__(self, a: argparse.Namespace) -> None:
        assert a.role == "decode", "only the decode side runs the real Scheduler here"
        super().__init__(a)
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager
        self.scheduler = Scheduler(vllm_config=self.cfg, kv_cache_config=self.kvc,
                                   structured_output_manager=StructuredOutputManager(self.cfg),
                                   block_size=BLOCK_SIZE, log_stats=True)
        self.sched = self.scheduler.connector  # the scheduler-role connector vLLM built
        self.free_at_start = self.free_blocks()
        # What the Scheduler takes from its connector each step (vLLM's stats logger
        # gets it), summed for the test: the wrapper's veto counts are in it.
        self.sched_counts: dict[str, int] = {}
        take = self.sched.get_kv_connector_stats

        def get_kv_connector_stats() -> Any:
            st = take()
            for k, v in ((st.data or {}).get("shmhb", {}) if st is not None else {}).items():
                self.sched_counts[k] = self.sched_counts.get(k, 0) + v
            return st
        self.sched.get_kv_connector_stats = get_kv_connector_stats
        self.out: dict[str, list[int]] = {}
        self.added: dict[str, float] = {}

    def free_blocks(self) -> int:
        return int(self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks())

    # -- requests -------------------------------------------------------------------------

    def serve(self, rid: str, prompt: list[int], max_tokens: int,
              params: dict[str, Any] | None) -> None:
        import time

        from vllm import SamplingParams
        from vllm.v1.request import Request
        extra = {"kv_transfer_params": params} if params else None
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra)
        self.scheduler.add_request(Request(rid, list(prompt), sp, None))
        self.out[rid] = []
        self.added[rid] = time.monotonic()
        emit(ev="added", rid=rid)

    # -- the step: schedule, "forward" inside vLLM's connector context, update --------------

    def step(self) -> None:
        from vllm.forward_context import set_forward_context
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin as M
        self.step_n += 1
        so = self.scheduler.schedule()
        if so.total_num_scheduled_tokens == 0:
            mro = M.kv_connector_no_forward(so, self.cfg)
        else:
            with set_forward_context(None, self.cfg), M.maybe_get_kv_connector_output(so) as kvo:
                req_ids, sampled = self.forward(so)
            mro = ModelRunnerOutput(req_ids=req_ids,
                                    req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                    sampled_token_ids=sampled, kv_connector_output=kvo)
        for outs in self.scheduler.update_from_output(so, mro).values():
            for o in outs.outputs:
                self.out.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    emit(ev="served", rid=o.request_id, tokens=self.out.pop(o.request_id),
                         finish_reason=o.finish_reason.name.lower(),
                         added_t=self.added.pop(o.request_id, None))

    def forward(self, so: Any) -> tuple[list[str], list[list[int]]]:
        """The stand-in model over one scheduled batch."""
        import torch
        starts = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        req_ids, sampled = [], []
        for rid, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            blocks = self.scheduler.kv_cache_manager.get_block_ids(rid)[0]
            start = starts[rid]
            tokens = req.all_token_ids
            rows = torch.from_numpy(kv_rows(list(tokens[start:start + n]), start))
            for i in range(n):
                p = start + i
                self.cache[token_at(self.layout, blocks[p // BLOCK_SIZE], p % BLOCK_SIZE)] = rows[i]
            req_ids.append(rid)
            if start + n < req.num_tokens:
                sampled.append([])  # a chunk of the prompt: nothing to sample yet
                continue
            kv = np.stack([self.cache[token_at(self.layout, blocks[p // BLOCK_SIZE],
                                               p % BLOCK_SIZE)].numpy() for p in range(start + n)])
            sampled.append([next_token(kv)])
        return req_ids, sampled

    def handle(self, cmd: dict[str, Any]) -> bool:
        op = cmd["op"]
        if op == "serve":
            self.serve(cmd["rid"], cmd["prompt"], cmd.get("max_tokens", 4), cmd.get("params"))
        elif op == "blocks":
            emit(ev="blocks", free=self.free_blocks(), at_start=self.free_at_start,
                 requests=len(self.scheduler.requests),
                 policy=self.cfg.kv_transfer_config.kv_load_failure_policy,
                 recompute=bool(self.scheduler.recompute_kv_load_failures))
        elif op == "sched_stats":
            emit(ev="sched_stats", data=self.sched_counts)
            self.sched_counts = {}
        elif op in ("load", "cost"):
            emit(ev="error", msg=f"{op!r} drives the connector by hand: not with --scheduler")
        else:
            return super().handle(cmd)
        return True
