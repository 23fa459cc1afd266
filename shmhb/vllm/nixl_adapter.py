"""The adapter for vLLM 0.32's and 0.33's ``NixlConnector`` in pull mode (the contract is
``inner``'s docstring).

**Who moves the bytes.**  In pull mode the consumer (decode) posts a NIXL READ of the
producer's blocks into its own; the producer only serves it and, once told by the READ's
notification, frees its blocks (or when its lease, ``kv_lease_duration``, 30 s by
default, runs out without the consumer's heartbeats).  So the consumer alone decides
whether bytes may still land in its blocks, and every decision below is made on one
thread, the worker's (the model runner's): ``start_load_kv`` posts READs there, and
``get_transfer_results`` (every step) reports them there, where ``WorkerGuard.poll``
also runs its drops.  The handshake thread only records remote agents and queues
requests; it posts nothing.  No go-ahead round trip is needed: posting is the consumer's
own act (what the wrapper adds per request is a board read, a dict entry and the load
table's lock).

**The fence.**  A READ once posted cannot be called back: measured with NIXL 1.5.1's UCX
backend over TCP, a READ from a SIGSTOPped producer, its handle released
(``release_xfer_handle`` returned without error) and the producer's agent removed
(``remove_remote_agent``), still landed in full once the producer resumed.  So the
adapter treats posting as the go-ahead of a pull, taken by the consumer itself, on
its worker thread (``hooks.go_ahead``: the load goes WAITING -> GRANTED, never failed
early), and fences only what has not been posted:

* a load not posted yet (its handshake pending, or queued behind one) is failed at the
  drop, the stock way (``_handle_failed_transfer`` with no handle), and remembered:
  when its handshake completes later, ``_read_blocks_for_req`` is not run for it, so no
  READ is ever posted into blocks reported failed;
* a load whose READ is posted is left to NIXL: it completes once the producer resumes,
  or fails as soon as the transport sees the producer gone (a kill: ~0.2 s here).  A
  producer that stays stopped holds it as it does stock; the window is between the
  producer's stop and the board's verdict (dead-after), after which the scheduler
  vetoes new loads from it before anything is posted.

**Eviction.**  A dropped producer engine's cached agent metadata goes
(``_cleanup_remote_engine``, stock's own teardown), so the next request to that engine
id handshakes with whatever process serves it now: stock reuses a restarted engine's
dead agent under the same id and fails every request to it.  While READs to the engine
are still outstanding the eviction waits and is retried every step.

**Producer side.**  Nothing to add: the producer holds a finished request's blocks for
its lease at most (vLLM's own heartbeats renew it while the consumer lives), and a load
failed before its READ never notifies it, so the lease frees them.

Uses, on ``connector.connector_worker`` (``NixlPullConnectorWorker``):
``_read_blocks_for_req`` and ``get_transfer_results`` (wrapped), ``_recving_transfers``,
``_recv_failures``, ``_handle_failed_transfer``, ``_recving_metadata``,
``_remote_agents``, ``_cleanup_remote_engine``, ``vllm_config``, ``tp_rank``;
``ReqMeta.remote`` (``host``, ``port``, ``engine_id``), ``ReqMeta.local_block_ids``.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections import OrderedDict
from typing import Any

from ..board.config import format_hostport
from ..errors import ShmhbError
from .inner import Hooks, InnerAdapter, check_release, host_port_address
from .settings import Rank

log = logging.getLogger(__name__)

#: requests failed by the fence before their READ was posted, remembered so a handshake
#: that completes later posts nothing for them (the oldest are forgotten past this)
MAX_FENCED = 65536

#: what the adapter reaches on the worker (``check`` fails at startup without them)
NEEDS = ("_read_blocks_for_req", "get_transfer_results", "_recving_transfers",
         "_recv_failures", "_handle_failed_transfer",
         "_recving_metadata", "_remote_agents", "_cleanup_remote_engine", "vllm_config",
         "tp_rank")


class NixlAdapter(InnerAdapter):
    """vLLM 0.32 and 0.33 ``NixlConnector`` (= ``NixlPullConnector``): see the module
    docstring."""

    names = ("NixlConnector", "NixlPullConnector")
    asks_go_ahead = False

    def __init__(self, connector: Any) -> None:
        super().__init__(connector)
        self.w = connector.connector_worker
        self._started: dict[str, str] = {}  # request -> producer endpoint (its loads)
        self._fenced: OrderedDict[str, None] = OrderedDict()  # failed before posting
        self._evict: set[str] = set()  # engines to forget once their READs are over

    #: the engine's handshake listener, as a request's transfer params name it
    address_fields = ("remote_host", "remote_port")

    @staticmethod
    def producer_address(*values: object) -> str | None:
        return host_port_address(*values)

    def check(self) -> None:
        check_release("NIXL")
        if getattr(type(self.w), "_TRANSFER_MODE", "pull") != "pull":
            raise TypeError("shmhb's NIXL adapter serves pull mode (NixlConnector); "
                            f"{type(self.w).__name__} is not")
        missing = [n for n in NEEDS if not hasattr(self.w, n)]
        if missing:
            raise TypeError(f"this NixlConnector lacks {missing}: the shmhb adapter was "
                            "written for vLLM 0.32 and 0.33; pin one of them or update "
                            "shmhb.vllm.nixl_adapter")

    def _ktc(self) -> Any:
        return self.w.vllm_config.kv_transfer_config

    def consumes(self) -> bool:
        return bool(self._ktc().is_kv_consumer)

    def produces(self) -> bool:
        return bool(self._ktc().is_kv_producer)

    def rank(self) -> Rank:
        pc = self.w.vllm_config.parallel_config
        return Rank(dp=int(getattr(pc, "data_parallel_index", 0) or 0), tp=int(self.w.tp_rank),
                    pp=int(getattr(self.w, "pp_rank", 0) or 0))

    def endpoints(self) -> dict[str, str]:
        """A producer's side channel (the engine's handshake listener, one per DP rank,
        the ``remote_host``/``remote_port`` its requests carry), registered by its first
        rank: consumers follow the engine at that address.  Other ranks and consumers
        register no endpoint (nobody reaches them by address)."""
        if not self.produces():
            return {}
        r = self.rank()
        if r.tp != 0 or r.pp != 0:
            return {}
        from vllm import envs
        port = int(envs.VLLM_NIXL_SIDE_CHANNEL_PORT) + r.dp
        try:
            return {"side": format_hostport(str(envs.VLLM_NIXL_SIDE_CHANNEL_HOST), port)}
        except ShmhbError as e:
            log.warning("shmhb: the NIXL side channel %s:%d is not an address the board "
                        "takes (%s): consumers cannot follow this engine; set "
                        "VLLM_NIXL_SIDE_CHANNEL_HOST to its IP", envs.VLLM_NIXL_SIDE_CHANNEL_HOST,
                        port, e)
            return {}

    # -- in the path of loads ----------------------------------------------------------------

    def install(self, hooks: Hooks) -> None:
        if not self.consumes():
            return  # a producer serves READs: nothing of its own to fence
        w = self.w
        read = w._read_blocks_for_req
        results = w.get_transfer_results

        def read_blocks_for_req(req_id: str, meta: Any) -> None:
            # On the worker thread, for a new request and again once its handshake is done.
            if req_id in self._fenced:
                return  # failed by the fence while it waited: never read into its blocks
            remote = meta.remote
            ep = self._started.get(req_id)
            if ep is None and remote is not None and any(meta.local_block_ids):
                ep = self.producer_address(remote.host, remote.port)
                if ep is not None:
                    blocks = frozenset(b for g in meta.local_block_ids for b in g)
                    if not hooks.load_started(ep, str(remote.engine_id), {req_id: blocks}, req_id):
                        self._fail_unposted(req_id)
                        return
                    self._started[req_id] = ep
            if ep is not None and remote is not None and remote.engine_id in w._remote_agents:
                # it posts now (the engine is known): the consumer's own go-ahead.  (A
                # handshake finishing between this look and the inner's is a READ
                # posted while the load reads WAITING: the fence still leaves any
                # request with a READ posted alone, below.)
                if not hooks.go_ahead(ep, [req_id]):
                    return  # given up meanwhile: failed already, nothing posted
            read(req_id, meta)

        def get_transfer_results() -> Any:
            self._retry()
            out = results()
            for r in out.finished_recving:
                ep = self._started.pop(r, None)
                if ep is not None:
                    hooks.load_ended(ep, [r])
            return out

        w._read_blocks_for_req = read_blocks_for_req
        w.get_transfer_results = get_transfer_results

    def _fail_unposted(self, req_id: str) -> None:
        """Report ``req_id`` failed the stock way and post nothing for it later."""
        self._fenced[req_id] = None
        while len(self._fenced) > MAX_FENCED:
            self._fenced.popitem(last=False)
        self.w._handle_failed_transfer(req_id, None, self.w._recv_failures,
                                       record_failed_transfer=False)

    # -- fences and evictions (the worker thread: WorkerGuard.poll) ---------------------------

    def fence(self, tokens: list[object]) -> concurrent.futures.Future[None]:
        for req_id in tokens:
            if isinstance(req_id, str):
                self._fence_one(req_id)
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        done.set_result(None)
        return done

    def _fence_one(self, req_id: str) -> None:
        if self.w._recving_transfers.get(req_id):
            log.info("shmhb: request %s has a NIXL READ posted: it is left to finish or "
                     "fail (a posted READ cannot be called back)", req_id)
            return
        self._fail_unposted(req_id)

    def evict_engine(self, engine_id: str) -> None:
        self._evict.add(engine_id)
        self._retry()

    def _retry(self) -> None:
        """Forget the engines to evict whose READs are all over (worker thread)."""
        if not self._evict:
            return
        w = self.w
        busy = {str(m.remote.engine_id) for r, m in w._recving_metadata.items()
                if m.remote is not None and w._recving_transfers.get(r)}
        for eid in [e for e in self._evict if e not in busy]:
            self._evict.discard(eid)
            if eid in w._remote_agents:
                w._cleanup_remote_engine(eid, log_eviction=False)
                log.info("shmhb: NIXL agent metadata of engine %s dropped: its next "
                         "request handshakes anew", eid)

    def evict_consumer(self, endpoint: str) -> None:
        return  # a producer holds nothing per consumer beyond vLLM's lease

    def cached_engines(self) -> set[str]:
        return set(self.w._remote_agents)
