"""shmhb feed in front of the real vllm-router and sglang-router, PD mode, on loopback.

Three hosts (boards and agents on 127.0.0.2-4): prefills p1 and p2, decode d1.  A client
sends a steady stream through the router while a prefill is killed, stopped or
restarted under a new engine id.  What is asserted is what the feeder must do (remove
the dead instance from the router's list, add a restarted one back where the API
allows, match by bootstrap port); how fast is measured by bench/routers.py.
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
from .stack import Client, PdStack, hub_lookups, wait_for

KINDS = ("vllm", "sglang")


def up(stack: PdStack, kind: str, *, serving_url: bool = True) -> None:
    require_router(kind)
    stack.add_instance("p1", "prefill", 0, serving_url=serving_url)
    stack.add_instance("p2", "prefill", 1, serving_url=serving_url)
    stack.add_instance("d1", "decode", 2)
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
        if kind == "sglang":
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
def test_a_stopped_prefill_leaves_after_dead_after(stack: PdStack, kind: str) -> None:
    up(stack, kind)
    p2 = stack.instances["p2"]
    t_stop = stack.kill("p2", signal.SIGSTOP)
    wait_for(lambda: not stack.listed(p2.url, healthy_only=False), 10, "p2 out of the router")
    removes = actions(stack, "remove", p2.url)
    dead_after_ns = int(stack.policy.dead_after_s * 1e9)
    assert removes[0]["t_ns"] - t_stop >= dead_after_ns * 0.9  # not before the verdict


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
