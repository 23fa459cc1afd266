"""One vLLM engine rank, driven by hand: the real connector, no model.

    python -m tests.vllm.engine --role prefill|decode --ip 127.0.0.2 --board NAME
                                [--wrapped] [--engine-id ID] [--bootstrap-port N]
                                [--tp-size N --tp-rank R] [--kv-layout blocks|heads]

What vLLM's engine core and model runner would do around a KV connector, reduced to
what the connector sees: a real ``VllmConfig`` (a tiny llama-style ``config.json``, no
weights, no tokenizer), a real gloo process group (TP/PP lookups: size 1, or one process
per TP rank of the engine, ``--tp-size``/``--tp-rank``), real KV cache tensors on CPU
(each rank holds its share of the KV heads) registered with the connector, real
``Request`` and ``KVCacheBlocks`` objects, and both roles of the connector (scheduler and worker) built
by ``KVConnectorFactory.create_connector`` in this one process.  A step loop stands in
for the model runner: ``build_connector_meta`` -> ``bind_connector_metadata`` ->
``start_load_kv`` -> ``get_finished`` / ``get_block_ids_with_load_errors`` ->
``update_connector_output``, every few milliseconds.

Commands arrive as JSON lines on stdin, events leave as JSON lines on stdout, each
stamped with CLOCK_MONOTONIC (one clock for every process of the machine).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import select
import signal
import threading
import sys
import time
from typing import Any

from .model import BLOCK_SIZE, HEAD_SIZE, NUM_BLOCKS, NUM_KV_HEADS, PROMPT_BLOCKS, kv_rows

MAX_MODEL_LEN = max(1024, PROMPT_BLOCKS * BLOCK_SIZE + 64)
#: the step loop's period: a stand-in model runner steps every few milliseconds
STEP_S = float(os.environ.get("SHMHB_VLLM_STEP_S", "0.005"))
#: the period while the engine has nothing under way (no load waiting, no send to
#: report): a bench that keeps a second pair of engines beside the one it times lets
#: that pair idle instead of spinning on the same cores
IDLE_STEP_S = float(os.environ.get("SHMHB_VLLM_IDLE_STEP_S", str(STEP_S)))
#: a producer stamps each write ("wrote": its start and end), for the bench's stages
TRACE = os.environ.get("SHMHB_VLLM_TRACE") == "1"
#: a wrapped consumer that sends its producers no shmhb field, so they write on the
#: board's word alone, with no go-ahead: unsafe, for the bench's measurement only
NO_GOAHEAD = os.environ.get("SHMHB_VLLM_NO_GOAHEAD") == "1"
#: the consumer's go-ahead lease, where a test shortens it (connector setting grant_lease_s)
GRANT_LEASE_S = os.environ.get("SHMHB_VLLM_GRANT_LEASE_S")
#: how long a SIGTERM drains, where a test shortens it (connector setting drain_timeout_s)
DRAIN_TIMEOUT_S = os.environ.get("SHMHB_VLLM_DRAIN_TIMEOUT_S")

__all__ = ["BLOCK_SIZE", "HEAD_SIZE", "NUM_BLOCKS", "NUM_KV_HEADS", "PROMPT_BLOCKS", "Engine", "build"]
LAYER = "model.layers.0.self_attn.attn"
_CONFIG_CTX: Any = None


def emit(**ev: Any) -> None:
    """One event line; ``t`` is now unless the caller stamped it earlier."""
    ev.setdefault("t", time.monotonic())
    sys.stdout.write(json.dumps(ev) + "\n")
    sys.stdout.flush()


def tiny_model_dir(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": NUM_KV_HEADS * HEAD_SIZE, "intermediate_size": 128,
        "num_attention_heads": NUM_KV_HEADS, "num_key_value_heads": NUM_KV_HEADS,
        "num_hidden_layers": 1, "vocab_size": 256, "max_position_embeddings": MAX_MODEL_LEN,
        "rms_norm_eps": 1e-5, "torch_dtype": "float32", "bos_token_id": 1,
        "eos_token_id": 2, "tie_word_embeddings": False,
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def cpu_stand_ins() -> None:
    """What CPU torch lacks and the connector asks for."""
    import torch
    acc = getattr(torch, "accelerator", None)
    if acc is not None:
        try:
            acc.current_device_index()
        except Exception:  # CPU torch: no accelerator, the connector only logs the index
            acc.current_device_index = lambda: 0


def loopback_bootstrap_server() -> None:
    """Mooncake's bootstrap server binds 0.0.0.0; bind this host's loopback address."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as mc
    base = mc.MooncakeBootstrapServer

    class LoopbackBootstrapServer(base):  # type: ignore[misc, valid-type]
        def __init__(self, host: str, port: int) -> None:
            super().__init__(os.environ["VLLM_HOST_IP"], port)

    mc.MooncakeBootstrapServer = LoopbackBootstrapServer


