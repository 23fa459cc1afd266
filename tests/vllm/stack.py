"""A prefill host and a decode host on loopback, each with its own board and pinger, each
running one engine process (``tests/vllm/engine.py``) with the real connector.

Used by the tests in this folder and by ``python -m bench.vllm``.  Nothing here sleeps
for a fixed time: every wait has a deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from tests.conftest import ROOT, Procs, wait_until
from shmhb.testing.loopback import child_env, free_port
from tests.hosts import Cluster

import shmhb
from shmhb import Status
from ..stopping import resume

PREFILL_IP, DECODE_IP = "127.0.0.2", "127.0.0.3"
#: short policy so hangs are judged within seconds; kills are seen through pidfds
POLICY = shmhb.Policy(suspect_after_s=0.5, dead_after_s=2.0,
                      peer_suspect_after_s=0.5, peer_dead_after_s=2.0)


class EngineProc:
    """One engine process: commands in on stdin, JSON events out on stdout."""

    def __init__(self, role: str, ip: str, board: str, engine_id: str, *, wrapped: bool,
                 bootstrap_port: int, log_dir: str, env: dict[str, str] | None = None,
                 on_dead_peer: str = "recompute", scheduler: bool = False,
                 failure_policy: str | None = None, tp_size: int = 1, tp_rank: int = 0,
                 dist_port: int, kv_layout: str = "blocks",
                 inner: str = "mooncake", wait: bool = True,
                 module: str = "tests.vllm.engine") -> None:
        """``wait=False``: return once started; ``wait_ready()`` before use (the ranks of
        one TP group start together: each waits for the others in the gloo group).
        ``module``: the engine's program (tests/vllm_ascend runs its own)."""
        self.role, self.ip, self.engine_id, self.wrapped = role, ip, engine_id, wrapped
        self.inner = inner
        self.tp_rank = tp_rank
        self.bootstrap = f"http://{ip}:{bootstrap_port}"
        e = child_env()  # this checkout first on PYTHONPATH; offline for every model hub
        e["VLLM_TARGET_DEVICE"] = "cpu"
        e["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = str(bootstrap_port)
        e.setdefault("VLLM_LOGGING_LEVEL", "INFO")
        e["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"  # stdout carries the events
        e["PYTHONUNBUFFERED"] = "1"
        if env:
            e.update(env)
        self.log_path = os.path.join(log_dir, f"{role}-{engine_id}-tp{tp_rank}-"
                                              f"{uuid.uuid4().hex[:6]}.log")
        log = open(self.log_path, "wb")
        cmd = [sys.executable, "-m", module, "--role", role, "--ip", ip,
               "--board", board, "--engine-id", engine_id, "--dist-port", str(dist_port),
               "--model-dir", os.path.join(log_dir, "model"), "--on-dead-peer", on_dead_peer,
               "--tp-size", str(tp_size), "--tp-rank", str(tp_rank), "--kv-layout", kv_layout,
               "--inner", inner]
        if wrapped:
            cmd.append("--wrapped")
        if scheduler:
            cmd.append("--scheduler")
        if failure_policy:
            cmd += ["--failure-policy", failure_policy]
        try:
            self.p = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=log, env=e)
        finally:
            log.close()
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.pid = self.p.pid
        self.ready: dict[str, Any] = {}
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        self.ready = self.expect("ready", timeout_s=240)

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            self.events.put(ev)

    def send(self, op: str, **kw: Any) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write((json.dumps({"op": op, **kw}) + "\n").encode())
        self.p.stdin.flush()

    def expect(self, *names: str, rid: str | None = None, timeout_s: float = 30.0) -> dict[str, Any]:
        """The next event named one of ``names`` (for ``rid``, if given); earlier events
        stay in ``seen``."""
        for ev in self.seen:
            if ev["ev"] in names and (rid is None or ev.get("rid") == rid):
                self.seen.remove(ev)
                return ev
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{self.role} {self.engine_id}: no {names} for {rid} "
                                     f"within {timeout_s} s\n{self.log_tail()}")
            try:
                ev = self.events.get(timeout=min(left, 0.5))
            except queue.Empty:
                if self.p.poll() is not None:
                    raise AssertionError(f"{self.role} exited with {self.p.returncode}\n"
                                         + self.log_tail()) from None
                continue
            if ev["ev"] in names and (rid is None or ev.get("rid") == rid):
                return ev
            self.seen.append(ev)

    def expect_asked(self, transfer_id: str, timeout_s: float = 30.0) -> dict[str, Any]:
        """Until this producer has read a consumer's request for ``transfer_id``."""
        deadline = time.monotonic() + timeout_s
        while True:
            ev = self.expect("asked", timeout_s=max(0.01, deadline - time.monotonic()))
            if transfer_id in ev["transfer_ids"]:
                return ev

    def request(self, op: str, reply: str, timeout_s: float = 30.0, **kw: Any) -> dict[str, Any]:
        self.send(op, **kw)
        return self.expect(reply, timeout_s=timeout_s)

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"".join(f.readlines()[-n:]).decode(errors="replace")
        except OSError:
            return ""

    def kill(self) -> float:
        t = time.monotonic()
        self.p.send_signal(signal.SIGKILL)
        self.p.wait(30)
        return t

    def stop(self) -> float:
        t = time.monotonic()
        os.kill(self.p.pid, signal.SIGSTOP)
        return t

    def cont(self) -> None:
        resume(self.p.pid)

    def ask_to_quit(self) -> None:
        """Resume it if stopped and ask it to shut down (it leaves its board)."""
        if self.p.poll() is None:
            try:
                resume(self.p.pid)
                self.send("quit")
            except OSError:  # it exited meanwhile (a broken pipe is one): close() reaps it
                pass

    def close(self) -> None:
        self.ask_to_quit()
        if self.p.poll() is None:
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(10)
        for s in (self.p.stdin, self.p.stdout):
            if s is not None:
                try:
                    s.close()
                except OSError:
                    pass


