"""One SGLang disaggregation rank, prefill or decode, driven over stdin/stdout (JSON
lines) by ``tests/sglang/stack.py``.

It builds what SGLang 0.5.23's scheduler builds for P/D on the Mooncake backend, with the
real classes: ``ServerArgs`` for a config-only model directory on CPU, the process's
runtime context (``publish``), the gloo groups of a one-rank world, the shared Mooncake
transfer engine (TCP), the bootstrap server (prefill), and the manager, sender and
receiver that ``get_kv_class`` returns.  The KV pool is one CPU tensor of ``--pages``
pages; a prefill fills a room's pages with bytes derived from the room's seed, so a
decode can tell a right transfer (``expected_digest``) from none (``zeros_digest``).

With ``--http-port`` it also serves an HTTP front there (``tests/sglang/front.py``), a
stand-in for SGLang's HTTP server: a router's P/D requests become rooms.

Before anything is built it loads SGLang's plugins as every scheduler process of a real
server does (``load_plugins``): with ``SHMHB_SGLANG=1`` in its environment, shmhb's entry
point installs the wrapped manager; without it the rank is stock.

Commands (``op``): ``prefill`` (a room: its sender waits for the decode's metadata, then
sends unless ``hold``; with ``split`` N, in two chunks: the first N pages, then the rest
on ``rest``), ``go`` (send a held room), ``rest`` (send a split room's second chunk), ``recv`` (a room on the decode: its
receiver sends its metadata and waits), ``digest`` (of decode pages), ``landed`` (how
many pages hold bytes), ``state`` (the decode manager's tables), ``quit``.  Events
(``ev``): ``ready``, ``waiting``, ``metadata_sent``, ``sent``, ``send_failed``,
``received``, ``recv_failed``, ``digest``, ``landed``, ``state``; with the HTTP front,
``served`` (a request's room served).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import threading
import time
from typing import Any

PAGE_BYTES = 64 * 1024
AUX_BYTES = 64
AUX_SLOTS = 256

_out_lock = threading.Lock()


def emit(ev: str, **kw: Any) -> None:
    with _out_lock:
        sys.stdout.write(json.dumps({"ev": ev, "t": time.monotonic(), **kw}) + "\n")
        sys.stdout.flush()


def room_bytes(seed: int, pages: int) -> bytes:
    """What a prefill writes for a room of ``pages`` pages seeded ``seed``."""
    block = hashlib.sha256(f"room-{seed}".encode()).digest() * (PAGE_BYTES // 32)
    return block * pages


def expected_digest(seed: int, pages: int) -> str:
    return hashlib.sha256(room_bytes(seed, pages)).hexdigest()[:16]


def zeros_digest(pages: int) -> str:
    return hashlib.sha256(bytes(PAGE_BYTES * pages)).hexdigest()[:16]


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=["prefill", "decode"], required=True)
    ap.add_argument("--ip", required=True)
    ap.add_argument("--bootstrap-port", type=int, required=True)
    ap.add_argument("--dist-port", type=int, required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--http-port", type=int, default=0,
                    help="serve an HTTP front on it (tests/sglang/front.py): requests from a "
                         "router become rooms")
    return ap.parse_args()


def write_model(d: str) -> None:
    """A config-only model directory: all SGLang reads here (no weights, no tokenizer)."""
    os.makedirs(d, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
           "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2,
           "num_hidden_layers": 1, "vocab_size": 256, "max_position_embeddings": 512,
           "rms_norm_eps": 1e-6, "torch_dtype": "float32", "bos_token_id": 1,
           "eos_token_id": 2}
    path = os.path.join(d, "config.json")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(cfg, f)
        os.replace(tmp, path)


class Engine:
    def __init__(self, a: argparse.Namespace) -> None:
        os.environ["SGLANG_HOST_IP"] = a.ip  # the manager's local_ip
        from sglang.srt.plugins import load_plugins
        load_plugins()  # what run_scheduler_process does first
        import torch
        from sglang.srt.disaggregation.base import KVArgs
        from sglang.srt.disaggregation.utils import (DisaggregationMode, KVClassType,
                                                     TransferBackend, get_kv_class)
        from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
            init_mooncake_transfer_engine)
        from sglang.srt.distributed.parallel_state import (init_distributed_environment,
                                                          initialize_model_parallel)
        from sglang.srt.runtime_context import SpawnRanks, publish
        from sglang.srt.server_args import ServerArgs

        self.role, self.ip, self.pages = a.role, a.ip, a.pages
        write_model(a.model_dir)
        sa = ServerArgs(model_path=a.model_dir, device="cpu", skip_tokenizer_init=True,
                        disaggregation_mode=a.role, disaggregation_transfer_backend="mooncake",
                        host=a.ip, disaggregation_bootstrap_port=a.bootstrap_port)
        publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=0))
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://{a.ip}:{a.dist_port}")
        initialize_model_parallel(backend="gloo")
        init_mooncake_transfer_engine(hostname=a.ip)

        self.kv = torch.zeros(a.pages * PAGE_BYTES, dtype=torch.uint8)
        self.aux = torch.zeros(AUX_SLOTS * AUX_BYTES, dtype=torch.uint8)
        k = KVArgs()
        k.engine_rank, k.pp_rank, k.system_dp_rank = 0, 0, 0
        k.kv_data_ptrs, k.kv_data_lens = [self.kv.data_ptr()], [self.kv.numel()]
        k.kv_item_lens, k.kv_layer_ids = [PAGE_BYTES], [0]
        k.kv_cache_dtype_str, k.kv_layout = "float32", None
        k.aux_data_ptrs, k.aux_data_lens = [self.aux.data_ptr()], [self.aux.numel()]
        k.aux_item_lens = [AUX_BYTES]
        k.state_types, k.state_data_ptrs, k.state_data_lens, k.state_item_lens = [], [], [], []
        k.state_layer_ids, k.state_dim_per_tensor, k.state_slice_outer_counts = [], [], []
        k.state_conv_shard_groups, k.swa_kv_cache_layout = [], None
        k.is_hybrid_mla_backend, k.ib_device, k.gpu_id = False, None, 0
        k.kv_head_num, k.total_kv_head_num, k.page_size, k.num_draft_entries = 2, 2, 1, 0
        k.prefill_start_layer, k.prefill_end_layer, k.rust_http_port = 0, 1, None

        self.backend = TransferBackend.MOONCAKE
        self.get_kv_class, self.KVClassType = get_kv_class, KVClassType
        mode = DisaggregationMode.PREFILL if a.role == "prefill" else DisaggregationMode.DECODE
        self.bootstrap = f"{a.ip}:{a.bootstrap_port}"
        if a.role == "prefill":  # the tokenizer process runs it in a real server
            server = get_kv_class(self.backend, KVClassType.BOOTSTRAP_SERVER)
            self.server = server(host=a.ip, port=a.bootstrap_port)
        self.mgr = get_kv_class(self.backend, KVClassType.MANAGER)(k, mode, sa, False)
        self.held: dict[int, threading.Event] = {}
        self.rest: dict[int, threading.Event] = {}
        if a.http_port:
            from .front import Front
            Front(self, a.http_port, emit)
        emit("ready", pid=os.getpid(), rank_port=self.mgr.rank_port,
             session=self.mgr.get_session_id(), manager=type(self.mgr).__module__,
             bootstrap=self.bootstrap, http_port=a.http_port or None)

    def fill(self, start: int, seed: int, pages: int) -> None:
        """Write the bytes of a room seeded ``seed`` into pages ``start``..."""
        import numpy as np
        view = self.kv[start * PAGE_BYTES:(start + pages) * PAGE_BYTES].numpy()
        view[:] = np.frombuffer(room_bytes(seed, pages), dtype=np.uint8)

    def zero(self, start: int, pages: int) -> None:
        self.kv[start * PAGE_BYTES:(start + pages) * PAGE_BYTES] = 0

    # -- prefill ---------------------------------------------------------------------------

    def prefill(self, room: int, seed: int, start: int, pages: int, hold: bool,
                split: int = 0) -> None:
        import numpy as np
        from sglang.srt.disaggregation.base import KVPoll
        self.fill(start, seed, pages)
        sender = self.get_kv_class(self.backend, self.KVClassType.SENDER)(
            self.mgr, self.bootstrap, room)
        sender.init(pages, room % AUX_SLOTS)
        go = self.held.setdefault(room, threading.Event())
        if not hold:
            go.set()
        t0 = time.monotonic()
        announced = False
        while True:
            st = sender.poll()
            if st == KVPoll.Failed:
                return emit("send_failed", room=room, after_s=time.monotonic() - t0,
                            reason=self.mgr.failure_records.get(room, ""))
            if st == KVPoll.WaitingForInput:
                if not announced:
                    emit("waiting", room=room)
                    announced = True
                if go.is_set():
                    break
            time.sleep(0.002)
        indices = np.arange(start, start + pages, dtype=np.int32)
        if 0 < split < pages:  # two chunks, as a chunked prefill sends them
            sender.send(indices[:split])
            rest = self.rest.setdefault(room, threading.Event())
            while not rest.wait(0.002):
                if sender.poll() == KVPoll.Failed:
                    return emit("send_failed", room=room, after_s=time.monotonic() - t0,
                                reason=self.mgr.failure_records.get(room, ""))
            indices = indices[split:]
        sender.send(indices)
        while True:
            st = sender.poll()
            if st == KVPoll.Success:
                return emit("sent", room=room, after_s=time.monotonic() - t0)
            if st == KVPoll.Failed:
                return emit("send_failed", room=room, after_s=time.monotonic() - t0,
                            reason=self.mgr.failure_records.get(room, ""))
            time.sleep(0.002)

    # -- decode ----------------------------------------------------------------------------

    def recv(self, room: int, bootstrap: str, start: int, pages: int) -> None:
        import numpy as np
        from sglang.srt.disaggregation.base import KVPoll
        self.zero(start, pages)
        t0 = time.monotonic()
        if not self.mgr.try_ensure_parallel_info(bootstrap):
            # the decode scheduler keeps such a request queued and asks again next step;
            # here it is reported at once: the prefill's bootstrap server is unreachable
            return emit("recv_failed", room=room, after_s=time.monotonic() - t0,
                        reason="no parallel info: bootstrap server unreachable")
        receiver = self.get_kv_class(self.backend, self.KVClassType.RECEIVER)(
            self.mgr, bootstrap, room)
        receiver.init(0)
        receiver.send_metadata(np.arange(start, start + pages, dtype=np.int32),
                               room % AUX_SLOTS)
        emit("metadata_sent", room=room)
        while True:
            st = receiver.poll()
            if st in (KVPoll.Success, KVPoll.Failed):
                break
            time.sleep(0.002)
        after = time.monotonic() - t0
        if st == KVPoll.Success:
            receiver.clear()
            return emit("received", room=room, after_s=after, digest=self.digest(start, pages))
        reason = ""
        try:
            receiver.failure_exception()
        except Exception as e:  # KVTransferError: what the decode scheduler reports
            reason = str(e)
        emit("recv_failed", room=room, after_s=after, reason=reason)

    def digest(self, start: int, pages: int) -> str:
        b = self.kv[start * PAGE_BYTES:(start + pages) * PAGE_BYTES].numpy().tobytes()
        return hashlib.sha256(b).hexdigest()[:16]

    def landed(self, start: int, pages: int) -> int:
        """How many of these pages hold anything but zeros (a write under way)."""
        v = self.kv[start * PAGE_BYTES:(start + pages) * PAGE_BYTES].view(pages, PAGE_BYTES)
        return int(v[:, :64].any(dim=1).sum())

    def state(self) -> dict[str, Any]:
        m = self.mgr
        with m.connection_lock:
            return {"connection_pool": sorted(m.connection_pool),
                    "prefill_info_table": sorted(m.prefill_info_table),
                    "rooms": {k: sorted(v) for k, v in m.addr_to_rooms_tracker.items() if v}}


def main() -> None:
    a = parse()
    eng = Engine(a)
    for line in sys.stdin:
        try:
            cmd = json.loads(line)
        except ValueError:
            continue
        op = cmd.get("op")
        if op == "quit":
            break
        if op == "prefill":
            threading.Thread(target=eng.prefill, daemon=True, args=(
                cmd["room"], cmd["seed"], cmd.get("start", 0), cmd.get("pages", a.pages),
                cmd.get("hold", False), cmd.get("split", 0))).start()
        elif op == "go":
            eng.held.setdefault(cmd["room"], threading.Event()).set()
        elif op == "rest":
            eng.rest.setdefault(cmd["room"], threading.Event()).set()
        elif op == "recv":
            threading.Thread(target=eng.recv, daemon=True, args=(
                cmd["room"], cmd["bootstrap"], cmd.get("start", 0),
                cmd.get("pages", a.pages))).start()
        elif op == "digest":
            emit("digest", digest=eng.digest(cmd.get("start", 0), cmd.get("pages", a.pages)))
        elif op == "landed":
            emit("landed", pages=eng.landed(cmd.get("start", 0), cmd.get("pages", a.pages)))
        elif op == "state":
            emit("state", **eng.state())
    import shmhb.sglang
    shmhb.sglang.shutdown()  # a wrapped rank leaves its board: peers read LEFT
    os._exit(0)  # SGLang's daemon threads and Mooncake's engine hold no state worth a teardown


if __name__ == "__main__":
    main()