def kv_cache(layout: str, num_heads: int) -> tuple[Any, int]:
    """One layer's KV cache, as the connector is given it: (blocks, K/V, ...) and the
    bytes of one block's page in one region.

    * ``blocks``: each block one contiguous page ``[K/V, tokens, heads, channels]``;
    * ``heads``: vLLM's CPU layout (LBHNC): a K plane and a V plane, each block's page
      in a plane ``[heads, tokens, channels]``.  Heads are outermost in a page, so a
      rank holding some of the heads fills a contiguous part of a page of a rank
      holding more: what Mooncake needs to move KV between different TP sizes."""
    import torch
    if layout == "blocks":
        cache = torch.zeros(NUM_BLOCKS, 2, BLOCK_SIZE, num_heads, HEAD_SIZE, dtype=torch.float32)
        return cache, cache[0].nbytes
    planes = torch.zeros(2, NUM_BLOCKS, num_heads, BLOCK_SIZE, HEAD_SIZE, dtype=torch.float32)
    return planes.permute(1, 0, 2, 3, 4), planes[0, 0].nbytes


def token_at(layout: str, block: int, pos: int) -> tuple[Any, ...]:
    """The index of one token's KV row (K and V, every head) in a cache of ``layout``
    (see ``kv_cache``): ``cache[token_at(...)]`` is ``[2, heads, channels]`` in both."""
    return (block, slice(None), pos) if layout == "blocks" else \
        (block, slice(None), slice(None), pos)


def layout_of(a: argparse.Namespace) -> str:
    """The cache layout an engine runs with: NIXL asks for LBHNC ("heads")."""
    return "heads" if getattr(a, "inner", "mooncake") == "nixl" else getattr(a, "kv_layout", "blocks")


