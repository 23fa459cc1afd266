"""SGLang 0.5.23's Mooncake manager and receiver with shmhb inside.  Importing this module
imports SGLang; ``shmhb.sglang.install`` puts these classes where ``get_kv_class`` finds
them (the ``sglang.srt.disaggregation.mooncake`` package, which it imports on every call),
so the prefill, the decode and SGLang's own tools all build them.

The subclasses only hand SGLang's state to the guards (``decode.DecodeGuard``,
``prefill.PrefillGuard``) through the ``DecodeRooms``/``PrefillRooms`` views below; the
attributes and methods they use are SGLang's (checked when the wrapper is installed on
the one release it supports, ``release.SUPPORTED``):

* decode: ``_send_bootstrap_message`` (every message a receiver sends a prefill rank,
  with the rank it goes to), ``clear`` (a room concluded), ``addr_to_rooms_tracker``,
  ``connection_pool``, ``prefill_info_table``, ``heartbeat_failures`` (what SGLang's own
  ``_handle_node_failure`` evicts), ``disconnect_endpoint`` (the cached sockets);
* decode, also: ``_handle_node_failure`` (SGLang's health check failing a prefill: its
  granted rooms are held until their leases end);
* prefill: ``_make_worker_recv`` (the bootstrap thread's reads of transfer requests),
  ``transfer_worker`` (its queue's ``get``: the chunk it works on next; then its
  ``check_status`` of the chunk's room once the chunk's ``wait_event`` is done, its last
  look at the room before it writes the chunk), ``conclude_failure`` (fail a room and
  tell its decode) and ``transfer_infos`` (a room's decode ranks);
* both: ``record_failure`` and ``update_status(room, KVPoll.Failed)``, how SGLang fails a
  room itself.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

from sglang.srt.disaggregation.base import KVPoll
from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager, MooncakeKVReceiver
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.utils.network import NetworkAddress

from ..errors import ShmhbError
from .decode import DecodeGuard
from .prefill import PrefillGuard
from .rank import RankInfo, endpoint
from .settings import SglangSettings
from .wire import STOCK_FRAMES, decode_extra

log = logging.getLogger(__name__)

#: how long a worker thread waits for the rank's registration at startup
READY_WAIT_S = 60.0
_CONCLUDED = (KVPoll.Success, KVPoll.Failed)
_live: weakref.WeakSet[ShmhbMooncakeKVManager] = weakref.WeakSet()


def close_all() -> None:
    """Every wrapped manager of this process leaves its board (peers read LEFT)."""
    for m in list(_live):
        m.shmhb_close()


class _Rooms:
    """The manager's rooms as both guards see them."""

    def __init__(self, m: ShmhbMooncakeKVManager) -> None:
        self.m = m

    def live(self, room: int) -> bool:
        return room in self.m.request_status and self.m.check_status(room) not in _CONCLUDED

    def fail(self, room: int, reason: str) -> None:
        if self.live(room):
            self.m.record_failure(room, reason)
            self.m.update_status(room, KVPoll.Failed)

    # -- decode -------------------------------------------------------------------------------

    def rooms_of(self, addr: str) -> list[int]:
        with self.m.connection_lock:
            return list(self.m.addr_to_rooms_tracker.get(addr, ()))

    def untrack(self, addr: str, rooms: set[int]) -> None:
        """Take ``rooms`` (held until their leases end) out of the prefill's rooms, so
        SGLang's own ``_handle_node_failure`` does not fail them."""
        with self.m.connection_lock:
            tracked = self.m.addr_to_rooms_tracker.get(addr)
            if tracked is not None:
                tracked.difference_update(rooms)

    def evict(self, addr: str) -> None:
        """What SGLang's ``_handle_node_failure`` evicts (its rooms are failed or held
        by the guard): the prefill's rank entries, parallel info and rooms, and the
        cached sockets to its ranks, so the next room asks the bootstrap server for the
        ranks again and no room goes to the dropped rank's port."""
        m = self.m
        stale = set()
        with m.connection_lock:
            for k in [k for k in m.connection_pool if k.startswith(f"{addr}_")]:
                for info in m.connection_pool.pop(k):
                    if info.get("rank_ip") and info.get("rank_port"):
                        stale.add(NetworkAddress(info["rank_ip"], int(info["rank_port"])).to_tcp())
            m.prefill_info_table.pop(addr, None)
            m.heartbeat_failures.pop(addr, None)
            m.addr_to_rooms_tracker.pop(addr, None)
        for ep in stale:
            MooncakeKVReceiver.disconnect_endpoint(ep)

    # -- prefill ------------------------------------------------------------------------------

    def targets(self, room: int) -> list[str]:
        infos = self.m.transfer_infos.get(room) or {}
        return [endpoint(i.endpoint, i.dst_port) for i in list(infos.values()) if not i.is_dummy]

    def rooms_for(self, ep: str) -> list[int]:
        return [room for room in list(self.m.transfer_infos) if ep in self.targets(room)
                and self.live(room)]