class Stack:
    """The two hosts, their pingers, and the engines started on them."""

    def __init__(self, cluster: Cluster, log_dir: str, *, wrapped: bool,
                 env: dict[str, str] | None = None, inner: str = "mooncake") -> None:
        self.cluster = cluster
        self.inner = inner  # the connector under test: "mooncake" or "nixl"
        self.log_dir = log_dir
        self.wrapped = wrapped
        self.env = env or {}
        self.prefill_host = cluster.host(policy=POLICY, ip=PREFILL_IP, interval_s=0.1)
        self.decode_host = cluster.host(policy=POLICY, ip=DECODE_IP, interval_s=0.1)
        self._ports: set[int] = set()
        self.bootstrap_port = self.new_port([PREFILL_IP])
        self.engines: list[EngineProc] = []
        self._n = 0

    def new_port(self, addrs: list[str]) -> int:
        """A port for this stack alone.  Ports it handed out stay its own while nothing
        is bound on them (a bootstrap port between a kill and the restart): an engine's
        TCPStore listens on every address, so a dist port drawn in that gap made the
        restarted prefill fail to bind its bootstrap server (EADDRINUSE)."""
        port = free_port(addrs, avoid=self._ports)
        self._ports.add(port)
        return port

    def dist_port(self) -> int:
        """The gloo group's TCPStore port: it binds every address, so it is checked on all."""
        return self.new_port(["0.0.0.0"])

    def start(self, role: str, engine_id: str | None = None, *, wrapped: bool | None = None,
              bootstrap_port: int | None = None, **kw: Any) -> EngineProc:
        """``wrapped`` and ``bootstrap_port`` default to the stack's: a bench runs a stock
        and a wrapped pair side by side in one stack, each pair on its own port."""
        self._n += 1
        host = self.prefill_host if role == "prefill" else self.decode_host
        eid = engine_id or f"{role}-{uuid.uuid4().hex[:8]}"
        bootstrap_port = bootstrap_port or self.bootstrap_port
        self._ports.add(bootstrap_port)
        e = EngineProc(role, host.ip, host.name, eid,
                       wrapped=self.wrapped if wrapped is None else wrapped,
                       bootstrap_port=bootstrap_port,
                       log_dir=self.log_dir, env={**self.env, **kw.pop("env", {})},
                       inner=kw.pop("inner", self.inner),
                       dist_port=kw.pop("dist_port", None) or self.dist_port(), **kw)
        self.engines.append(e)
        return e

    def start_tp(self, role: str, tp_size: int, engine_id: str | None = None,
                 **kw: Any) -> list[EngineProc]:
        """One engine of ``tp_size`` rank processes (one gloo group, rank 0 runs the
        bootstrap server), all on the role's host; returned in rank order."""
        host = self.prefill_host if role == "prefill" else self.decode_host
        eid = engine_id or f"{role}-{uuid.uuid4().hex[:8]}"
        dist_port = self.dist_port()
        ranks = []
        for r in range(tp_size):
            self._n += 1
            e = EngineProc(role, host.ip, host.name, eid, wrapped=self.wrapped,
                           bootstrap_port=self.bootstrap_port, log_dir=self.log_dir,
                           env=self.env, tp_size=tp_size, tp_rank=r, dist_port=dist_port,
                           wait=False, **kw)
            self.engines.append(e)
            ranks.append(e)
        for e in ranks:
            e.wait_ready()
        return ranks

    def replace_prefill(self, engine_id: str | None = None, **kw: Any) -> EngineProc:
        """A new prefill engine, each running one killed first (resumed, if stopped, so
        that it dies now): they share the stack's one bootstrap address."""
        for e in self.engines:
            if e.role == "prefill" and e.p.poll() is None:
                e.cont()
                e.kill()
        return self.start("prefill", engine_id, **kw)

    def close(self) -> None:
        for e in self.engines:  # all shut down at once, then each is waited for
            e.ask_to_quit()
        for e in self.engines:
            e.close()


