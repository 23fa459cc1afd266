"""One vllm-ascend engine rank on a CPU machine, driven by hand: vllm-ascend 0.23's own
``MooncakeConnectorV1`` (both roles) over vLLM 0.23, no model, no NPU.

    python -m tests.vllm_ascend.engine --role prefill|decode --ip 127.0.0.2 --board NAME ...

The engine of ``tests/vllm/engine.py`` (the same commands, events and step loop, and
``--scheduler`` for vLLM's real Scheduler on the decode side), with what vllm-ascend needs
to run here, none of it in the connector's code:

* the device layer: ``torch_npu`` is the stub in ``npu_stub/`` (on ``PYTHONPATH`` for
  these processes only);
* the transport: the connector asks Mooncake for its "ascend" transport (HCCS/RoCE
  between NPUs); here the transfer engine it gets moves the same bytes over TCP;
* the platform: vLLM would activate vllm-ascend's NPU platform (its plugin); the engine
  runs with ``VLLM_PLUGINS=none`` and vLLM's CPU platform, registers vllm-ascend's
  connectors itself and initialises its config (``init_ascend_config``), as its platform
  would.

The producer's side channel (where consumers ask for its metadata and report a pull
done) is ``kv_port``: ``VLLM_MOONCAKE_BOOTSTRAP_PORT`` as the stack hands it out.
"""

from __future__ import annotations

import argparse
import os
import threading
from typing import Any

from tests.vllm import engine as base
from tests.vllm.engine import LAYER, MAX_MODEL_LEN, emit, kv_cache, tiny_model_dir
from tests.vllm.model import BLOCK_SIZE, HEAD_SIZE, NUM_BLOCKS, NUM_KV_HEADS

CONNECTOR = "MooncakeConnectorV1"


def tcp_transfer_engine() -> None:
    """The connector's transfer engine, over TCP: vllm-ascend asks for protocol "ascend"
    (NPU links); the same engine with Mooncake's TCP transport moves the bytes here.
    vllm-ascend imports ``mooncake.engine.TransferEngine`` lazily, when it makes its one
    engine: this replaces the class before that."""
    import mooncake.engine as me
    real = me.TransferEngine
    if getattr(real, "shmhb_tcp", False):
        return

    class TcpTransferEngine:
        shmhb_tcp = True

        def __init__(self) -> None:
            self._engine = real()

        def initialize(self, hostname: str, metadata: str, protocol: str, device: str) -> int:
            return int(self._engine.initialize(hostname, metadata, "tcp", ""))

        def __getattr__(self, name: str) -> Any:
            return getattr(self._engine, name)

    me.TransferEngine = TcpTransferEngine  # type: ignore[misc]


def cpu_platform() -> None:
    """vLLM's CPU platform, with vllm-ascend's connectors registered (what its platform
    plugin would do, without its NPU platform)."""
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform
    platforms._current_platform = CpuPlatform()
    from vllm_ascend.distributed.kv_transfer import register_connector
    register_connector()
    try:
        from shmhb.vllm import register
        register()  # the entry point vLLM's plugins would load (VLLM_PLUGINS=none here)
    except ImportError:
        pass


def build(a: argparse.Namespace) -> Any:
    import torch_npu  # noqa: F401  (the stub: sets torch.npu before vllm-ascend imports)
    import torch
    base.cpu_stand_ins()
    cpu_platform()
    tcp_transfer_engine()
    from vllm.config import (
        CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig,
        SchedulerConfig, VllmConfig, set_current_vllm_config,
    )
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_initialized
    from vllm.distributed.parallel_state import (
        ensure_model_parallel_initialized, init_distributed_environment,
    )
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor,
    )
    from vllm_ascend.ascend_config import init_ascend_config

    kv_port = int(os.environ["VLLM_MOONCAKE_BOOTSTRAP_PORT"])
    sizes = {"prefill": {"tp_size": 1, "dp_size": 1}, "decode": {"tp_size": 1, "dp_size": 1}}
    inner: dict[str, Any] = {"kv_connector": a.connector, "kv_port": kv_port,
                             "kv_connector_extra_config": sizes}
    role = "kv_producer" if a.role == "prefill" else "kv_consumer"
    policy = {"kv_load_failure_policy": a.failure_policy} if a.failure_policy else {}
    if a.wrapped:
        extra = {"inner": inner, "board": a.board, "on_dead_peer": a.on_dead_peer}
        ktc = KVTransferConfig(kv_connector="ShmhbConnector", kv_connector_module_path="shmhb.vllm",
                               kv_role=role, engine_id=a.engine_id, kv_port=kv_port,
                               kv_connector_extra_config=extra, **policy)
    else:
        ktc = KVTransferConfig(kv_connector=a.connector, kv_role=role, engine_id=a.engine_id,
                               kv_port=kv_port, kv_connector_extra_config=sizes, **policy)
    model = ModelConfig(model=tiny_model_dir(a.model_dir), skip_tokenizer_init=True,
                        dtype="float32", max_model_len=MAX_MODEL_LEN)
    cache = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=False)
    cache.num_gpu_blocks = NUM_BLOCKS
    cfg = VllmConfig(model_config=model, cache_config=cache,
                     parallel_config=ParallelConfig(tensor_parallel_size=1),
                     device_config=DeviceConfig("cpu"),
                     scheduler_config=SchedulerConfig(max_model_len=MAX_MODEL_LEN,
                                                      is_encoder_decoder=False,
                                                      disable_hybrid_kv_cache_manager=True),
                     kv_transfer_config=ktc)
    init_ascend_config(cfg)
    ctx = set_current_vllm_config(cfg)  # held for the process's life
    ctx.__enter__()
    base._CONFIG_CTX = ctx
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://{a.ip}:{a.dist_port}")
    ensure_model_parallel_initialized(1, 1)
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS,
                             head_size=HEAD_SIZE, dtype=torch.float32)
    kv, _ = kv_cache("blocks", NUM_KV_HEADS)
    nbytes = kv.untyped_storage().nbytes()
    kvc = KVCacheConfig(num_blocks=NUM_BLOCKS,
                        kv_cache_tensors=[KVCacheTensor(size=nbytes, shared_by=[LAYER])],
                        kv_cache_groups=[KVCacheGroupSpec([LAYER], spec)])
    sched = None if a.scheduler else \
        KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, kvc)
    ensure_kv_transfer_initialized(cfg, kvc)
    worker = get_kv_transfer_group()
    worker.register_kv_caches({LAYER: kv})
    return cfg, sched, worker, kv, kvc