class _Armed(threading.local):
    """The chunk a transfer worker thread took off its queue and has not written yet."""

    chunk: Any = None


class _ArmingQueue:
    """A transfer worker's queue whose ``get`` notes, for the thread, the chunk it hands
    out (``check_status`` then decides on it right before the write); everything else
    is the queue's own."""

    def __init__(self, queue: Any, armed: _Armed) -> None:
        self.queue = queue
        self.armed = armed

    def get(self) -> Any:
        chunk = self.queue.get()
        self.armed.chunk = chunk  # None: the stop sentinel
        return chunk

    def __getattr__(self, name: str) -> Any:
        return getattr(self.queue, name)


class ShmhbMooncakeKVManager(MooncakeKVManager):  # type: ignore[misc]
    shmhb_decode: DecodeGuard | None = None
    shmhb_prefill: PrefillGuard | None = None

    def __init__(self, args: Any, disaggregation_mode: Any, server_args: Any,
                 is_mla_backend: bool | None = False) -> None:
        self.shmhb_ready = threading.Event()  # the worker threads start in super().__init__
        self._shmhb_armed = _Armed()
        settings = SglangSettings.from_env()
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        try:
            self._shmhb_register(settings)
        finally:
            self.shmhb_ready.set()
        _live.add(self)

    def _shmhb_register(self, settings: SglangSettings) -> None:
        ip = self.local_ip
        rank_ep = endpoint(ip, self.rank_port)
        session = self.get_session_id()
        first = self.attn_tp_rank == 0 and self.pp_rank == 0 and (self.attn_dp_rank or 0) == 0
        dims = dict(dp=int(self.attn_dp_rank or 0), tp=int(self.attn_tp_rank),
                    pp=int(self.pp_rank))
        if self.disaggregation_mode == DisaggregationMode.PREFILL:
            boot = endpoint(ip, self.bootstrap_port)
            eps = (rank_ep, session) + ((boot,) if first else ())
            self.shmhb_prefill = PrefillGuard(settings, _Rooms(self), RankInfo(
                "prefill", boot, endpoints=eps, bootstrap=boot, first=first, **dims))
        elif self.disaggregation_mode == DisaggregationMode.DECODE:
            self.shmhb_decode = DecodeGuard(settings, _Rooms(self), ip, lambda fence: RankInfo(
                "decode", rank_ep, endpoints=(rank_ep, session, fence), bootstrap=None,
                first=first, **dims))

    def shmhb_close(self) -> None:
        for g in (self.shmhb_decode, self.shmhb_prefill):
            if g is not None:
                g.close()

    # -- prefill: transfer requests read, chunks about to be written -----------------------

    def _make_worker_recv(self, socket: Any, timeout_ms: int = 500) -> Any:
        recv = super()._make_worker_recv(socket, timeout_ms)
        if self.disaggregation_mode != DisaggregationMode.PREFILL:
            return recv

        def shmhb_recv() -> Any:
            msg = recv()
            if msg is not None and len(msg) >= STOCK_FRAMES:
                self._shmhb_seen(msg)
            return msg
        return shmhb_recv

    def _shmhb_seen(self, msg: list[bytes]) -> None:
        """A transfer request (room, decode ip, decode rank port, session, ...)."""
        try:
            room = int(msg[0].decode("ascii"))
            ep = endpoint(msg[1].decode("ascii"), int(msg[2].decode("ascii")))
        except (ValueError, UnicodeDecodeError, ShmhbError):
            return  # not a transfer request (a registration, a control message)
        self.shmhb_ready.wait(READY_WAIT_S)
        if self.shmhb_prefill is not None:
            self.shmhb_prefill.seen(room, ep, decode_extra(msg))

    def transfer_worker(self, queue: Any, executor: Any, staging_buffer: Any = None,
                        worker_index: int = 0) -> Any:
        return super().transfer_worker(_ArmingQueue(queue, self._shmhb_armed), executor,
                                       staging_buffer, worker_index)

    def check_status(self, bootstrap_room: int) -> Any:
        """SGLang's, but on a prefill's transfer worker thread, at its last look at the
        room of the chunk it took (after the chunk's ``wait_event``: the forward that
        computes it) and before it writes the chunk: the guard decides there (the go-ahead,
        its lease), and a chunk it refuses reads as a failed room, which SGLang skips.
        Every chunk of a room goes through one worker thread (SGLang shards its queues by
        the room's decode sessions), so once the room fails here no chunk of it is
        written after."""
        status = super().check_status(bootstrap_room)
        armed = self._shmhb_armed
        chunk = armed.chunk
        if chunk is None or chunk.room != bootstrap_room or chunk.wait_event is not None:
            return status  # not that look (the scheduler's, or the one before the wait)
        armed.chunk = None
        if status == KVPoll.Failed:
            return status
        return KVPoll.Failed if self._shmhb_gate(bootstrap_room) else status

    def _shmhb_gate(self, room: int) -> bool:
        """Whether the chunk of ``room`` about to be written was refused (the room failed)."""
        self.shmhb_ready.wait(READY_WAIT_S)
        g = self.shmhb_prefill
        if g is None:
            return False
        v = g.may_write(room)
        if v.why is None:
            return False
        if v.lease_ran_out:
            self.conclude_failure(bootstrap_room=room, failure_reason=v.why)
        else:
            self.record_failure(room, v.why)
            self.update_status(room, KVPoll.Failed)
        return True

    # -- decode: SGLang's own health check failed a prefill --------------------------------------

    def _handle_node_failure(self, failed_bootstrap_addr: str) -> None:
        g = self.shmhb_decode
        if g is not None:
            g.node_failed(failed_bootstrap_addr)  # its granted rooms: held, not failed here
        super()._handle_node_failure(failed_bootstrap_addr)


