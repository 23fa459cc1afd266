"""shmhb feed in front of the real vllm-router, sglang-router and smg, PD mode, on loopback.

Three hosts (boards and agents on 127.0.0.2-4): prefills p1 and p2, decode d1.  A client
sends a steady stream through the router while a prefill is killed, stopped or
restarted under a new engine id.  What is asserted is what the feeder must do (remove
the dead instance from the router's list, add a restarted one back where the API
allows, match by bootstrap port, keep adding until the router serves it); how fast is
measured by bench/routers.py.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from shmhb.testing.loopback import child_env

from .conftest import require_router
from .stack import Client, PdStack, http_json, hub_lookups, wait_for

KINDS = ("vllm", "sglang", "smg")
ADDS = ("sglang", "smg")  # the kinds that take a P/D worker over HTTP


def up(stack: PdStack, kind: str, *, serving_url: bool = True, decodes: int = 1) -> None:
    require_router(kind)
    stack.add_instance("p1", "prefill", 0, serving_url=serving_url)
    stack.add_instance("p2", "prefill", 1, serving_url=serving_url)
    for n in range(1, decodes + 1):
        stack.add_instance(f"d{n}", "decode", 2)
    stack.start_router(kind)
    stack.start_feeder(kind)


def actions(stack: PdStack, event: str, url: str) -> list[dict[str, Any]]:
    """The feeder's ``event`` actions on ``url``, once there is one.  The feeder reports
    an action after the router's call returned, and its lines are read by a thread, so
    the router can show a change a moment before the line is here: wait for it."""
    return wait_for(lambda: [a for a in stack.feed_actions()
                             if a["event"] == event and a["url"] == url],
                    10, f"the feeder's {event} of {url}")


@pytest.mark.parametrize("kind", KINDS)
def test_a_killed_prefill_leaves_the_rotation_and_a_restarted_one_returns_where_it_can(
        stack: PdStack, kind: str) -> None:
    up(stack, kind)
    p1 = stack.instances["p1"]
    c = Client(stack.router_port, rate_hz=40).start()
    try:
        wait_for(lambda: len(p1.served_since(0)) >= 5, 20, "p1 serving")
        t_kill = stack.kill("p1")
        wait_for(lambda: not stack.listed(p1.url, healthy_only=False), 10, "p1 out of the router")
        removes = actions(stack, "remove", p1.url)
        assert removes[0]["t_ns"] > t_kill
        # after its removal, every request is served (by p2): none fails for long
        t_out = removes[0]["t_ns"]
        wait_for(lambda: len([r for r in c.results if r.t_send > t_out + 200_000_000
                              and r.status == 200]) >= 10, 20, "requests served after removal")
        t_restart = time.monotonic_ns()
        stack.start("p1")
        if kind in ADDS:
            wait_for(lambda: len(p1.served_since(t_restart)) >= 3, 20, "restarted p1 serving")
            adds = actions(stack, "add", p1.url)
            assert adds[0]["t_ns"] > t_restart
        else:
            # vllm-router's PD mode takes no worker over HTTP: p1 stays out, and the feeder
            # says so instead of trying (it would be refused)
            wait_for(lambda: [a for a in stack.feed_actions() if a["event"] == "cannot_add"
                              and a["url"] == p1.url and a["t_ns"] > t_restart], 10,
                     "the feeder saying it cannot add p1 back")
            assert not stack.listed(p1.url, healthy_only=False)
            assert not [a for a in stack.feed_actions() if a["event"] == "add"]
            assert p1.served_since(t_restart) == []
    finally:
        res = c.stop()
    late = [r for r in res if r.status != 200 and r.t_send > t_out + 200_000_000]
    assert late == [], f"{len(late)} requests failed well after the removal"


@pytest.mark.parametrize("kind", KINDS)
def test_a_stopped_prefill_leaves_and_returns_when_it_beats_again(stack: PdStack, kind: str) -> None:
    """By default the feeder takes a suspect instance out where the router can take it
    back (sglang, smg): out at suspect-after, back once it beats again; vllm-router's PD
    mode cannot take it back, so there it waits for the dead verdict."""
    up(stack, kind)
    p2 = stack.instances["p2"]
    t_stop = stack.kill("p2", signal.SIGSTOP)
    wait_for(lambda: not stack.listed(p2.url), 10, "p2 out of the router")
    removes = actions(stack, "remove", p2.url)
    took = removes[0]["t_ns"] - t_stop
    if kind == "vllm":
        assert took >= stack.policy.dead_after_s * 1e9 * 0.9  # not before the verdict
        return
    assert stack.policy.suspect_after_s * 1e9 * 0.9 <= took < stack.policy.dead_after_s * 1e9
    os.kill(p2.proc.pid, signal.SIGCONT)  # type: ignore[union-attr]
    t_cont = time.monotonic_ns()
    wait_for(lambda: stack.listed(p2.url), 10, "p2 back in the router")
    adds = actions(stack, "add", p2.url)
    assert adds[0]["t_ns"] > t_cont


@pytest.mark.parametrize("kind", ADDS)
def test_an_instance_that_registers_before_it_serves_is_served_once_it_does(
        stack: PdStack, kind: str) -> None:
    """An engine registers on the board before its HTTP server answers (vLLM registers
    its KV caches first): the router's own registration of the worker fails its health
    check (smg then retries only every 30 s), so the feeder keeps adding it until the
    router lists it healthy."""
    up(stack, kind)
    p1 = stack.instances["p1"]
    stack.kill("p1")
    wait_for(lambda: not stack.listed(p1.url, healthy_only=False), 10, "p1 out of the router")
    late_s = 1.0
    stack.start("p1", serve_after_s=late_s)
    t_reg = time.monotonic_ns()  # it printed "ready" after registering
    c = Client(stack.router_port, rate_hz=40).start()
    try:
        wait_for(lambda: p1.served_since(t_reg, "/kv"), 15, "the late p1 serving")
    finally:
        c.stop()
    first = p1.served_since(t_reg, "/kv")[0]
    # served within about a second of its server coming up (smg alone: 30 s): the
    # feeder adds again after 0.2, 0.4, 0.8, then every 1 s
    assert (first - t_reg) / 1e9 < late_s + 1.5, \
        [((a["t_ns"] - t_reg) / 1e9, a["event"], a["why"]) for a in stack.feed_actions()
         if a["url"] == p1.url and a["t_ns"] > t_reg]


def _smg_ready(stack: PdStack, url: str) -> dict[str, Any] | None:
    """smg's listing of ``url`` if it is ready: healthy, with no ``status`` other than
    "ready" (smg 1.13.0 leaves the field out for a ready worker, as routerapi reads it)."""
    return next((x for x in stack.router_workers() if x["url"] == url and x.get("is_healthy")
                 and x.get("status") in (None, "ready")), None)


def test_smg_worker_listed_unhealthy_is_replaced_when_its_instance_is_back(
        stack: PdStack) -> None:
    """smg keeps a worker that failed its health check listed, unhealthy, and answers a
    POST of its URL with 409 (WORKER_ALREADY_EXISTS).  A feeder that meets an alive
    instance listed that way replaces it (PUT) and it serves at once, not after the
    30 health checks this smg wants before it takes the worker back by itself."""
    require_router("smg")
    stack.add_instance("p1", "prefill", 0)
    stack.add_instance("p2", "prefill", 1)
    stack.add_instance("d1", "decode", 2)
    stack.start_router("smg", ["--health-check-interval-secs", "1",
                               "--health-failure-threshold", "1",
                               "--health-success-threshold", "30"])
    p1 = stack.instances["p1"]
    stack.kill("p1")  # no feeder yet: smg alone finds it down, and keeps it listed
    wait_for(lambda: stack.listed(p1.url, healthy_only=False) and not stack.listed(p1.url),
             15, "p1 listed unhealthy in smg")
    stack.start("p1")
    stack.start_feeder("smg")
    t0 = time.monotonic_ns()
    c = Client(stack.router_port, rate_hz=40).start()
    try:
        wait_for(lambda: p1.served_since(t0, "/kv"), 10, "p1 serving again")
    finally:
        c.stop()
    assert (p1.served_since(t0, "/kv")[0] - t0) / 1e9 < 5.0  # smg alone: 30 s
    adds = actions(stack, "add", p1.url)
    assert adds and adds[0]["t_ns"] >= t0


@pytest.mark.parametrize("kind", KINDS)
def test_a_drained_prefill_leaves_at_once_and_returns_when_the_drain_is_called_off(
        stack: PdStack, kind: str) -> None:
    """``shmhb drain`` marks p2 draining on its board: the feeder takes it out of the
    router at once; stopping the command ends the drain and p2 is put back where the
    router takes workers back."""
    up(stack, kind)
    p2 = stack.instances["p2"]
    t0 = time.monotonic_ns()
    d = stack._spawn([sys.executable, "-m", "shmhb", "drain", "--board", p2.board,
                      p2.engine_id], "drain", text=True)
    assert d.stdout is not None and '"draining"' in d.stdout.readline()
    wait_for(lambda: not stack.listed(p2.url), 10, "p2 out of the router")
    removes = actions(stack, "remove", p2.url)
    assert "draining" in removes[0]["why"] and removes[0]["t_ns"] > t0
    assert stack.listed(stack.instances["p1"].url)
    d.send_signal(signal.SIGTERM)
    assert d.wait(10) == 1  # ended before the instance left
    if kind in ADDS:
        wait_for(lambda: stack.listed(p2.url), 10, "p2 back in the router")
        assert actions(stack, "add", p2.url)[0]["t_ns"] > removes[0]["t_ns"]


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("kind", KINDS)
def test_an_instance_sigtermed_under_load_drains_and_no_request_fails(
        stack: PdStack, kind: str, role: str) -> None:
    """SIGTERM to a prefill (p2) or a decode (d2, beside d1) under a steady stream: it
    reads draining, the feeder takes it out of the router at once, it serves what it owes
    (its requests in flight, the KV its decodes have not fetched) and then stops; the
    client sees no failure, on every router (vllm-router, which does not retry, too)."""
    up(stack, kind, decodes=2)
    name = "p2" if role == "prefill" else "d2"
    inst = stack.instances[name]
    c = Client(stack.router_port, rate_hz=50).start()
    try:
        wait_for(lambda: len(inst.served_since(0)) >= 5, 20, f"{name} serving")
        t_term = stack.kill(name, signal.SIGTERM)
        wait_for(lambda: not stack.listed(inst.url, healthy_only=False), 10,
                 f"{name} out of the router")
        removes = actions(stack, "remove", inst.url)
        assert "draining" in removes[0]["why"] and removes[0]["t_ns"] > t_term
        assert inst.proc is not None and inst.proc.wait(15) == 0  # it drained and stopped
        t_gone = time.monotonic_ns()
        wait_for(lambda: len([r for r in c.results if r.t_send > t_gone]) >= 10, 20,
                 "requests sent after it stopped")
    finally:
        res = c.stop()
    failed = [r for r in res if r.status != 200]
    assert len(res) >= 20 and failed == [], \
        f"{len(failed)} of {len(res)} requests failed around the drain of {name}"


def test_vllm_router_workers_are_matched_by_bootstrap_port(stack: PdStack) -> None:
    """Instances registered without a serving address: the feeder finds the router's
    worker by host and bootstrap port."""
    up(stack, "vllm", serving_url=False)
    p1, p2 = stack.instances["p1"], stack.instances["p2"]
    stack.kill("p1")
    wait_for(lambda: not stack.listed(p1.url, healthy_only=False), 10, "p1 out of the router")
    assert stack.listed(p2.url)


def test_a_hub_lookup_in_a_routers_log_is_caught() -> None:
    """The check every routers test ends with: the lines sglang-router wrote when a
    stand-in reported a model path (colours and all) are caught; its line for a worker
    that names no model, and vllm-router's usual lines, are not."""
    tried = ("\x1b[2m2026-12-07 04:02:19\x1b[0m \x1b[32m INFO\x1b[0m smg::tokenizer::registry: "
             "Loading tokenizer 'standin' from source: standin\n"
             "WARN smg::core::steps::worker::local::register_tokenizer: Failed to load tokenizer "
             "for model standin from standin: Failed to download tokenizer from HuggingFace\n")
    quiet = ("WARN smg::core::steps::worker::local::register_tokenizer: No tokenizer_path or "
             "model_path found for model unknown\n"
             "INFO vllm_router_rs::server: Started health checker for workers with 60s interval\n"
             "INFO smg::workflow::event: Step succeeded step_id=register_tokenizer duration_ms=0\n")
    assert len(hub_lookups(tried)) == 2
    assert hub_lookups(quiet) == []


#: run in a child: isolate it, then report what it can reach
ISOLATED = """
import socket, sys
from tests.routers.stack import only_loopback, private_network
print(private_network(), only_loopback())
srv = socket.create_server(("127.0.0.2", 0))
socket.create_connection(srv.getsockname(), timeout=5).close()
try:
    socket.create_connection(("192.0.2.1", 9), timeout=5)  # TEST-NET-1: never routed
    print("reached")
except OSError as e:
    print("refused", e.errno)
"""


def test_private_network_leaves_nothing_but_loopback() -> None:
    """As root, a process that isolates itself reaches its own loopback hosts and no other
    address (ENETUNREACH at once: no route exists); as any other user it changes nothing
    and says so."""
    out = subprocess.run([sys.executable, "-c", ISOLATED], env=child_env(), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split("\n")
    if os.geteuid() != 0:
        assert lines[0] == "False False"
        return
    assert lines[0] == "True True"
    assert lines[1] == f"refused {errno.ENETUNREACH}"