Descs = tuple[list[int], list[int], list[int]]


def halves(src: list[int], dst: list[int], lengths: list[int]) -> tuple[Descs, Descs]:
    """A read's descriptors (local address, remote address, length) cut at half its bytes:
    the first half and the rest."""
    left = sum(lengths) // 2
    first: Descs = ([], [], [])
    rest: Descs = ([], [], [])
    for a, b, n in zip(src, dst, lengths):
        take = min(n, max(left, 0))
        for part, (x, y, m) in ((first, (a, b, take)), (rest, (a + take, b + take, n - take))):
            if m:
                part[0].append(x)
                part[1].append(y)
                part[2].append(m)
        left -= take
    return first, rest


def inner_state(worker: Any) -> dict[str, Any]:
    """What the consumer's receiving thread caches about producers (for the leak checks):
    its per-engine tables and its pooled sockets."""
    inner = getattr(worker, "inner", worker)
    w = inner.connector_worker
    recv = w.kv_recv_thread
    if recv is None:
        send = w.kv_send_thread
        return {"remote_engines": [], "sockets": 0,
                "to_process": sorted(send.task_tracker.reqs_to_process) if send else []}
    engines = sorted(e for e in recv.kv_caches_base_addr if e != recv.local_engine_id)
    return {"remote_engines": engines, "te_ports": sorted(recv.remote_te_port),
            "sockets": sum(len(q) for q in recv.remote_sockets.values()),
            "to_process": sorted(recv.task_tracker.reqs_to_process)}


class AscendEngine(base.Engine):
    def __init__(self, a: argparse.Namespace) -> None:
        super().__init__(a)
        if a.role == "decode":
            self._watch_reads()

    def build(self, a: argparse.Namespace) -> Any:
        return build(a)

    def _watch_reads(self) -> None:
        """Tell the test when a pull starts reading (its Mooncake read is called); with
        ``hold_reads`` the first half of the bytes is read, ``half_read`` is told, and the
        rest waits for ``release_reads``: a fault placed in the middle of a read."""
        inner = getattr(self.worker, "inner", self.worker)
        recv = inner.connector_worker.kv_recv_thread
        engine = recv.engine
        self.hold_reads = False
        self.release = threading.Event()
        held = self

        class Watched:
            def batch_transfer_sync_read(self, session: str, src: list[int], dst: list[int],
                                         lengths: list[int]) -> int:
                total = int(sum(lengths))
                emit(ev="reading", bytes=total)
                if not held.hold_reads:
                    return int(engine.batch_transfer_sync_read(session, src, dst, lengths))
                first, rest = halves(src, dst, lengths)
                ret = int(engine.batch_transfer_sync_read(session, *first))
                emit(ev="half_read", bytes=total, read=int(sum(first[2])), ret=ret)
                held.release.wait()
                if ret != 0 or not rest[2]:
                    return ret
                return int(engine.batch_transfer_sync_read(session, *rest))

            def __getattr__(self, name: str) -> Any:
                return getattr(engine, name)

        recv.engine = Watched()

    def _watch_asks(self) -> None:
        """(Upstream Mooncake's producer hook: vllm-ascend's consumer pulls.)"""

    def finish(self, rid: str) -> None:
        """The prefill samples its first token before it finishes (vllm-ascend's
        ``request_finished`` hands it to the decode side as ``last_token_id``)."""
        r = self.requests[rid]
        if not r.output_token_ids:
            r.append_output_token_ids(3)
        super().finish(rid)

    def handle(self, cmd: dict[str, Any]) -> bool:
        if cmd["op"] == "inner":
            emit(ev="inner", **inner_state(self.worker))
            return True
        if cmd["op"] == "hold_reads":
            self.hold_reads = True
            emit(ev="holding")
            return True
        if cmd["op"] == "release_reads":
            self.release.set()
            emit(ev="released")
            return True
        if cmd["op"] == "veto_counts":
            # The scheduler-role wrapper's counts, taken here: vLLM 0.23's Scheduler asks
            # its connector for stats only in a step whose workers reported some.
            counts = getattr(self.sched, "counts", None)
            emit(ev="veto_counts", data=counts.take() if counts is not None else {})
            return True
        return super().handle(cmd)


def main() -> None:
    ap = base.arg_parser()
    ap.add_argument("--kv-layout", default="blocks")
    ap.add_argument("--inner", default="ascend")
    ap.add_argument("--connector", default=os.environ.get("SHMHB_TEST_ASCEND_CONNECTOR", CONNECTOR),
                    help="the vllm-ascend connector to run (the others are refused wrapped)")
    a = ap.parse_args()
    base.set_up(a)
    if a.scheduler:
        from tests.vllm.scheduled import ScheduledEngine

        class Scheduled(ScheduledEngine, AscendEngine):
            pass
        Scheduled(a).run()
    else:
        AscendEngine(a).run()


if __name__ == "__main__":
    main()