S = TypeVar("S", bound=Stack)


def stack_scope(tmp: str, build: Callable[[Cluster, str], S]) -> Iterator[S]:
    """A module fixture's body: the stack ``build`` makes on a fresh cluster in ``tmp``,
    yielded, then closed with every process the cluster started."""
    procs = Procs()
    cluster = Cluster(tmp, procs)
    try:
        s = build(cluster, tmp)
        try:
            yield s
        finally:
            s.close()
    finally:
        procs.cleanup()
        cluster.close()


#: ``stack_scope`` as a ``with`` block (the benches' form)
open_stack = contextlib.contextmanager(stack_scope)


def recovering_decode(stack: Stack, **kw: Any) -> EngineProc:
    """A decode engine on vLLM's real Scheduler, checked to recompute what it cannot
    load: the default, since the wrapper sets vLLM's policy before the Scheduler reads it."""
    d = stack.start("decode", scheduler=True, **kw)
    blocks = d.request("blocks", "blocks")
    assert blocks["policy"] == "recompute" and blocks["recompute"], blocks
    return d


def live(stack: Stack, role: str) -> EngineProc:
    return [e for e in stack.engines if e.role == role and e.p.poll() is None][-1]


def bootstrap_ep(p: EngineProc) -> str:
    return p.bootstrap.split("://", 1)[1]


def wait_alive_on_decode_host(stack: Stack, p: EngineProc) -> None:
    """Until the decode host's board shows the prefill engine's rank 0 alive (a fresh
    registration reaches the other host within a round trip)."""
    ep = bootstrap_ep(p)
    stack.decode_host.board.watch(ep)  # as the decode scheduler does at its first request

    def alive() -> bool:
        s = stack.decode_host.board.remote(ep)
        return s is not None and s.status is Status.ALIVE and p.engine_id in s.key
    wait_until(alive, timeout_s=20, what=f"{p.engine_id} alive on the decode host")


def inner_engines(d: EngineProc) -> set[str]:
    st = d.request("inner", "inner")
    return set(st["remote_agents"]) | set(st["tp_size"])


def pair(stack: Stack, wrapped: bool) -> tuple[EngineProc, EngineProc]:
    """The live prefill and decode of the stock or the wrapped pair (newest first)."""
    def one(role: str) -> EngineProc:
        return [e for e in stack.engines if e.role == role and e.wrapped == wrapped
                and e.p.poll() is None][-1]
    return one("prefill"), one("decode")


def start_pair(stack: Stack, wrapped: bool, engine_id: str,
               env: dict[str, str] | None = None) -> tuple[EngineProc, EngineProc]:
    """A prefill and a decode on a port of their own (the NIXL side channel)."""
    port = stack.new_port([PREFILL_IP, DECODE_IP])
    p = stack.start("prefill", engine_id, wrapped=wrapped, bootstrap_port=port, env=env or {})
    return p, stack.start("decode", wrapped=wrapped, bootstrap_port=port, env=env or {})


def prefilled(p: EngineProc, seed: int) -> tuple[str, str, dict[str, Any]]:
    """A request computed and finished on ``p``: (rid, transfer id, its params)."""
    rid, xid = new_ids()
    p.request("prefill", "prefilled", rid=rid, transfer_id=xid, seed=seed)
    p.send("finish", rid=rid)
    return rid, xid, p.expect("finished", rid=rid)["params"]


def load_with(d: EngineProc, p: EngineProc, rid: str, params: dict[str, Any]) -> str:
    """Load ``rid`` on ``d`` with the producer's own params (NIXL's): "loading" or "vetoed"."""
    d.send("load", rid=rid, transfer_id="-", engine_id=p.engine_id, bootstrap=p.bootstrap,
           params=params)
    return str(d.expect("loading", "vetoed", rid=rid)["ev"])


def new_ids(tag: str = "r") -> tuple[str, str]:
    u = uuid.uuid4().hex[:10]
    return f"{tag}-{u}", f"xfer-{u}"