def build(a: argparse.Namespace) -> Any:
    if NO_GOAHEAD:
        from shmhb.vllm.guard import WorkerGuard
        WorkerGuard.request_extra = lambda self, producer: None  # type: ignore[method-assign]
    import torch
    from vllm.config import (
        CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig,
        SchedulerConfig, VllmConfig,
    )
    from vllm.distributed.parallel_state import (
        ensure_model_parallel_initialized, init_distributed_environment,
    )
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_initialized
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor,
    )

    cpu_stand_ins()
    nixl = getattr(a, "inner", "mooncake") == "nixl"
    if nixl:
        # NIXL on CPU: DRAM segments over UCX, the KV caches registered in place
        inner: dict[str, Any] = {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu",
                                 "kv_connector_extra_config": {"backends": ["UCX"]}}
    else:
        loopback_bootstrap_server()
        inner = {"kv_connector": "MooncakeConnector",
                 "kv_connector_extra_config": {"mooncake_protocol": "tcp", "num_workers": 2}}
    role = "kv_producer" if a.role == "prefill" else "kv_consumer"
    policy = {"kv_load_failure_policy": a.failure_policy} if getattr(a, "failure_policy", None) else {}
    if nixl:
        policy["kv_buffer_device"] = "cpu"
    if a.wrapped:
        extra: dict[str, Any] = {"inner": inner, "board": a.board,
                                 "on_dead_peer": a.on_dead_peer}
        if GRANT_LEASE_S is not None:
            extra["grant_lease_s"] = float(GRANT_LEASE_S)
        if DRAIN_TIMEOUT_S is not None:
            extra["drain_timeout_s"] = float(DRAIN_TIMEOUT_S)
        ktc = KVTransferConfig(kv_connector="ShmhbConnector", kv_connector_module_path="shmhb.vllm",
                               kv_role=role, engine_id=a.engine_id, kv_connector_extra_config=extra,
                               **policy)
    else:
        ktc = KVTransferConfig(kv_connector=inner["kv_connector"], kv_role=role,
                               engine_id=a.engine_id,
                               kv_connector_extra_config=inner["kv_connector_extra_config"], **policy)
    model = ModelConfig(model=tiny_model_dir(a.model_dir), skip_tokenizer_init=True,
                        dtype="float32", max_model_len=MAX_MODEL_LEN)
    tp_size, tp_rank = getattr(a, "tp_size", 1), getattr(a, "tp_rank", 0)
    # No prefix caching: each request's KV comes from its load or its own compute.
    cache = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=False)
    cache.num_gpu_blocks = NUM_BLOCKS
    if nixl:
        cache.kv_cache_layout = "LBHNC"  # what NixlConnector requires: the "heads" layout
    cfg = VllmConfig(model_config=model, cache_config=cache,
                     parallel_config=ParallelConfig(tensor_parallel_size=tp_size),
                     device_config=DeviceConfig("cpu"),
                     scheduler_config=SchedulerConfig(max_model_len=MAX_MODEL_LEN, is_encoder_decoder=False,
                                                      disable_hybrid_kv_cache_manager=True),
                     kv_transfer_config=ktc)
    from vllm.config import set_current_vllm_config
    global _CONFIG_CTX
    _CONFIG_CTX = set_current_vllm_config(cfg)  # kept: the context lives as long as we do
    _CONFIG_CTX.__enter__()
    # one process per TP rank, all in one gloo group (rank 0 hosts its store)
    init_distributed_environment(world_size=tp_size, rank=tp_rank, local_rank=tp_rank,
                                 backend="gloo",
                                 distributed_init_method=f"tcp://{a.ip}:{a.dist_port}")
    ensure_model_parallel_initialized(tp_size, 1)
    heads = NUM_KV_HEADS // tp_size  # this rank's share of the KV heads
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=heads,
                             head_size=HEAD_SIZE, dtype=torch.float32)
    cache, page = kv_cache(layout_of(a), heads)
    nbytes = cache.untyped_storage().nbytes()
    kvc = KVCacheConfig(num_blocks=NUM_BLOCKS,
                        kv_cache_tensors=[KVCacheTensor(size=nbytes, layers=[LAYER],
                                                        layer_stride=nbytes,
                                                        block_stride=page)],
                        kv_cache_groups=[KVCacheGroupSpec([LAYER], spec)])
    # With --scheduler, vLLM's own Scheduler builds the scheduler-role connector
    # (tests/vllm/scheduled.py); the worker's is built the way a vLLM worker builds it.
    sched = None if getattr(a, "scheduler", False) else \
        KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, kvc)
    ensure_kv_transfer_initialized(cfg, kvc)
    worker = get_kv_transfer_group()
    worker.register_kv_caches({LAYER: cache})
    if nixl and sched is not None:
        # what vLLM's engine core does after the workers registered: the scheduler-role
        # side channel serves their agents' metadata to consumers' handshakes
        sched.set_xfer_handshake_metadata_pp_aware({(0, tp_rank): worker.get_handshake_metadata()})
    return cfg, sched, worker, cache, kvc


