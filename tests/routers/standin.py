"""A stand-in P/D serving instance, for the real routers on loopback (vLLM itself cannot
serve on a CPU-only machine).  ``python -m tests.routers.standin --role prefill ...``

It answers what vllm-router, sglang-router and smg call, as vLLM / SGLang would:

- ``GET /health`` (200), ``/metrics``, ``/v1/models``, ``/server_info`` and
  ``/model_info``; ``POST /v1/completions`` (and ``/render``, which vllm-router's
  cache-aware policy asks first).  That is all the two routers ask at registration
  (vllm-router: ``/health``, ``/metrics``; sglang-router: those and ``/server_info``,
  ``/model_info``, falling back to ``/get_server_info``, ``/get_model_info`` on a 404).
  sglang-router turns the two info documents into the worker's labels and loads the
  tokenizer a ``tokenizer_path`` or ``model_path`` label names, from the model hub when
  it is no local directory: a stand-in serves no model, so its info documents are empty
  and nothing is looked up (``tests/routers/stack.py``'s ``hub_lookups`` checks the
  routers' logs for any attempt).
- A **prefill** also serves its KV bootstrap address (``--bootstrap-port``): ``GET
  /query`` answers ``{dp_rank: {engine_id, worker_addr}}`` as vLLM's
  ``MooncakeBootstrapServer`` does (vllm-router reads engine ids from it at startup), and
  ``GET /kv?engine_id=E`` stands for the KV transfer: it answers after the prefill's
  compute time only if E is this engine (a restarted prefill has a new id), so a decode
  whose prefill is dead or stopped fails or hangs as a real one would.
- A **decode** given a request with ``kv_transfer_params`` (vllm-router, Mooncake: the
  prefill first, then the decode with ``remote_bootstrap_addr``/``remote_engine_id``) or
  ``bootstrap_host``/``bootstrap_port`` (sglang-router: both at once) fetches the KV
  from the prefill's ``/kv`` first; a failed or timed-out fetch is HTTP 500.

With ``--serve-after-s S`` it registers first and starts its HTTP servers S seconds later
(until then a connection is refused), as a vLLM engine registers its KV caches before its
API server answers.

On SIGTERM it drains as a wrapped engine does (``shmhb.board.drain.SigtermDrain``, the
connector's own path): its instance reads draining, it serves what it owes (requests in
flight; for a prefill, the KV of every request it answered that no decode has fetched
yet) for up to ``--drain-timeout-s`` (0: it stops at once), then stops.

It registers on its host's board the way ``ShmhbConnector`` does: its rank slot
``vllm/<engine>/dp0/tp0/pp0`` and its instance slot (``shmhb.board.instances.register_instance``)
with its serving and bootstrap addresses, then prints ``ready``.  Every request it
takes is logged as a line ``<CLOCK_MONOTONIC ns> <path>`` to ``--log`` (a prefill also
logs ``/kv`` for each KV fetch it served) (the bench's
record of who served what, comparable across processes of one boot).
"""

from __future__ import annotations

import argparse
import http.client
import json
import signal
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import shmhb
from shmhb.board.drain import DrainConfig, SigtermDrain
from shmhb.board.instances import register_instance

KV_TIMEOUT_S = 3.0


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128


#: the paths a P/D request comes on (smg and sglang-router keep the client's)
GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions", "/generate")


