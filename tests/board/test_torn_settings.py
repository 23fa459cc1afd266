"""A settings write torn by a kill (between the checksum and the
fields) must not leave every later holder reading "caught mid-write" for ever, with
``status`` saying "network not configured" and exiting 0.

The tear is made by a real process doing what ``store_config`` does under the registry
lock, SIGKILLed half-way (the window is microseconds wide: no timing could hit it)."""

from __future__ import annotations

from shmhb.board.core import board_words

import sys


from ..children import child
from ..conftest import wait_until
from ..hosts import Cluster, kill_is_dead_within_bound, status, wait_held, wait_net

TEARER = child("settings_tearer")


def _tear(cluster: Cluster, name: str, listen: str) -> None:
    p = cluster.spawn_text([sys.executable, TEARER, name, listen])
    assert p.wait(30) == -9


def test_torn_settings_are_said_degraded_and_healed_by_the_next_writer(
        cluster: Cluster) -> None:
    a = cluster.host()  # configured, listening
    wait_net(a, "listening")
    a.kill_pinger()
    _tear(cluster, a.name, "127.0.0.99:1")
    standby = a.start_pinger(configure=False, wait=False)  # a bare holder: board settings
    wait_held(a, standby)
    n = wait_net(a, "degraded", "config", timeout_s=10)
    assert "torn" in (n.error or ""), n
    rc, doc = status(a)
    assert rc != 0 and doc["network"]["state"] == "degraded", doc
    kill_is_dead_within_bound(a, "during")  # the local watch is not held up by it
    # the next pinger that has settings of its own rewrites them
    standby.kill()
    standby.wait(10)
    a.start_pinger()
    wait_net(a, "listening")
    rc, doc = status(a)
    assert doc["network"]["state"] == "listening", doc
    assert not any("network" in p for p in doc["health"]["problems"]), doc


def test_a_running_holder_keeps_its_settings_through_a_tear_and_applies_the_completion(
        cluster: Cluster) -> None:
    """A holder whose half runs keeps it through a tear (the settings it read whole are
    still valid), and is not fooled by a writer that was only slow: once the checksum
    matches again the settings are applied, though the generation word did not move."""
    a = cluster.host()
    gen0 = wait_net(a, "listening").settings_gen
    b = a.board
    with board_words(b).registry():
        h = board_words(b).header
        h["cfg_checksum"] = 0
        h["cfg_gen"] = int(h["cfg_gen"]) + 1  # and stays torn for a while
        assert a.pinger is not None
        wait_until(lambda: "settings are torn" in cluster.log_tail(a.pinger), timeout_s=10,
                   what="the tear noticed")
        assert b.network().state == "listening"
        from shmhb.net.settings import _cfg_checksum
        h["cfg_checksum"] = _cfg_checksum(h)
    wait_until(lambda: b.network().settings_gen == gen0 + 1 and b.network().listening,
               timeout_s=10, what="the completed settings applied")
