"""The adapter for vLLM 0.32's and 0.33's ``MooncakeConnector`` (the contract is
``inner``'s docstring; the settlement of pulls is ``mooncake_pulls``)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import time
from typing import Any

from ..board.config import format_hostport, parse_hostport
from ..errors import ShmhbError
from .inner import Hooks, InnerAdapter, check_release, zmq_hostport
from .mooncake_pulls import Ledger, needs
from .settings import Rank

#: the producer worker a consumer task is asking (its side channel, "host:port")
_PRODUCER: contextvars.ContextVar[str] = contextvars.ContextVar("shmhb_producer")
#: what ``_send_blocks`` returns for a write not made because its lease ran out (stock
#: then reports those requests failed to the consumer, as for any failed write)
LEASE_RAN_OUT = -1


class _LeasedPtrs(list[int]):
    """The source pointers of a granted write, carrying when its lease ends (from
    ``_build_transfer_params`` to ``_send_blocks``, through stock's code between them)."""

    until_ns: int | None = None


class MooncakeAdapter(InnerAdapter):
    """vLLM 0.32 and 0.33 ``MooncakeConnector`` (the producer pushes into the consumer).

    Uses, on ``connector.connector_worker``: ``hostname``, ``rpc_port``,
    ``side_channel_port``, ``dp_rank``/``tp_rank``/``pp_rank``, ``engine_id``,
    ``is_kv_producer``/``is_kv_consumer``, ``vllm_config``; consumer:
    ``receive_kv_from_single_worker`` and ``handle_new_engine_id`` (wrapped), ``_encoder``
    (wrapped: the request carries ``{"shmhb": {"inc", "fence"}}``, an extra field stock
    producers ignore), the settlement of pulls (``mooncake_pulls``: each producer worker's
    share of a request settled once, the request reported once all have settled),
    ``_pending_bootstrap_queries``, ``receiver_loop``, ``_remote_agents``/``_tp_size``
    and 0.33's ``_acked_layout_peers`` (evicted); producer: ``_xfer_meta_decoder`` and
    ``send_kv_to_decode`` and ``_build_transfer_params`` (wrapped),
    ``reqs_need_send``/``finished_sending_reqs``/``_prepared_transfer_regions`` and
    0.33's ``_layout_by_peer`` (evicted, freed), ``sender_loop``, and ``_send_blocks``
    (wrapped: the lease is checked there, in the thread that writes, right before
    ``batch_transfer_sync_write``).

    The fence: a load's request is one DEALER socket inside
    ``receive_kv_from_single_worker``, opened with linger 0.  Cancelling that task
    closes it, which is what stock does at its timeout: the request is withdrawn and the
    connection goes.  That alone does not bind a producer that already read the request
    (it may be stopped holding it), so the producer side asks the consumer's go-ahead
    before it writes (``hooks.ask_now`` as it reads the request, ``hooks.allowed`` at
    the write), and the consumer grants only loads it has
    not given up (``loads.LoadTable``).  A producer that is not wrapped is bound only by
    the socket close.
    """

    names = ("MooncakeConnector",)
    #: the engine's bootstrap server ("http://host:port"), which its first rank registers
    address_fields = ("remote_bootstrap_addr",)

    @staticmethod
    def producer_address(*values: object) -> str | None:
        url = values[0] if values else None
        if not isinstance(url, str):
            return None
        try:
            host, port = parse_hostport(url.split("://", 1)[-1].split("/", 1)[0])
            return format_hostport(host, port)
        except ShmhbError:
            return None

    def __init__(self, connector: Any) -> None:
        super().__init__(connector)
        self.w = connector.connector_worker
        self._pending_extra: dict[int, Any] = {}  # id(decoded request) -> its shmhb field
        #: id(request) -> (consumer, its shmhb field checked, the go-ahead asked as it was read)
        self._active: dict[int, tuple[str, Any, Any]] = {}
        self._region_owner: dict[Any, str] = {}  # prepared-regions key -> consumer
        self._consumer_xfers: dict[str, set[str]] = {}  # consumer -> transfer ids asked

    def check(self) -> None:
        check_release("Mooncake")
        need = ["hostname", "rpc_port", "engine_id", "tp_rank", "pp_rank", "dp_rank"]
        if not self.w.is_kv_producer:
            need += ["receive_kv_from_single_worker", "handle_new_engine_id", "_encoder",
                     "_pending_bootstrap_queries", "receiver_loop", "_remote_agents",
                     "_tp_size", *needs(self.w)]
        if not self.w.is_kv_consumer:
            need += ["_xfer_meta_decoder", "send_kv_to_decode", "_build_transfer_params",
                     "_send_blocks", "reqs_need_send", "finished_sending_reqs",
                     "_prepared_transfer_regions", "sender_loop"]
        missing = [n for n in need if not hasattr(self.w, n)]
        if missing:
            raise TypeError(f"this MooncakeConnector lacks {missing}: the shmhb adapter was "
                            "written for vLLM 0.32 and 0.33; pin one of them or update "
                            "shmhb.vllm.mooncake_adapter")

    def consumes(self) -> bool:
        return not self.w.is_kv_producer

    def produces(self) -> bool:
        return not self.w.is_kv_consumer

    def rank(self) -> Rank:
        return Rank(dp=int(self.w.dp_rank), tp=int(self.w.tp_rank), pp=int(self.w.pp_rank))

    def endpoints(self) -> dict[str, str]:
        w = self.w
        out = {"engine": format_hostport(w.hostname, int(w.rpc_port))}
        side_port = int(getattr(w, "side_channel_port", 0) or 0)
        if not w.is_kv_consumer and side_port:
            out["side"] = format_hostport(w.hostname, int(w.side_channel_port))
        if getattr(w, "bootstrap_server", None) is not None:
            from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import (
                mooncake_connector as mc,
            )
            host, port = mc.get_mooncake_bootstrap_addr(w.vllm_config)
            out["bootstrap"] = format_hostport(host, int(port))
        return out

    # -- in the path of loads and writes ----------------------------------------------------

    def install(self, hooks: Hooks) -> None:
        w = self.w
        if not w.is_kv_producer:
            self._install_consumer(hooks)
        if not w.is_kv_consumer:
            self._install_producer(hooks)

    def _install_consumer(self, hooks: Hooks) -> None:
        w = self.w
        ledger = Ledger(w, hooks.load_ended, hooks.failure_held)
        ledger.install()
        w._encoder = self._encoder_adding_extra(hooks)
        w.receive_kv_from_single_worker = self._receive_wrapped(hooks, ledger)
        w.handle_new_engine_id = self._bootstrap_query_wrapped(hooks, ledger)

    def _encoder_adding_extra(self, hooks: Hooks) -> Any:
        """The stock request encoder, wrapped: adds the shmhb field to transfer requests."""
        import msgspec
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import (
            mooncake_connector as mc,
        )
        encoder = self.w._encoder

        class Encoder:
            """The stock encoder, plus the shmhb field on transfer requests."""

            def encode(self, obj: Any) -> bytes:
                if isinstance(obj, mc.MooncakeXferMetadata):
                    extra = hooks.request_extra(_PRODUCER.get(None))
                    if extra is not None:
                        d = msgspec.structs.asdict(obj)
                        d["shmhb"] = extra
                        return encoder.encode(d)  # type: ignore[no-any-return]
                return encoder.encode(obj)  # type: ignore[no-any-return]

        return Encoder()

    def _receive_wrapped(self, hooks: Hooks, ledger: Ledger) -> Any:
        """``receive_kv_from_single_worker``, wrapped: each load tracked, fenced and
        settled once (``mooncake_pulls``)."""
        w = self.w
        receive = w.receive_kv_from_single_worker

        def doom(req_ids: list[str]) -> None:
            # These failed at one producer worker, so what they wait for from the others
            # cannot complete them: give those loads up (no grant after this) and cut
            # the requests that carry nothing else; each settles its own share.
            for t in hooks.give_up(req_ids):
                if isinstance(t, asyncio.Task) and not t.done():
                    t.cancel()

        async def receive_kv_from_single_worker(worker_addr: str, pull_metas: dict[str, Any]) -> None:
            # One producer worker's share of these requests, each settled exactly once:
            # by the inner's results (the ledger records them) or here, for what the
            # task leaves unsettled.  A dict of its own: what settles pops per worker.
            task = asyncio.current_task()
            ep = zmq_hostport(worker_addr)
            mine = dict(pull_metas)
            engine = next(iter(mine.values())).remote_engine_id if mine else ""
            failed = [r for r, pm in mine.items() if pm.failed]
            if failed:  # failed at another worker already: not asked of this one
                ledger.fail_now(mine, failed, "shmhb: failed at another producer worker")
                for r in failed:
                    del mine[r]
            if not mine:
                return
            reqs = {r: frozenset(b for g in pm.local_block_ids for b in g)
                    for r, pm in mine.items()}
            if not hooks.load_started(ep, engine, reqs, task):
                ledger.fail_now(mine, list(mine), f"shmhb: producer {ep} of engine {engine} is gone")
                doom(list(mine))
                return
            ledger.begin(task, ep)
            _PRODUCER.set(ep)  # this task's (its own context): the request's token is ep's
            try:
                await receive(worker_addr, mine)
            except asyncio.CancelledError:
                # Fenced: the request socket is closed (linger 0) as the task unwound.
                # Only now report what this worker had not settled, the stock way.
                left = ledger.finish(task, mine)
                held = hooks.load_ended(ep, list(mine))
                ledger.fail_now(mine, left, f"shmhb: producer {ep} of engine {engine} dropped",
                                held)
                doom(left)
                return
            left = ledger.finish(task, mine)
            held = hooks.load_ended(ep, list(mine))
            # (0.33 fails what a worker's last answer left out; 0.32 forgot it)
            ledger.fail_now(mine, left, "peer finished without reporting a transfer result", held)
        return receive_kv_from_single_worker

    def _bootstrap_query_wrapped(self, hooks: Hooks, ledger: Ledger) -> Any:
        """``handle_new_engine_id`` (the bootstrap query), wrapped: a load too."""
        w = self.w
        handle_new_engine = w.handle_new_engine_id

        async def handle_new_engine_id(remote_engine_id: str, pull_metas: dict[str, Any]) -> None:
            # The first load from an engine (or the first since it was evicted) asks its
            # bootstrap server first: a load too, tracked under the bootstrap endpoint,
            # so a producer that hangs here is fenced like one that hangs later.  This
            # stage settles a request only when it fails it (count 0: no worker asked).
            task = asyncio.current_task()
            pm = next(iter(pull_metas.values()), None)
            try:
                ep = zmq_hostport(pm.remote_bootstrap_addr) if pm is not None else ""
            except ValueError:
                ep = ""
            reqs = {r: frozenset(b for g in m.local_block_ids for b in g)
                    for r, m in pull_metas.items()}
            if ep and not hooks.load_started(ep, remote_engine_id, reqs, task):
                ledger.fail_now(pull_metas, list(pull_metas),
                                f"shmhb: engine {remote_engine_id} at {ep} is gone")
                return
            ledger.begin(task, ep)
            try:
                await handle_new_engine(remote_engine_id, pull_metas)
            except asyncio.CancelledError:
                left = ledger.finish(task, pull_metas)
                if ep:
                    hooks.load_ended(ep, list(pull_metas))
                ledger.fail_now(pull_metas, left,
                                f"shmhb: engine {remote_engine_id} at {ep} dropped")
                # The bootstrap query was cut (every load waiting on it is fenced with
                # it: they share the endpoint): wake its waiters, let the next ask anew.
                ev = w._pending_bootstrap_queries.pop(pm.remote_bootstrap_addr, None) \
                    if pm is not None else None
                if ev is not None:
                    ev.set()
                return
            ledger.finish(task, pull_metas)
            if ep:
                hooks.load_ended(ep, list(pull_metas))
        return handle_new_engine_id

    def _decoder_keeping_extra(self) -> Any:
        """The stock request decoder, wrapped: keeps the request's shmhb field aside."""
        import msgspec
        decoder, pending = self.w._xfer_meta_decoder, self._pending_extra

        class _Extra(msgspec.Struct):
            shmhb: Any = None

        extra_decoder = msgspec.msgpack.Decoder(_Extra)

        class Decoder:
            def decode(self, data: bytes) -> Any:
                meta = decoder.decode(data)
                try:
                    pending[id(meta)] = extra_decoder.decode(data).shmhb
                except msgspec.ValidationError:
                    pending[id(meta)] = None
                return meta
        return Decoder()

    def _ask_now(self, hooks: Hooks, consumer: str, seen: Any, meta: Any) -> Any:
        """The go-ahead for the requests whose blocks are computed already (the usual
        case: the decode asks once its prefill is done), asked as the request is read,
        so the answer is in by the time stock has made its way to the write (a few
        turns of the sender loop) and is read there without a wait.  Stock's checks
        may still refuse the request: it then tells the consumer so, which ends the
        load, granted or not."""
        need = self.w.reqs_need_send
        ready = [d for d, (x, _) in meta.req_blocks.items()
                 if (s := need.get(x)) is not None and s.ready.is_set()]
        return hooks.ask_now(consumer, seen, ready) if ready else None

    def _install_producer(self, hooks: Hooks) -> None:
        w = self.w
        send = w.send_kv_to_decode
        build = w._build_transfer_params
        pending, active = self._pending_extra, self._active

        async def send_kv_to_decode(identity: bytes, sock: Any, meta: Any) -> None:
            # _sender_worker decodes and calls us with no await in between: the field
            # kept aside is this request's.
            extra = pending.pop(id(meta), None)
            consumer = format_hostport(meta.remote_hostname, int(meta.remote_port))
            seen = hooks.consumer_seen(consumer, extra)  # checked once per request
            self._consumer_xfers.setdefault(consumer, set()).update(
                x for x, _ in meta.req_blocks.values())
            asked = self._ask_now(hooks, consumer, seen, meta)
            active[id(meta)] = (consumer, seen, asked)
            try:
                await send(identity, sock, meta)
            finally:
                active.pop(id(meta), None)
                if asked is not None:
                    hooks.forget(asked)  # an answer not read by a write is dropped

        async def _build_transfer_params(ready_reqs: list[Any], meta: Any, local_regions: Any,
                                         remote_regions: Any) -> Any:
            consumer, seen, asked = active.get(id(meta), (
                format_hostport(meta.remote_hostname, int(meta.remote_port)), None, None))
            for k in w._prepared_transfer_regions:
                self._region_owner.setdefault(k, consumer)
            allowed = await hooks.allowed(consumer, seen, [d for d, _ in ready_reqs], asked)
            ok = set(allowed.req_ids)
            granted = [(d, s) for d, s in ready_reqs if d in ok]
            denied = [(d, s) for d, s in ready_reqs if d not in ok]
            if granted:
                src, dst, lengths, err, msg = await build(granted, meta, local_regions, remote_regions)
                src = _LeasedPtrs(src)
                src.until_ns = allowed.until_ns
            else:
                src, dst, lengths, err, msg = [], [], [], [], None
            if denied:
                hooks.write_denied(consumer, len(denied))
                for _, s in denied:  # the consumer gave them up: free the blocks now
                    self._free_send(s)
                err = list(err) + [d for d, _ in denied]
                msg = msg or "shmhb: the consumer no longer wants these blocks"
            return src, dst, lengths, err, msg

        w._xfer_meta_decoder = self._decoder_keeping_extra()
        w.send_kv_to_decode = send_kv_to_decode
        w._build_transfer_params = _build_transfer_params
        w._send_blocks = self._lease_checked(hooks)

    def _lease_checked(self, hooks: Hooks) -> Any:
        """``_send_blocks``, wrapped: in the thread that writes, right before the write,
        a grant whose lease has run out is not acted on (its consumer may have handed
        the blocks back to vLLM)."""
        send_blocks = self.w._send_blocks

        def _send_blocks(remote_session: str, src_ptrs: list[int], dst_ptrs: list[int],
                         lengths: list[int]) -> int:
            until = getattr(src_ptrs, "until_ns", None)
            if until is not None and time.monotonic_ns() >= until:
                hooks.lease_ran_out(remote_session)
                return LEASE_RAN_OUT
            return int(send_blocks(remote_session, list(src_ptrs), dst_ptrs, lengths))
        return _send_blocks

    def _free_send(self, send_meta: Any) -> None:
        """On the sender loop: release a send's blocks on this producer now."""
        w = self.w
        if w.reqs_need_send.pop(send_meta.transfer_id, None) is not None and send_meta.p_req_id:
            w.finished_sending_reqs.add(send_meta.p_req_id)

    # -- fences and evictions ------------------------------------------------------------------

    def fence(self, tokens: list[object]) -> concurrent.futures.Future[None]:
        async def cancel() -> None:
            tasks = [t for t in tokens if isinstance(t, asyncio.Task) and not t.done()]
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=5.0)
        return asyncio.run_coroutine_threadsafe(cancel(), self.w.receiver_loop)

    def evict_engine(self, engine_id: str) -> None:
        w = self.w
        if w.is_kv_producer or engine_id == w.engine_id:
            return

        def evict() -> None:
            agents = w._remote_agents.pop(engine_id, None) or {}
            w._tp_size.pop(engine_id, None)
            acked = getattr(w, "_acked_layout_peers", None)  # 0.33: workers holding our layout
            if acked is not None:
                for by_pp in agents.values():
                    for addr in by_pp.values():
                        acked.discard(addr)
        w.receiver_loop.call_soon_threadsafe(evict)

    def evict_consumer(self, endpoint: str) -> None:
        w = self.w
        if w.is_kv_consumer:
            return

        def evict() -> None:
            for k in [k for k, c in self._region_owner.items() if c == endpoint]:
                w._prepared_transfer_regions.pop(k, None)
                del self._region_owner[k]
            layouts = getattr(w, "_layout_by_peer", None)  # 0.33: (host, port, ...) -> regions
            if layouts is not None:
                for k in [k for k in layouts if format_hostport(k[0], int(k[1])) == endpoint]:
                    del layouts[k]
            for xid in self._consumer_xfers.pop(endpoint, ()):
                s = w.reqs_need_send.get(xid)
                if s is None:
                    continue
                if not s.p_req_id:  # a placeholder its consumer created: never expires
                    w.reqs_need_send.pop(xid, None)
                elif s.ready.is_set() and s.sending == 0:
                    self._free_send(s)
        w.sender_loop.call_soon_threadsafe(evict)

    def cached_engines(self) -> set[str]:
        w = self.w
        out = set(getattr(w, "_remote_agents", {}))
        out |= {e for e in getattr(w, "_tp_size", {}) if e != w.engine_id}
        return out
