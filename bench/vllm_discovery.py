"""``python -m bench.vllm_discovery``: what vllm-router's ZMQ service discovery does with
an instance that stops registering, an HTTP removal, and a re-registration.

vllm-router (PD mode, ``--kv-connector mooncake``, ``--vllm-discovery-address``) in
front of stand-in prefills p1, p2 and decode d1 (tests/routers/stack.py), registered
over ZMQ as vLLM's P2P example does: a DEALER sends one MessagePack map ``{"type": "P" or
"D", "http_address", "zmq_address"}``, repeated; an entry expires 5 s (whole seconds of
the wall clock) after its last registration.  Measured: whether ``DELETE /workers/...``
takes a discovered prefill out (p1 stops registering at the DELETE; a request a
``--interval-ms`` is sent meanwhile), how long p1 still gets requests, how soon it
serves again once it registers anew, and whether the decode got the KV parameters
(with Mooncake the router reads a prefill's engine id from its bootstrap server only for
the prefills on its command line).  As root it runs in a network namespace of loopback
only.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import urllib.parse

import zmq

from shmhb.testing.loopback import free_port
from tests.routers.stack import bench_refusal
from tests.routers.stack import PdStack, http_json, router_binary, wait_for


def pack(doc: dict[str, str]) -> bytes:
    """MessagePack of a map of short strings (fixmap; fixstr or str8)."""
    out = bytes([0x80 | len(doc)])
    for k, v in doc.items():
        for text in (k, v):
            b = text.encode()
            assert len(b) < 256
            out += (bytes([0xa0 | len(b)]) if len(b) < 32 else bytes([0xd9, len(b)])) + b
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--interval-ms", type=float, default=50.0)
    a = ap.parse_args(argv)
    why = bench_refusal(["vllm"])
    if why is not None:
        print(why, file=sys.stderr)
        return 2
    ctx = zmq.Context.instance()
    with tempfile.TemporaryDirectory(prefix="shmhb-bench-disc-") as tmp:
        s = PdStack(tmp)
        socks: dict[str, zmq.Socket[bytes]] = {}
        try:
            for name, role, host in (("p1", "prefill", 0), ("p2", "prefill", 1), ("d1", "decode", 2)):
                s.add_instance(name, role, host)
            port = free_port(["127.0.0.1"], span=3)
            exe = router_binary("vllm")
            assert exe is not None
            s.router = s._spawn([exe, "--host", "127.0.0.1", "--port", str(port),
                                 "--prometheus-port", str(port + 1), "--prometheus-host",
                                 "127.0.0.1", "--policy", "round_robin", "--vllm-pd-disaggregation",
                                 "--kv-connector", "mooncake", "--vllm-discovery-address",
                                 f"127.0.0.1:{port + 2}"], "router-vllm")
            s.router_port = port

            def register(name: str) -> None:
                i = s.instances[name]
                d = socks.get(name)
                if d is None:
                    d = socks[name] = ctx.socket(zmq.DEALER)
                    d.setsockopt(zmq.LINGER, 0)
                    d.connect(f"tcp://127.0.0.1:{port + 2}")
                d.send(pack({"type": "P" if i.role == "prefill" else "D", "http_address": i.url,
                             "zmq_address": f"{i.ip}:{i.bootstrap_port or i.port + 1}"}))

            def send() -> int:
                for n in ("p2", "d1"):
                    register(n)
                try:
                    st, _ = http_json("127.0.0.1", port, "POST", "/v1/completions",
                                      {"model": "standin", "prompt": "hi", "max_tokens": 1})
                except OSError:  # the router not listening yet
                    return 0
                return int(st)

            p1 = s.instances["p1"]
            wait_for(lambda: (register("p1"), send() == 200 and p1.served_since(0))[1], 30,
                     "p1 served through discovery", poll_s=0.05)
            t0 = time.monotonic_ns()
            st, doc = http_json("127.0.0.1", port, "DELETE", "/workers/" + urllib.parse.quote(p1.url, safe=""))
            print(f"DELETE /workers/{p1.url}: HTTP {st} {doc}")
            while time.monotonic_ns() - t0 < 7e9:
                send()
                time.sleep(a.interval_ms / 1000)
            got = p1.served_since(t0)
            print(f"p1 (not registering since the DELETE) still got {len(got)} requests, the last "
                  f"{(max(got) - t0) / 1e9 if got else 0:.2f} s after the DELETE")
            t1 = time.monotonic_ns()
            register("p1")
            wait_for(lambda: send() and p1.served_since(t1), 10, "p1 serving again", poll_s=0.01)
            print(f"p1 registered again: first request it served {(p1.served_since(t1)[0] - t1) / 1e6:.0f} ms later")
            kv = p1.served_since(0, "/kv")
            print(f"KV fetches the decode made from p1 (Mooncake's parameters reached it): {len(kv)}")
        finally:
            for d in socks.values():
                d.close()
            s.close()
        tried = s.hub_lookups()
        if tried:
            raise SystemExit(f"a router tried to reach a model hub: {tried}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