def answer(role: str, engine: str) -> dict[str, Any]:
    """A served request's body, as the routers read it: a prefill's carries its engine id
    for vllm-router's decode request, a decode's is the completion."""
    if role == "prefill":
        return {"id": "p", "object": "text_completion",
                "choices": [{"text": "", "index": 0, "finish_reason": "length"}],
                "kv_transfer_params": {"remote_engine_id": engine}}
    return {"id": "d", "object": "text_completion",
            "choices": [{"text": "ok", "index": 0, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}


def send_json(h: BaseHTTPRequestHandler, code: int, doc: Any) -> None:
    out = json.dumps(doc).encode()
    h.send_response(code)
    h.send_header("content-type", "application/json")
    h.send_header("content-length", str(len(out)))
    h.end_headers()
    h.wfile.write(out)


class Answers(BaseHTTPRequestHandler):
    """What a serving instance answers a router besides its requests (GET ``/health``,
    ``/metrics``, ``/v1/models``, ``/server_info``, ``/model_info``) and ``reply``; a
    subclass sets ``role`` and ``engine_id`` and serves POST.  Also the HTTP front of
    tests/sglang's rank processes (``tests/sglang/front.py``)."""

    protocol_version = "HTTP/1.1"
    role = ""
    engine_id = ""

    def log_message(self, *args: Any) -> None:
        pass

    def reply(self, code: int, doc: Any) -> None:
        send_json(self, code, doc)

    def json_body(self) -> Any:
        """The request's JSON body (``{}`` when empty); ``ValueError`` when it is none,
        a bad content-length included."""
        n = int(self.headers.get("content-length") or 0)
        return json.loads(self.rfile.read(n) or b"{}")

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            out = b"# stand-in\n"
            self.send_response(200)
            self.send_header("content-type", "text/plain")
            self.send_header("content-length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)
        elif path == "/v1/models":
            self.reply(200, {"object": "list", "data": [{"id": "standin", "object": "model"}]})
        elif path == "/health":
            self.reply(200, {"role": self.role, "engine_id": self.engine_id})
        elif path in ("/server_info", "/model_info"):
            self.reply(200, {})  # no model_path, no tokenizer_path: see the docstring
        else:
            self.reply(404, {"error": path})


def _fetch_kv(host: str, port: int, engine: str | None, room: object) -> str | None:
    """The stand-in KV transfer: None if it worked, else why not."""
    q = urllib.parse.urlencode({"engine_id": engine or "", "room": room or ""})
    conn = http.client.HTTPConnection(host, port, timeout=KV_TIMEOUT_S)
    try:
        conn.request("GET", "/kv?" + q)
        r = conn.getresponse()
        body = r.read()
        return None if r.status == 200 else f"kv transfer: HTTP {r.status} {body[:100]!r}"
    except (OSError, http.client.HTTPException) as e:
        return f"kv transfer from {host}:{port}: {e}"
    finally:
        conn.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=("prefill", "decode"), required=True)
    ap.add_argument("--host", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--bootstrap-port", type=int)
    ap.add_argument("--board", required=True)
    ap.add_argument("--engine-id", required=True)
    ap.add_argument("--no-serving-url", action="store_true",
                    help="register no serving address (the feeder matches by bootstrap port)")
    ap.add_argument("--compute-ms", type=float, default=20.0)
    ap.add_argument("--serve-after-s", type=float, default=0.0,
                    help="register on the board first, start the HTTP servers this much later "
                         "(as vLLM registers its KV caches before its API server is up)")
    ap.add_argument("--drain-timeout-s", type=float, default=10.0)
    ap.add_argument("--log", required=True)
    a = ap.parse_args(argv)
    assert a.host.startswith("127."), "stand-ins serve on loopback only"
    engine = a.engine_id
    log = open(a.log, "a", buffering=1)
    log_lock = threading.Lock()

    def note(path: str) -> None:
        with log_lock:
            log.write(f"{time.monotonic_ns()} {path}\n")

    # What it owes, for its drain: requests in flight, and (a prefill) the KV of requests
    # it took minus the KV fetches it served (signed: a decode of sglang-router's may ask
    # before the prefill's own request arrives).
    owed = {"in_flight": 0, "kv": 0}
    owed_lock = threading.Lock()

    def count(what: str, n: int) -> None:
        with owed_lock:
            owed[what] += n

    def owing() -> int:
        with owed_lock:
            return owed["in_flight"] + max(owed["kv"], 0)

    class Api(Answers):
        role, engine_id = a.role, engine

        def do_POST(self) -> None:
            count("in_flight", 1)
            try:
                self.post()
            finally:
                count("in_flight", -1)

        def post(self) -> None:
            try:
                body = self.json_body()
            except ValueError:
                return self.reply(400, {"error": "not JSON"})
            path = self.path.split("?", 1)[0]
            if path.endswith("/render"):
                return self.reply(200, {"prompt_token_ids": [1, 2, 3]})
            if path not in GENERATE_PATHS:
                return self.reply(404, {"error": path})
            note(path)
            if a.role == "prefill":
                count("kv", 1)
                time.sleep(a.compute_ms / 1000)
                return self.reply(200, answer("prefill", engine))
            kv = body.get("kv_transfer_params") if isinstance(body, dict) else None
            why = None
            if isinstance(kv, dict) and kv.get("do_remote_prefill"):
                u = urllib.parse.urlsplit(str(kv.get("remote_bootstrap_addr", "")))
                if not (u.hostname or "").startswith("127.") or u.port is None:
                    return self.reply(400, {"error": "remote_bootstrap_addr is not loopback"})
                why = _fetch_kv(u.hostname or "", u.port, kv.get("remote_engine_id"),
                                kv.get("transfer_id"))
            elif isinstance(body, dict) and body.get("bootstrap_host"):
                h, p = str(body["bootstrap_host"]), body.get("bootstrap_port")
                if not h.startswith("127.") or not isinstance(p, int):
                    return self.reply(400, {"error": "bootstrap address is not loopback"})
                why = _fetch_kv(h, p, None, body.get("bootstrap_room"))
            if why is not None:
                return self.reply(500, {"error": why})
            return self.reply(200, answer("decode", engine))

    class Boot(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            u = urllib.parse.urlsplit(self.path)
            if u.path == "/query":
                doc: Any = {"0": {"engine_id": engine,
                                  "worker_addr": {"0": {"0": f"{a.host}:{a.bootstrap_port}"}}}}
                code = 200
            elif u.path == "/kv":
                want = urllib.parse.parse_qs(u.query).get("engine_id", [""])[0]
                time.sleep(a.compute_ms / 1000)
                code, doc = (200, {"ok": True}) if want in ("", engine) else \
                    (404, {"error": f"engine {want} not here (this is {engine})"})
                if code == 200:
                    note("/kv")  # a decode got its KV from this engine: it served
                    count("kv", -1)
            else:
                code, doc = 404, {"error": u.path}
            send_json(self, code, doc)

    servers: list[Server] = []

    def serve() -> None:
        servers.append(Server((a.host, a.port), Api))
        if a.role == "prefill":
            servers.append(Server((a.host, a.bootstrap_port), Boot))
        for s in servers:
            threading.Thread(target=s.serve_forever, daemon=True).start()
    if a.serve_after_s <= 0:
        serve()
    else:  # until then a connection is refused, as to an engine whose server is not up
        later = threading.Timer(a.serve_after_s, serve)
        later.daemon = True
        later.start()

    board = shmhb.Board.attach(a.board)
    boot = f"{a.host}:{a.bootstrap_port}" if a.role == "prefill" else None
    # the rank's own endpoint (as vLLM's: its transfer engine), never the serving address
    rank_eps = (boot,) if boot else (f"{a.host}:{a.port + 1}",)
    hb = board.register(f"vllm/{engine}/dp0/tp0/pp0", endpoints=rank_eps, agent=False).start(0.05)
    register_instance(board, hb, a.role, engine,
                      serving=None if a.no_serving_url else f"{a.host}:{a.port}",
                      bootstrap=boot, interval_s=0.05)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    SigtermDrain(board, engine, owing, DrainConfig(timeout_s=a.drain_timeout_s)).install()
    print("ready", flush=True)
    done.wait()
    hb.close()  # the instance slot closes with it: LEFT
    for s in servers:
        s.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
