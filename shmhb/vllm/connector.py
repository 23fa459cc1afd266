"""``ShmhbConnector``: any KV connector, plus the host's liveness board.

    --kv-transfer-config '{"kv_connector": "ShmhbConnector", "kv_connector_module_path": "shmhb.vllm",
        "kv_role": "kv_both", "kv_connector_extra_config": {
            "inner": {"kv_connector": "MooncakeConnector", "kv_connector_extra_config": {...}},
            "board": "shmhb"}}'

Every method of both roles goes to ``self.inner``, the wrapped connector, built from
``kv_connector_extra_config["inner"]`` exactly as vLLM would build it alone.  What is
added:

* scheduler role: ``get_num_new_matched_tokens`` returns 0 for a request whose producer
  engine the board reports dead, left, or gone (``on_dead_peer="recompute"``): the
  prompt is computed locally instead of waiting for a load that cannot come.  One board
  read per call; UNKNOWN (no observer on this host) never vetoes;
* scheduler role, on SIGTERM (``shmhb.board.drain``): the engine reads draining, so fed
  routers drop it, and serves what it owes (``owed.OwedWork``: the requests it runs, the
  KV its peers have not read) for up to ``drain_timeout_s`` before vLLM's own shutdown;
* worker role (``guard.WorkerGuard``): the rank registers on its board when its KV
  caches are registered and leaves at shutdown; loads in flight from a producer that is
  dropped are fenced and failed within the step; the inner connector forgets the peer;
  a producer writes only with its consumer's go-ahead.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorRole, SupportsHMA,
)

from ..board.drain import DrainConfig, SigtermDrain
from ..board.handle import Board
from ..errors import ShmhbError
from .adapters import adapter_class, adapter_for
from .guard import WorkerGuard
from .owed import OwedWork
from .settings import ConnectorSettings, engine_token
from .stats import Counts, InnerPromMetrics, ShmhbKVConnectorStats
from .verdict import may_hold_blocks, producer_verdict

log = logging.getLogger(__name__)


#: fields of the outer config the inner connector inherits unless its own config sets
#: them: the role, the engine id, and where it listens (vllm-ascend's side channel is
#: ``kv_port``)
_INHERITED = ("kv_role", "engine_id", "kv_ip", "kv_port")


def _inner_transfer_config(ktc: Any, settings: ConnectorSettings) -> KVTransferConfig:
    fields = {f: getattr(ktc, f) for f in _INHERITED if hasattr(ktc, f)}
    fields.update(settings.inner)
    return KVTransferConfig(**fields)


def _inner_config(vllm_config: Any, settings: ConnectorSettings) -> Any:
    cfg = copy.copy(vllm_config)
    cfg.kv_transfer_config = _inner_transfer_config(vllm_config.kv_transfer_config, settings)
    return cfg


def _recover_by_default(ktc: Any, role: KVConnectorRole) -> None:
    """``on_dead_peer="recompute"`` (the default) means no request fails because its
    producer died: a load that fails anyway (it was in flight when the producer died,
    hung or restarted) must be recomputed, not finished as an error.  vLLM decides
    that by ``kv_load_failure_policy``, which defaults to "fail" and which the
    scheduler reads from this (the outer) config right after it built its connector,
    this one.  So the wrapper sets it here, in the scheduler's process, before that
    read; ``on_dead_peer="fail"`` leaves vLLM's policy as configured."""
    policy = getattr(ktc, "kv_load_failure_policy", None)
    if policy is None or policy == "recompute":
        return
    ktc.kv_load_failure_policy = "recompute"
    if role == KVConnectorRole.SCHEDULER:
        log.info("shmhb: kv_load_failure_policy %r -> 'recompute': a load that fails because "
                 "its producer died is computed locally (on_dead_peer='fail' keeps %r)",
                 policy, policy)


def _inner_class(vllm_config: Any) -> Any:
    s = ConnectorSettings.from_extra_config(vllm_config.kv_transfer_config.kv_connector_extra_config)
    cfg = _inner_config(vllm_config, s)
    return KVConnectorFactory.get_connector_class(cfg.kv_transfer_config), cfg


class ShmhbConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self.settings = ConnectorSettings.from_extra_config(ktc.kv_connector_extra_config)
        if self.settings.on_dead_peer == "recompute":
            _recover_by_default(ktc, role)
        # which adapter serves the inner connector, before it is built: a connector
        # refused on purpose is refused with its reason, not with whatever its build hits
        cls_a = adapter_class(self.settings.inner["kv_connector"])
        inner_cfg = _inner_config(vllm_config, self.settings)
        cls = KVConnectorFactory.get_connector_class(inner_cfg.kv_transfer_config)
        self.inner: KVConnectorBase_V1 = cls(inner_cfg, role, kv_cache_config)
        self.engine_id: str = ktc.engine_id
        self.counts = Counts()
        self.guard: WorkerGuard | None = None
        self._board: Board | None = None
        self._vetoed: dict[str, str] = {}  # request id -> reason (scheduler role)
        # how the inner connector's transfer params name the producer's address
        self._address_fields, self._address = cls_a.address_fields, cls_a.producer_address
        self._parsed: dict[tuple[Any, ...], str | None] = {}  # their values -> board endpoint
        # board endpoint -> (board changes(), the slot read then): reused while nothing
        # changed and this host's agent is observing
        self._seen: dict[str, tuple[int, Any]] = {}
        self.owed = OwedWork()  # (scheduler role)
        self.drain: SigtermDrain | None = None
        if role == KVConnectorRole.WORKER:
            adapter = adapter_for(self.settings.inner["kv_connector"], self.inner)
            self.guard = WorkerGuard(self.settings, adapter, self.engine_id, self.counts)
        else:
            self._board = Board.attach(self.settings.board)
            # vLLM's engine core installs its SIGTERM handler before it builds the
            # scheduler, and so this connector: the drain goes in front of it
            self.drain = SigtermDrain(self._board, engine_token(self.engine_id), self.owed.count,
                                      DrainConfig(timeout_s=self.settings.drain_timeout_s))
            self.drain.install()
        log.info("ShmhbConnector (%s) around %s, board %s", role.name,
                 type(self.inner).__name__, self.settings.board or "$SHMHB_BOARD")

    # -- classmethods: answered by the inner connector's class ----------------------------------

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        inner_cls, cfg = _inner_class(vllm_config)
        return inner_cls.get_required_kvcache_layout(cfg)  # type: ignore[no-any-return]

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        inner = ConnectorSettings.from_extra_config(extra_config).inner
        inner_cls = KVConnectorFactory.get_connector_class(KVTransferConfig(**inner))
        return bool(inner_cls.requires_piecewise_for_cudagraph(inner.get("kv_connector_extra_config", {})))

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> ShmhbKVConnectorStats:
        return ShmhbKVConnectorStats(data=data) if data else ShmhbKVConnectorStats()

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """(vLLM 0.33) What the inner connector says for its own config."""
        inner = _inner_transfer_config(kv_transfer_config, ConnectorSettings.from_extra_config(
            kv_transfer_config.kv_connector_extra_config))
        fn = getattr(KVConnectorFactory.get_connector_class(inner), "supports_sleep_mode", None)
        return True if fn is None else bool(fn(inner))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[Any, Any],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> Any:
        """The inner connector's Prometheus metrics (vLLM 0.33's Mooncake has them), fed
        the inner part of this connector's stats."""
        inner_cls, cfg = _inner_class(vllm_config)
        inner = inner_cls.build_prom_metrics(cfg, metric_types, labelnames, per_engine_labelvalues)
        if inner is None:
            return None
        return InnerPromMetrics(inner, vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- scheduler role ------------------------------------------------------------------------

    def _endpoint(self, params: dict[str, Any]) -> str | None:
        """The board endpoint of the producer address the params name (Mooncake: its
        bootstrap server, NIXL: its handshake listener), watched on first sight; None
        if they name none."""
        raw = tuple(params.get(f) for f in self._address_fields)
        try:
            ep = self._parsed.get(raw, "")
        except TypeError:  # unhashable values: not an address
            return None
        if ep != "":
            return ep
        out = self._address(*raw)
        if out is not None and len(self._parsed) < 4096:
            try:
                assert self._board is not None
                self._board.watch(out)
            except ShmhbError as e:
                log.warning("shmhb: cannot follow producer address %s: %s", out, e)
                out = None
            self._parsed[raw] = out
        return out

    def veto_reason(self, params: dict[str, Any]) -> str | None:
        """Why a load from the producer these params name would be futile, or None.
        One board read: the slot that serves the engine's address."""
        ep = self._endpoint(params)
        b = self._board
        if ep is None or b is None:
            return None
        # A remote row's status is what the agent wrote (and every write moves
        # changes()), bounded by the agent's own freshness: while neither moved, the
        # last read still holds.  Two words and the clock instead of a row's checksum.
        changes = b.changes()
        memo = self._seen.get(ep)
        if memo is not None and memo[0] == changes and b.agent_fresh():
            s = memo[1]
        else:
            s = b.remote(ep)
            if len(self._seen) < 4096:
                self._seen[ep] = (changes, s)
        return producer_verdict(s, params.get("remote_engine_id"), self.settings.act_on_suspect)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        self.owed.arrived(request.request_id)
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill") and self.settings.on_dead_peer == "recompute":
            reason = self.veto_reason(params)
            if reason is not None:
                if self._vetoed.get(request.request_id) != reason:
                    self._vetoed[request.request_id] = reason
                    self.counts.add(f"vetoes.{reason}")
                    log.info("shmhb: request %s computed locally: producer engine %s is %s",
                             request.request_id, params.get("remote_engine_id"), reason)
                return 0, False
            self._vetoed.pop(request.request_id, None)
        return self.inner.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        reason = self._vetoed.pop(request.request_id, None) if num_external_tokens == 0 else None
        if reason is not None and not may_hold_blocks(reason):
            params = request.kv_transfer_params
            if params is not None:
                params["do_remote_prefill"] = False  # nothing to load, nobody to notify
            return
        # A producer that may be alive and holding the blocks (a vetoed SUSPECT one) gets
        # the inner connector's own "no load" notice: with no external tokens, Mooncake
        # sends an empty pull, which frees the blocks there (instead of its 480 s abort).
        self.inner.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        return self.inner.build_connector_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._vetoed.pop(request.request_id, None)
        delay, params = self.inner.request_finished(request, block_ids)
        self.owed.finished(request.request_id, delay)
        return delay, params

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        self._vetoed.pop(request.request_id, None)
        fn = getattr(self.inner, "request_finished_all_groups", None)
        if fn is None:
            delay, params = self.inner.request_finished(request, block_ids[0] if block_ids else [])
        else:
            delay, params = fn(request, block_ids)
        self.owed.finished(request.request_id, delay)
        return delay, params

    def update_connector_output(self, connector_output: Any) -> None:
        """The inner connector's, after noting the sends the workers report done."""
        self.owed.sent(getattr(connector_output, "finished_sending", None))
        fn = getattr(self.inner, "update_connector_output", None)
        if fn is not None:
            fn(connector_output)

    # -- worker role ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Any) -> None:
        self.inner.register_kv_caches(kv_caches)
        if self.guard is not None:
            self.guard.register()

    def register_cross_layers_kv_cache(self, *args: Any, **kwargs: Any) -> None:
        """The cross-layer variant of recent vLLM versions (absent in 0.32)."""
        getattr(self.inner, "register_cross_layers_kv_cache")(*args, **kwargs)
        if self.guard is not None:
            self.guard.register()

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        self.inner.bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self.inner.clear_connector_metadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self.guard is not None:
            self.guard.poll()
        self.inner.start_load_kv(forward_context, **kwargs)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.guard is not None:
            self.guard.poll()
        return self.inner.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """(vLLM 0.32 and 0.33's model runners; 0.23's call ``get_finished``)"""
        if self.guard is not None:
            self.guard.poll()
        return getattr(self.inner, "get_transfer_results")(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.inner.get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        if self.guard is not None:
            self.guard.shutdown()
        self.inner.shutdown()

    def get_kv_connector_stats(self) -> ShmhbKVConnectorStats | None:
        inner = self.inner.get_kv_connector_stats()
        mine = self.counts.take()
        if inner is None and not mine:
            return None
        return ShmhbKVConnectorStats(data={"shmhb": mine, "inner": inner})

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.inner.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        self.inner.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        self.inner.wait_for_save()

    # (the two properties below are vLLM 0.32 and 0.33's; 0.23's base class has neither)
    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return bool(getattr(self.inner, "supports_divergent_local_hybrid_hits", False))

    @property
    def requires_kv_delivery(self) -> bool:
        return bool(getattr(self.inner, "requires_kv_delivery", False))

    def __getattr__(self, name: str) -> Any:
        # Anything this class does not define (hooks of newer vLLM versions) goes to the
        # inner connector.
        inner = self.__dict__.get("inner")
        if inner is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(inner, name)


#: the base class's plain methods not named above: each goes to the inner connector
_DELEGATED = (
    "get_mem_pool_context", "set_host_xfer_buffer_ops", "finish_forward", "reset_capture_state",
    "handle_preemptions", "get_kv_connector_kv_cache_events", "get_handshake_metadata",
    "build_connector_worker_meta", "bind_kv_cache_manager", "bind_gpu_block_pool",
    "get_loaded_kv_cache_group_ids", "get_external_cache_hit_sources", "on_new_request",
    "register_finished_partial_tail", "take_events",
    "has_pending_block_frees", "has_pending_push_work", "get_finished_count",
    "set_xfer_handshake_metadata", "set_xfer_handshake_metadata_pp_aware", "reset_cache",
    "unregister_kv_caches", "restore_kv_caches",  # vLLM 0.33: sleep mode
)


def _delegate(name: str) -> Any:
    def method(self: ShmhbConnector, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.inner, name)(*args, **kwargs)
    method.__name__ = name
    method.__doc__ = f"Delegated to the inner connector's ``{name}``."
    return method


for _name in _DELEGATED:
    if hasattr(KVConnectorBase_V1, _name):
        setattr(ShmhbConnector, _name, _delegate(_name))