class Engine:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.cfg, self.sched, self.worker, self.cache, self.kvc = self.build(a)
        self.requests: dict[str, Any] = {}
        self.blocks: dict[str, list[int]] = {}
        self.next_block = 0
        self.waiting: set[str] = set()  # decode: loads not finished yet
        self.sending: set[str] = set()  # prefill: finished, their send not reported yet
        self.step_n = 0
        self.step_cpu_ns = 0  # the steps' CPU, all told (the bench's per-thread view)
        self.hold_writes = False  # prefill: cut the next write in the middle (op "hold_writes")
        #: prefill: stop this process right before its next write (op "stop_before_write"),
        #: after the consumer's go-ahead: a producer stopped in its read-to-write window
        self.stop_before_write = False
        self.nixl = getattr(a, "inner", "mooncake") == "nixl"
        self.layout = layout_of(a)
        if a.role == "prefill" and not self.nixl:
            self._watch_asks()

    def build(self, a: argparse.Namespace) -> Any:
        """The config, both connector roles, the KV cache (an engine of another
        connector family overrides this: tests/vllm_ascend/engine.py)."""
        return build(a)

    def _watch_asks(self) -> None:
        """Tell the test when a consumer's request has reached this producer (read off
        its side channel and dispatched), so a stop can be placed after it."""
        inner = getattr(self.worker, "inner", self.worker)
        w = inner.connector_worker
        send = w.send_kv_to_decode

        async def send_kv_to_decode(identity: bytes, sock: Any, meta: Any) -> None:
            emit(ev="asked", transfer_ids=sorted(x for x, _ in meta.req_blocks.values()))
            await send(identity, sock, meta)

        w.send_kv_to_decode = send_kv_to_decode
        write = w._send_blocks

        def send_blocks(session: str, src: list[int], dst: list[int], lengths: list[int]) -> int:
            # On the sender's thread pool, after the consumer's go-ahead.  With
            # ``hold_writes`` the first half of the descriptors is written and the rest
            # waits (for ever, or until the test kills us): a write cut in the middle.
            if self.stop_before_write:
                self.stop_before_write = False
                emit(ev="stopping_before_write")
                # to this thread (a signal to the process may be taken by another thread
                # while this one runs on into the write): the whole process stops here
                signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
                ret = int(write(session, src, dst, lengths))
                emit(ev="wrote_after_stop", ret=ret)
                return ret
            if not self.hold_writes:
                if not TRACE:
                    return int(write(session, src, dst, lengths))
                t0 = time.monotonic()
                ret = int(write(session, src, dst, lengths))
                emit(ev="wrote", t0=t0, bytes=sum(lengths), ret=ret)
                return ret
            left = sum(lengths) // 2
            s2, d2, l2 = [], [], []
            for a, b, n in zip(src, dst, lengths):
                if left <= 0:
                    break
                s2.append(a)
                d2.append(b)
                l2.append(min(n, left))
                left -= n
            ret = int(write(session, s2, d2, l2))
            emit(ev="half_written", bytes=sum(lengths), written=sum(l2), ret=ret)
            threading.Event().wait()
            return ret

        w._send_blocks = send_blocks

    # -- requests -------------------------------------------------------------------------

    def _alloc(self, rid: str) -> list[int]:
        ids = [(self.next_block + i) % NUM_BLOCKS for i in range(PROMPT_BLOCKS)]
        self.next_block = (self.next_block + PROMPT_BLOCKS) % NUM_BLOCKS
        self.blocks[rid] = ids
        return ids

    def _request(self, rid: str, params: dict[str, Any]) -> Any:
        from vllm import SamplingParams
        from vllm.v1.request import Request
        sp = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params})
        r = Request(rid, list(range(3, 3 + PROMPT_BLOCKS * BLOCK_SIZE)), sp, None)
        self.requests[rid] = r
        return r

    def _kv_blocks(self, ids: list[int]) -> Any:
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        from vllm.v1.core.kv_cache_utils import KVCacheBlock
        return KVCacheBlocks(([KVCacheBlock(i) for i in ids],))

    def prefill(self, rid: str, transfer_id: str, seed: int, prompt: list[int] | None = None) -> None:
        """Producer: the request arrives, is allocated, is computed, and waits to be
        marked finished by ``finish``.  Computed: the stand-in model's KV of ``prompt``
        (tests/vllm/model.py), or without one a random pattern drawn from ``seed``."""
        import torch
        r = self._request(rid, {"do_remote_decode": True, "transfer_id": transfer_id})
        ids = self._alloc(rid)
        self.sched.get_num_new_matched_tokens(r, 0)
        self.sched.update_state_after_alloc(r, self._kv_blocks(ids), 0)
        if prompt is not None:
            rows = torch.from_numpy(kv_rows(prompt, 0))
            for p in range(len(prompt)):
                self.cache[token_at(self.layout, ids[p // BLOCK_SIZE], p % BLOCK_SIZE)] = rows[p]
        else:
            g = torch.Generator().manual_seed(seed)
            for b in ids:
                self.cache[b] = torch.rand(self.cache[b].shape, generator=g) + 1.0
        emit(ev="prefilled", rid=rid, digest=self.digest(ids))

    def finish(self, rid: str) -> None:
        from vllm.v1.request import RequestStatus
        r = self.requests[rid]
        r.status = RequestStatus.FINISHED_LENGTH_CAPPED
        delay, params = self.sched.request_finished(r, self.blocks[rid])
        if delay:
            self.sending.add(rid)
        # (NIXL: what the decode side needs to read the blocks, handed over by a proxy)
        emit(ev="finished", rid=rid, delay_free=delay, params=params)

    def load(self, rid: str, transfer_id: str, engine_id: str, bootstrap: str,
             params: dict[str, Any] | None = None) -> None:
        """Consumer: ask the connector how much to load, allocate, start the load.
        ``params``: the producer's own (NIXL's, from its ``request_finished``)."""
        r = self._request(rid, {**params, "do_remote_prefill": True, "do_remote_decode": False}
                          if params else {"do_remote_prefill": True, "transfer_id": transfer_id,
                                          "remote_engine_id": engine_id,
                                          "remote_bootstrap_addr": bootstrap})
        t0 = time.perf_counter_ns()
        n, is_async = self.sched.get_num_new_matched_tokens(r, 0)
        cost_ns = time.perf_counter_ns() - t0
        ids = self._alloc(rid)
        self.cache[ids] = 0.0
        if n == 0:
            emit(ev="vetoed", rid=rid, cost_ns=cost_ns)
            self.sched.update_state_after_alloc(r, self._kv_blocks([]), 0)
            return
        self.sched.update_state_after_alloc(r, self._kv_blocks(ids), n)
        self.waiting.add(rid)
        emit(ev="loading", rid=rid, tokens=n, is_async=is_async, cost_ns=cost_ns)

    def cost(self, engine_id: str, bootstrap: str, n: int) -> dict[str, float]:
        """ns per call (p50 and p99) of the scheduler's per-request call and the
        worker's per-step calls.  Wrapped, each per-step call is also timed on the inner
        connector alone, interleaved with the wrapped call in this one process, so
        ``*_added`` is the wrapper's own cost per step, not a difference of two runs."""
        import numpy as np
        r = self._request("cost-probe", {"do_remote_prefill": True, "transfer_id": "x",
                                         "remote_engine_id": engine_id,
                                         "remote_bootstrap_addr": bootstrap})
        out: dict[str, float] = {}

        def timed(fn: Any) -> int:
            t0 = time.perf_counter_ns()
            fn()
            return time.perf_counter_ns() - t0

        def put(name: str, ts: list[int]) -> None:
            out[name] = float(np.percentile(ts, 50))
            out[name + "_p99"] = float(np.percentile(ts, 99))

        put("get_num_new_matched_tokens",
            [timed(lambda: self.sched.get_num_new_matched_tokens(r, 0)) for _ in range(n)])
        inner = getattr(self.worker, "inner", None)
        for call in ("get_finished", "get_transfer_results"):
            outer_fn = getattr(self.worker, call)
            inner_fn = getattr(inner, call, None)
            outer, alone = [], []
            for _ in range(n):
                outer.append(timed(lambda: outer_fn(set())))
                if inner_fn is not None:
                    alone.append(timed(lambda: inner_fn(set())))
            put(call, outer)
            if alone:
                put(call + "_inner", alone)
                put(call + "_added", [a - b for a, b in zip(outer, alone)])
        guard = getattr(self.worker, "guard", None)
        if guard is not None:
            params = r.kv_transfer_params
            put("wrapper_veto_read", [timed(lambda: self.sched.veto_reason(params)) for _ in range(n)])
            put("wrapper_poll", [timed(guard.poll) for _ in range(n)])
        self.requests.pop("cost-probe", None)
        return out

    def judges(self) -> int:
        """How often the wrapper's reaper looked at the whole board (0 unwrapped)."""
        reaper = getattr(getattr(self.worker, "guard", None), "reaper", None)
        return int(getattr(reaper, "judges", 0))

    def digest(self, ids: list[int]) -> str:
        return hashlib.sha256(self.cache[ids].numpy().tobytes()).hexdigest()[:16]

    # -- the step loop --------------------------------------------------------------------

    def step(self) -> None:
        from vllm.v1.core.sched.output import SchedulerOutput
        from vllm.v1.outputs import KVConnectorOutput
        self.step_n += 1
        so = SchedulerOutput.make_empty()
        meta = self.sched.build_connector_meta(so)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)
        sending, recving = self.worker.get_finished(set())
        bad = self.worker.get_block_ids_with_load_errors()
        self.worker.clear_connector_metadata()
        self.sched.update_connector_output(KVConnectorOutput(
            finished_sending=sending, finished_recving=recving, invalid_block_ids=bad))
        # A load's blocks may be reported invalid in an earlier step than the load
        # finishes (one decode rank pulling from several producer ranks: the first to
        # fail reports them, the last to settle finishes it); vLLM's scheduler keeps
        # them (failed_recving_kv_req_ids), so does this stand-in.
        invalid = self.__dict__.setdefault("invalid", set())
        invalid |= bad
        for rid in sorted(recving or ()):
            ids = self.blocks.get(rid, [])
            failed = bool(invalid & set(ids))
            invalid -= set(ids)
            self.waiting.discard(rid)
            # stamped before the digest: hashing the blocks is no part of the transfer
            # (the bench reads loading -> loaded from these stamps)
            t = time.monotonic()
            emit(ev="load_failed" if failed else "loaded", rid=rid, t=t,
                 digest=self.digest(ids) if ids else "")
        for rid in sorted(sending or ()):
            self.sending.discard(rid)
            emit(ev="sent", rid=rid)

    def handle(self, cmd: dict[str, Any]) -> bool:
        op = cmd["op"]
        if op == "prefill":
            self.prefill(cmd["rid"], cmd["transfer_id"], cmd.get("seed", 0), cmd.get("prompt"))
        elif op == "finish":
            self.finish(cmd["rid"])
        elif op == "load":
            self.load(cmd["rid"], cmd["transfer_id"], cmd["engine_id"], cmd["bootstrap"],
                      cmd.get("params"))
        elif op == "digest":
            emit(ev="digest", rid=cmd["rid"], digest=self.digest(self.blocks[cmd["rid"]]))
        elif op == "digest_all":
            emit(ev="digest_all", digest=self.digest(list(range(NUM_BLOCKS))))
        elif op == "inner":
            emit(ev="inner", **inner_state(self.worker))
        elif op == "stats":
            s = self.worker.get_kv_connector_stats()
            emit(ev="stats", data=None if s is None else s.to_dict())
        elif op == "cost":
            emit(ev="cost", **self.cost(cmd["engine_id"], cmd["bootstrap"], cmd.get("n", 2000)))
        elif op == "cpu":  # from the main thread: its CPU, the whole process's, each thread's
            emit(ev="cpu", process_ns=time.process_time_ns(), main_ns=time.thread_time_ns(),
                 steps=self.step_n, step_ns=self.step_cpu_ns, judges=self.judges(),
                 threads=thread_cpu())
        elif op == "asks":  # producer: how its go-ahead answers were read
            guard = getattr(self.worker, "guard", None)
            emit(ev="asks", counts=guard.ask_counts() if guard is not None else {})
        elif op == "hold_writes":
            self.hold_writes = True
            emit(ev="holding")
        elif op == "stop_before_write":
            self.stop_before_write = True
            emit(ev="will_stop")
        elif op == "quit":
            self.worker.shutdown()
            emit(ev="bye")
            return False
        else:
            emit(ev="error", msg=f"unknown op {op!r}")
        return True

    def run(self) -> None:
        try:
            self._loop()
        except SystemExit:  # SIGTERM (``on_sigterm``): vLLM's engine core shuts down
            self.worker.shutdown()
            emit(ev="bye", why="sigterm")
            raise

    def _loop(self) -> None:
        emit(ev="ready", pid=os.getpid(), engine_id=self.a.engine_id)
        buf = b""
        fd = sys.stdin.fileno()
        while True:
            busy = self.waiting or self.sending
            r, _, _ = select.select([fd], [], [], STEP_S if busy else IDLE_STEP_S)
            if r:
                chunk = os.read(fd, 65536)
                if not chunk:
                    return
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if line.strip() and not self.handle(json.loads(line)):
                        return
            if TRACE:  # (a thread CPU clock read costs about 1.6 µs here)
                t = time.thread_time_ns()
                self.step()
                self.step_cpu_ns += time.thread_time_ns() - t
            else:
                self.step()


def thread_cpu() -> dict[str, int]:
    """CPU so far (ns) of this process's threads, summed by name: a Python thread's own,
    else the kernel's (``comm``), read off each thread's CPU clock (Linux: the clock id
    of thread ``tid`` is ``~tid << 3 | 6``)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, int] = {}
    for entry in os.listdir("/proc/self/task"):
        tid = int(entry)
        try:
            name = names.get(tid)
            if name is None:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    name = f.read().strip()
            ns = time.clock_gettime_ns((~tid << 3) | 6)
        except OSError:  # the thread ended meanwhile
            continue
        name = re.sub(r"[-_]\d+", "", name)  # "Thread-3 (run)" -> "Thread (run)"
        out[name] = out.get(name, 0) + ns
    return out


def inner_state(worker: Any) -> dict[str, Any]:
    """What the inner worker caches about peers (for the leak assertions): Mooncake's
    or NIXL's (``reqs_need_send``: the sends it holds blocks for)."""
    inner = getattr(worker, "inner", worker)
    w = inner.connector_worker
    sends = getattr(w, "reqs_need_send", None)
    if sends is None:
        sends = getattr(w, "_reqs_to_send", {})
    return {"remote_agents": sorted(w._remote_agents), "tp_size": sorted(getattr(w, "_tp_size", ())),
            "reqs_need_send": sorted(sends),
            "prepared_regions": len(getattr(w, "_prepared_transfer_regions", ()))}


def arg_parser() -> argparse.ArgumentParser:
    """The options every engine child takes (tests/vllm_ascend/engine.py adds its own)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=("prefill", "decode"), required=True)
    ap.add_argument("--ip", required=True)
    ap.add_argument("--board", required=True)
    ap.add_argument("--engine-id", required=True)
    ap.add_argument("--dist-port", type=int, required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--wrapped", action="store_true")
    ap.add_argument("--on-dead-peer", default="recompute")
    ap.add_argument("--failure-policy", choices=("fail", "recompute"), default=None,
                    help="vLLM's kv_load_failure_policy (default: vLLM's own)")
    ap.add_argument("--scheduler", action="store_true",
                    help="drive the connector through vLLM's real Scheduler (tests/vllm/scheduled.py)")
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--tp-rank", type=int, default=0)
    return ap


def set_up(a: argparse.Namespace) -> None:
    """What every engine child sets before vLLM is imported: its host's address and
    board, and logging to stderr (the test's log of the engine)."""
    os.environ["VLLM_HOST_IP"] = a.ip
    os.environ["SHMHB_BOARD"] = a.board
    import logging
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


def on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM as vLLM's engine core takes it (``run_engine_core``, installed before the
    engine, and so its connector, is built): the busy loop ends, the engine shuts down."""
    raise SystemExit(0)


def main() -> None:
    signal.signal(signal.SIGTERM, on_sigterm)
    ap = arg_parser()
    ap.add_argument("--kv-layout", choices=("blocks", "heads"), default="blocks")
    ap.add_argument("--inner", choices=("mooncake", "nixl"), default="mooncake",
                    help="the connector under test (nixl: NixlConnector, UCX on CPU)")
    a = ap.parse_args()
    set_up(a)
    os.environ["VLLM_DP_MASTER_IP"] = a.ip  # where the bootstrap server is registered with
    if a.inner == "nixl":  # the scheduler-role side channel consumers handshake with
        os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = a.ip
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = os.environ["VLLM_MOONCAKE_BOOTSTRAP_PORT"]
    if a.scheduler:
        from .scheduled import ScheduledEngine
        ScheduledEngine(a).run()
    else:
        Engine(a).run()


if __name__ == "__main__":
    main()
