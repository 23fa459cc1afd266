"""An agent's tick against the board's agent_stale_s: a tick the stall bound cannot
tolerate (the agent would read stale between its beats, or a standby would replace it
as stalled while it is healthy) is refused at the door, naming the bound, on every path
that sets it; the default tick shortens itself on a board that needs it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

import shmhb
from shmhb.agent.role import Agent
from shmhb.cli.exits import EXIT_ERROR
from shmhb.net.settings import stored_settings
from shmhb.testing.loopback import child_env

from ..conftest import unlink_quietly


@pytest.fixture
def quick_stale(board_name: str) -> Iterator[shmhb.Board]:
    """A board whose agent is stale after 0.2 s: ticks of at most 0.05 s."""
    b = shmhb.Board.create(board_name, policy=shmhb.Policy(agent_stale_s=0.2))
    try:
        yield b
    finally:
        b.close()
        unlink_quietly(board_name)


@pytest.mark.parametrize("tick_s", [0.06, 2.0])
def test_a_library_agent_with_a_tick_over_the_bound_is_refused(quick_stale: shmhb.Board,
                                                               tick_s: float) -> None:
    with pytest.raises(shmhb.InvalidConfig, match=r"at most 0\.05 s, agent_stale_s / 4"):
        Agent(quick_stale.name, config=shmhb.AgentConfig(tick_s=tick_s))
    Agent(quick_stale.name, config=shmhb.AgentConfig(tick_s=0.05))  # the bound itself is fine


def test_the_default_tick_shortens_itself_to_the_bound(quick_stale: shmhb.Board) -> None:
    a = Agent(quick_stale.name, network=False)
    loop = a.elect(quick_stale)
    assert loop is not None
    try:
        assert loop.tick_ns == 50_000_000  # 0.2 s / 4, not the default 0.1 s
    finally:
        a.resign(loop)


@pytest.mark.system
@pytest.mark.parametrize("tick", ["2", "5", "0.26"])
def test_the_pinger_refuses_a_tick_over_the_bound_and_stores_nothing(board_name: str,
                                                                     tick: str) -> None:
    """A board of the default policy (agent_stale_s 1 s): at most 0.25 s.  At 2 s the agent
    read stale half the time; at 5 s an embedded standby replaced the healthy daemon."""
    out = subprocess.run([sys.executable, "-m", "shmhb", "pinger", "--board", board_name,
                          "--tick-s", tick, "--listen", "127.0.0.2:45645"],
                         capture_output=True, text=True, timeout=60, env=child_env())
    assert out.returncode == EXIT_ERROR, out
    assert f"--tick-s {tick} s is too long for this board: at most 0.25 s" in out.stderr
    assert "stall bound" in out.stderr, out.stderr
    with shmhb.Board.attach(board_name) as b:
        assert stored_settings(b) is None  # refused before any setting was stored