def transfer(prefill: EngineProc, decode: EngineProc, *, seed: int = 1,
             timeout_s: float = 60.0) -> tuple[dict[str, Any], dict[str, Any]]:
    """One good P/D transfer: prefill computes, decode loads; returns both digests."""
    rid, xid = new_ids()
    p = prefill.request("prefill", "prefilled", rid=rid, transfer_id=xid, seed=seed)
    prefill.send("finish", rid=rid)
    fin = prefill.expect("finished", rid=rid)
    decode.send("load", rid=rid, transfer_id=xid, engine_id=prefill.engine_id,
                bootstrap=prefill.bootstrap, params=pull_params(prefill, fin))
    decode.expect("loading", "vetoed", rid=rid)
    d = decode.expect("loaded", "load_failed", rid=rid, timeout_s=timeout_s)
    return p, d


def pull_params(prefill: EngineProc, finished: dict[str, Any]) -> dict[str, Any] | None:
    """What a proxy hands the decode side from the prefill's response: NIXL's transfer
    params (the consumer reads from them); None for Mooncake (the test builds them)."""
    return finished.get("params") if prefill.inner == "nixl" else None


def expected_digest(seed: int) -> str:
    """The digest of what a prefill seeded with ``seed`` writes into its blocks (the
    bytes a correct transfer moves), computed here, independently of either engine."""
    import hashlib

    import torch

    from .engine import BLOCK_SIZE, HEAD_SIZE, NUM_KV_HEADS, PROMPT_BLOCKS
    g = torch.Generator().manual_seed(seed)
    shape = (2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    blocks = torch.stack([torch.rand(shape, generator=g) + 1.0 for _ in range(PROMPT_BLOCKS)])
    return hashlib.sha256(blocks.numpy().tobytes()).hexdigest()[:16]


def zeros_digest() -> str:
    """The digest of a request's blocks that nothing was written into."""
    import hashlib

    import numpy as np

    from .engine import BLOCK_SIZE, HEAD_SIZE, NUM_KV_HEADS, PROMPT_BLOCKS
    z = np.zeros((PROMPT_BLOCKS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE), np.float32)
    return hashlib.sha256(z.tobytes()).hexdigest()[:16]


#: tokens a ``--scheduler`` decode generates per request in the tests
SERVE_TOKENS = 4


def served_right(d: EngineProc, rid: str, prompt: list[int], timeout_s: float = 30.0
                 ) -> dict[str, Any]:
    """The next ``served`` event of ``rid`` on a ``--scheduler`` decode: finished by length,
    with the tokens of an undisturbed run (so its KV was right, loaded or recomputed)."""
    from .model import generate
    ev = d.expect("served", rid=rid, timeout_s=timeout_s)
    print(f"{rid}: {ev['finish_reason']} after {ev['t'] - ev['added_t']:.3f} s")
    assert ev["finish_reason"] == "length", ev
    assert ev["tokens"] == generate(prompt, SERVE_TOKENS), "wrong output: the KV was wrong"
    return ev


def no_leak(d: EngineProc) -> None:
    """Until the ``--scheduler`` decode's KVCacheManager has every block free and no request."""
    def clean() -> bool:
        b = d.request("blocks", "blocks")
        return bool(b["free"] == b["at_start"] and b["requests"] == 0)
    wait_until(clean, timeout_s=10, what="every decode block free, no request left")


def remote_params(p: EngineProc, xid: str) -> dict[str, Any]:
    """The transfer params a proxy hands the decode side for prefill ``p``'s request."""
    return {"do_remote_prefill": True, "transfer_id": xid,
            "remote_engine_id": p.engine_id, "remote_bootstrap_addr": p.bootstrap}


def submit(p: EngineProc, d: EngineProc, seed: int, tokens: int, *, finish: bool = True,
           before_serve: Any = None) -> tuple[str, str, list[int]]:
    """The proxy's two steps: the prefill computes the stand-in model's KV of a prompt,
    then the decode side (``--scheduler``) gets the request with its transfer params.
    ``finish=False`` keeps the prefill's request unfinished (its blocks not sent yet);
    ``before_serve`` runs between the two steps."""
    from .model import prompt_for
    rid, xid = new_ids(f"s{seed}")
    prompt = prompt_for(seed)
    p.request("prefill", "prefilled", rid=rid, transfer_id=xid, prompt=prompt)
    if finish:
        p.send("finish", rid=rid)
        p.expect("finished", rid=rid)
    if before_serve is not None:
        before_serve()
    d.send("serve", rid=rid, prompt=prompt, max_tokens=tokens, params=remote_params(p, xid))
    return rid, xid, prompt
