"""The adapter for vllm-ascend's ``MooncakeConnectorV1`` (vllm-ascend 0.23.0.post1 with
vLLM 0.23.0; the contract is ``inner``'s docstring).

**Who moves the bytes.**  The consumer (decode) pulls.  For each request and each
producer worker it maps to, its receiving thread queues a task; a pool thread per
producer worker (``KVCacheRecvingThread._handle_request``) asks that worker's side
channel for its metadata the first time (``_get_remote_metadata``: the transfer engine's
port and the KV base addresses, kept per engine id and side-channel port in FIFO-capped
tables), reads the blocks with one Mooncake ``batch_transfer_sync_read``, reports the
request finished (and its blocks invalid if that failed), and tells the producer it may
free its blocks (``DONE_RECVING_MSG``).  The producer never writes into the consumer: it
only answers those two messages.

**The fence.**  A read once started cannot be called back, so starting it is the
consumer's own go-ahead (``hooks.go_ahead``, taken by the pool thread just before the
read: the load goes WAITING -> GRANTED and is left to finish or fail).  Everything before
it can be given up: a load still asking the producer's metadata (a stopped or dead
producer keeps it there 3 x 1 s in stock), or queued behind one, is reported failed at the
drop, from the worker thread, exactly the way stock reports a failed pull (its blocks
invalid, the request finished), and remembered: when its pool thread comes back, no read
is started for it, no second failure is reported (its blocks may have gone to another
request by then) and no done message is sent to the producer that was dropped.  A load
whose producer the board already reports gone is failed the same way without asking it.

**No thread is left blocked.**  Stock pools REQ sockets per producer address, made with
ZMQ's default linger (for ever): after a request to a dead producer times out, the socket
is closed with the request still queued and the pool thread blocks for ever in its
context's ``term()``, so the request never finishes and the process cannot exit.  Every
socket the receiving thread makes here gets linger 0; those pooled for a dropped
producer are closed.

**Eviction.**  A dropped producer engine's entries in the receiving thread's tables
(``kv_caches_base_addr``, ``remote_te_port``, ``remote_block_size_scale``,
``remote_block_stride_per_addr``, ``remote_kv_group2layeridx``) go, with the sockets
pooled for its addresses: the next request to that engine id asks its side channel
afresh.  Stock keeps them (up to 16,000 engines), so a producer restarted under the same
engine id is read at the dead process's addresses until the consumer restarts.

**Producer side.**  Nothing to fence: it writes nothing.  It holds a finished request's
blocks until the consumer's done message, or ``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT``; it
learns which consumer pulls a request only from that message, so it cannot free early
what a dead consumer would have pulled (the timeout frees it, as in stock).

Uses, on ``connector.connector_worker`` (``MooncakeConnectorWorker``): ``kv_role``,
``tp_rank``, ``pp_rank``, ``dp_rank``, ``side_channel_host``, ``handshake_port``,
``te_rpc_port``, ``kv_recv_thread``; on that thread (``KVCacheRecvingThread``):
``_handle_request``, ``_transfer_kv_cache_all_groups``, ``_mark_failed_recv_request``,
``_send_done_recv_signal``, ``_get_remote_socket`` (wrapped), ``engine`` (its
``batch_transfer_sync_read`` wrapped), ``_mark_request_task_done``,
``_clear_failed_recv_request``, ``request_queue``, ``request_task_counts``, ``task_tracker``,
``remote_metadata_lock`` and the five tables above, ``remote_sockets(_lock)``,
``local_engine_id``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections import OrderedDict
from typing import Any

from ..board.config import format_hostport
from ..errors import ShmhbError
from .inner import Hooks, InnerAdapter, Release, check_release, host_port_address
from .settings import Rank

log = logging.getLogger(__name__)

#: what this adapter was written and tested against: vllm-ascend's release and the vLLM
#: release it pairs with
RELEASES = (Release("vllm", ("0.23.0",)), Release("vllm-ascend", ("0.23.0.post1",)))
HINT = "install 'vllm==0.23.0' and 'vllm-ascend==0.23.0.post1'"

#: vllm-ascend's other P/D connectors, refused with the reason (docs/VLLM_ASCEND.md)
REFUSED = {
    "MooncakeLayerwiseConnector": (
        "vllm-ascend's MooncakeLayerwiseConnector is not supported by shmhb: its producer "
        "pushes each layer as it is computed, from the model's forward pass "
        "(save_kv_layer, with NPU ops on the path), so a wrapper would need a go-ahead per "
        "layer write that this adapter does not have; use MooncakeConnectorV1"),
    "MooncakeHybridConnector": (
        "vllm-ascend's MooncakeHybridConnector is not supported by shmhb: it moves hybrid "
        "(attention + linear/mamba state) caches with NPU reformatting ops that the CPU "
        "tests cannot run unmodified; use MooncakeConnectorV1"),
}

#: the receiving thread's per-engine tables of what a producer's side channel answered
TABLES = ("kv_caches_base_addr", "remote_te_port", "remote_block_size_scale",
          "remote_block_stride_per_addr", "remote_kv_group2layeridx")
WORKER_NEEDS = ("kv_role", "tp_rank", "pp_rank", "dp_rank", "side_channel_host",
                "handshake_port", "te_rpc_port")
THREAD_METHODS = ("_handle_request", "_transfer_kv_cache_all_groups",
                  "_mark_failed_recv_request", "_send_done_recv_signal", "_get_remote_socket",
                  "_mark_request_task_done", "_clear_failed_recv_request")
THREAD_FIELDS = ("engine", "request_queue", "request_task_counts", "task_tracker",
                 "remote_metadata_lock",
                 "remote_sockets", "remote_sockets_lock", "local_engine_id", *TABLES)
#: requests failed by the fence, remembered until their pool threads are done with them
#: (the oldest are forgotten past this)
MAX_FENCED = 65536


class _Task(threading.local):
    """What the pool thread running ``_handle_request`` is doing (each its own)."""

    req_id: str | None = None
    endpoint: str = ""
    engine_id: str = ""
    vetoed: bool = False
    granted: bool = False


class AscendMooncakeAdapter(InnerAdapter):
    """vllm-ascend 0.23.0.post1's ``MooncakeConnectorV1``: see the module docstring."""

    names = ("MooncakeConnectorV1",)
    asks_go_ahead = False
    #: the producer's side channel, as its ``request_finished`` names it
    address_fields = ("remote_host", "remote_port")

    @staticmethod
    def producer_address(*values: object) -> str | None:
        return host_port_address(*values)

    def __init__(self, connector: Any) -> None:
        super().__init__(connector)
        self.w = connector.connector_worker
        self._task = _Task()
        self._lock = threading.Lock()
        #: request -> its local blocks, per group (what a failure report invalidates)
        self._blocks: dict[str, Any] = {}
        self._fenced: OrderedDict[str, None] = OrderedDict()
        #: engine id -> the side-channel paths ("tcp://host:port") it was asked at
        self._paths: dict[str, set[str]] = {}
        self._hooks: Hooks | None = None

    def check(self) -> None:
        check_release("vllm-ascend MooncakeConnectorV1", RELEASES, HINT)
        from vllm_ascend.distributed.kv_transfer.kv_p2p import mooncake_connector as mc
        missing = [n for n in WORKER_NEEDS if not hasattr(self.w, n)]
        missing += [f"KVCacheRecvingThread.{n}" for n in THREAD_METHODS
                    if not hasattr(mc.KVCacheRecvingThread, n)]
        if missing:
            raise TypeError(f"this MooncakeConnectorV1 lacks {missing}: the shmhb adapter was "
                            f"written for vllm-ascend 0.23.0.post1; {HINT}")

    def consumes(self) -> bool:
        return str(self.w.kv_role) != "kv_producer"  # as its register_kv_caches decides

    def produces(self) -> bool:
        return str(self.w.kv_role) == "kv_producer"

    def rank(self) -> Rank:
        return Rank(dp=int(self.w.dp_rank or 0), tp=int(self.w.tp_rank), pp=int(self.w.pp_rank))

    def endpoints(self) -> dict[str, str]:
        """A producer worker's side channel (what consumers ask, and what the requests'
        ``remote_host``/``remote_port`` name for its first rank) and its transfer
        engine; a consumer's transfer engine."""
        w = self.w
        out = {}
        try:
            out["engine"] = format_hostport(str(w.side_channel_host), int(w.te_rpc_port))
            if self.produces():
                out["side"] = format_hostport(str(w.side_channel_host), int(w.handshake_port))
        except ShmhbError as e:
            log.warning("shmhb: vllm-ascend's side channel %s is not an address the board "
                        "takes (%s): consumers cannot follow this rank; set VLLM_HOST_IP "
                        "to its IP", w.side_channel_host, e)
        return out

    # -- in the path of pulls (the receiving thread's pool threads) --------------------------

    def install(self, hooks: Hooks) -> None:
        if not self.consumes():
            return  # a producer serves reads: nothing of its own to fence
        recv = self.w.kv_recv_thread
        missing = [n for n in THREAD_FIELDS if not hasattr(recv, n)]
        if recv is None or missing:
            raise TypeError(f"this MooncakeConnectorV1's receiving thread lacks {missing}: "
                            f"{HINT}")
        self._hooks = hooks
        self._wrap_pulls(recv, hooks)
        self._wrap_exits(recv)
        recv.engine = _GoAheadEngine(recv.engine, self)

    def _wrap_pulls(self, recv: Any, hooks: Hooks) -> None:
        """Each pull task: tracked as a load, vetoed if its producer is gone, skipped if
        its request was failed at the fence already."""
        task = self._task
        handle = recv._handle_request
        transfer = recv._transfer_kv_cache_all_groups

        def _handle_request(req_meta: dict[str, Any]) -> None:
            rid = str(req_meta["request_id"])
            if self._is_fenced(rid):
                self._settle_fenced(req_meta)  # failed already: nothing asked, nothing read
                return
            ep = host_port_address(req_meta["remote_host"], req_meta["remote_handshake_port"])
            engine = str(req_meta["remote_engine_id"])
            blocks = req_meta["local_block_ids"]
            task.req_id, task.endpoint, task.engine_id = rid, ep or "", engine
            task.vetoed = task.granted = False
            if ep is not None:
                with self._lock:
                    self._blocks.setdefault(rid, blocks)
                flat = frozenset(b for g in blocks for b in g)
                task.vetoed = not hooks.load_started(ep, engine, {rid: flat}, rid)
            try:
                handle(req_meta)
            finally:
                if ep is not None and not task.vetoed:
                    hooks.load_ended(ep, [rid])
                task.req_id = None
                if rid not in recv.request_task_counts:  # (its last task is over)
                    with self._lock:
                        self._blocks.pop(rid, None)

        def _transfer_kv_cache_all_groups(req_meta: dict[str, Any]) -> Any:
            if task.vetoed or self._is_fenced(str(req_meta["request_id"])):
                raise RuntimeError(f"shmhb: producer {task.endpoint} of engine "
                                   f"{task.engine_id} is gone")
            return transfer(req_meta)

        recv._handle_request = _handle_request
        recv._transfer_kv_cache_all_groups = _transfer_kv_cache_all_groups

    def _wrap_exits(self, recv: Any) -> None:
        """A task's ways out: no second failure report for a fenced request, no done
        message to a dropped producer, and sockets that never block their close."""
        task = self._task
        mark_failed = recv._mark_failed_recv_request
        done_signal = recv._send_done_recv_signal
        get_socket = recv._get_remote_socket

        def _mark_failed_recv_request(request_id: str, local_block_ids: Any) -> None:
            if self._is_fenced(request_id):
                return  # reported at the fence: its blocks may be another request's now
            mark_failed(request_id, local_block_ids)

        def _send_done_recv_signal(request_id: str, host: str, port: int, *args: Any) -> None:
            if task.vetoed or self._is_fenced(str(task.req_id)):
                return  # the producer was dropped: nobody to tell, nothing to wait for
            done_signal(request_id, host, port, *args)

        def _get_remote_socket(host: str, port: int) -> Any:
            import zmq
            sock = get_socket(host, port)
            sock.setsockopt(zmq.LINGER, 0)  # a close never waits on a dead peer
            if task.engine_id:
                with self._lock:
                    self._paths.setdefault(task.engine_id, set()).add(
                        f"tcp://{format_hostport(host, int(port))}")
            return sock

        recv._mark_failed_recv_request = _mark_failed_recv_request
        recv._send_done_recv_signal = _send_done_recv_signal
        recv._get_remote_socket = _get_remote_socket

    def read_allowed(self) -> bool:
        """On a pool thread, just before its read: the consumer's own go-ahead."""
        t = self._task
        if t.req_id is None or t.granted or not t.endpoint or self._hooks is None:
            return True
        if t.vetoed or not self._hooks.go_ahead(t.endpoint, [t.req_id]):
            return False  # given up meanwhile: failed already, nothing is read
        t.granted = True
        return True

    def _is_fenced(self, req_id: str) -> bool:
        with self._lock:
            return req_id in self._fenced

    def _settle_fenced(self, req_meta: dict[str, Any]) -> None:
        """What stock's ``_handle_request`` does for a task of a failed request, less the
        failure report (made at the fence) and the done message (the producer is gone)."""
        recv = self.w.kv_recv_thread
        rid = str(req_meta["request_id"])
        try:
            if recv._mark_request_task_done(rid, req_meta["all_task_done"]):
                recv._clear_failed_recv_request(rid)
        finally:
            recv.request_queue.task_done()

    # -- fences and evictions (the worker thread: WorkerGuard.poll) ---------------------------

    def fence(self, tokens: list[object]) -> concurrent.futures.Future[None]:
        """Report these requests failed now, the stock way (blocks invalid, request
        finished), and make sure nothing is read for them later."""
        recv = self.w.kv_recv_thread
        for rid in tokens:
            if not isinstance(rid, str):
                continue
            with self._lock:
                if rid in self._fenced:
                    continue
                self._fenced[rid] = None
                while len(self._fenced) > MAX_FENCED:
                    self._fenced.popitem(last=False)
                blocks = self._blocks.get(rid)
            if blocks is not None:
                # the receiving thread's own report (under its lock): invalid, finished
                type(recv)._mark_failed_recv_request(recv, rid, blocks)
                recv.task_tracker.update_done_task_count(rid)
                log.info("shmhb: request %s failed at the drop of its producer; nothing "
                         "will be read for it", rid)
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        done.set_result(None)
        return done

    def evict_engine(self, engine_id: str) -> None:
        recv = self.w.kv_recv_thread
        if recv is None or engine_id == recv.local_engine_id:
            return
        with recv.remote_metadata_lock:
            dropped = [getattr(recv, t).pop(engine_id, None) is not None for t in TABLES]
        with self._lock:
            paths = self._paths.pop(engine_id, set())
        closed = 0
        with recv.remote_sockets_lock:
            for path in paths:
                for sock in recv.remote_sockets.pop(path, ()):
                    _close(sock)
                    closed += 1
        if any(dropped) or closed:
            log.info("shmhb: vllm-ascend's tables forget engine %s (%d pooled socket(s) "
                     "closed): its next request asks its side channel anew", engine_id, closed)

    def evict_consumer(self, endpoint: str) -> None:
        return  # a producer holds nothing per consumer it could tell apart (docstring)

    def cached_engines(self) -> set[str]:
        recv = self.w.kv_recv_thread
        if recv is None:
            return set()
        return {e for e in recv.kv_caches_base_addr if e != recv.local_engine_id}


def _close(sock: Any) -> None:
    """An idle pooled REQ socket and the context it was made with (one each in stock)."""
    ctx = sock.context
    sock.close(linger=0)
    ctx.term()


class _GoAheadEngine:
    """The receiving thread's transfer engine, with the consumer's go-ahead before each
    read; everything else goes to the engine itself."""

    def __init__(self, engine: Any, adapter: AscendMooncakeAdapter) -> None:
        self._engine = engine
        self._adapter = adapter

    def batch_transfer_sync_read(self, session: str, src: Any, dst: Any, lengths: Any) -> int:
        if not self._adapter.read_allowed():
            return -1  # stock fails the task on a negative return: nothing was read
        return int(self._engine.batch_transfer_sync_read(session, src, dst, lengths))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)