class ShmhbMooncakeKVReceiver(MooncakeKVReceiver):  # type: ignore[misc]
    def _send_bootstrap_message(self, *, bootstrap_info: dict[str, Any], message: list[bytes],
                                operation: str) -> bool:
        g = getattr(self.kv_mgr, "shmhb_decode", None)
        if g is None:
            return bool(super()._send_bootstrap_message(
                bootstrap_info=bootstrap_info, message=message, operation=operation))
        try:
            ep = endpoint(str(bootstrap_info["rank_ip"]), int(bootstrap_info["rank_port"]))
        except (KeyError, ValueError, ShmhbError):
            ep = None
        if ep is not None:
            a = g.admit(self.bootstrap_room, self.bootstrap_addr, ep,
                        transfer=operation == "send_metadata",
                        dummy=bool(bootstrap_info.get("is_dummy")))
            if a.reason is not None:
                self.kv_mgr.record_failure(self.bootstrap_room, a.reason)
                self.conclude_state = KVPoll.Failed
                self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
                return False
            if a.frame is not None:
                message = [*message, a.frame]
        return bool(super()._send_bootstrap_message(
            bootstrap_info=bootstrap_info, message=message, operation=operation))

    def clear(self) -> None:
        super().clear()
        g = getattr(self.kv_mgr, "shmhb_decode", None)
        if g is not None and self.bootstrap_room is not None:
            g.room_done(self.bootstrap_room)
