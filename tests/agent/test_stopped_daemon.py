"""A stopped daemon holder, seen from another host: host B runs ``shmhb pinger`` and
workers whose embedded standbys replace it when it is stopped as a whole (SIGSTOP, a
frozen container).  The worker that takes the role listens beside the stopped daemon
(shmhb.net.listener), so host A, which follows B, hears B and its live workers again
while the daemon is still stopped, instead of reading them DEAD until it resumes.
``python -m bench.stopped_holder`` measures the same over a whole 20 s stop."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from shmhb import Status

from ..conftest import wait_until
from ..hosts import Cluster, cluster_fixture
from .stopped_holder import start_b, view, watch_through_stop

pytestmark = pytest.mark.system  # it starts processes (see tests/tiers.py)


@pytest.fixture
def cluster(tmp_path: Any) -> Iterator[Cluster]:
    yield from cluster_fixture(tmp_path)


def test_a_host_whose_daemon_is_stopped_is_heard_again_through_the_new_holder(
        cluster: Cluster) -> None:
    a, b, daemon = start_b(cluster)
    # takeover after the stall bound and the embedded grace (4 s), then a reconnect
    # of A's (at most a handshake timeout, 1 s); the rest is room for a loaded machine
    tl = watch_through_stop(a, b, daemon, 20.0, until_alive_again=True)
    assert tl.alive_again_s is not None, f"A never heard B again while its daemon was stopped: {tl}"
    print(f"A's view of B across the stop: {tl}")
    # and once the daemon resumes it stands down; A goes on reading B alive
    wait_until(lambda: "standing down" in cluster.log_tail(daemon, 200), timeout_s=20,
               what="the resumed daemon stands down")
    wait_until(lambda: all(s is Status.ALIVE for s in view(a, b)), timeout_s=20,
               what="A reads B alive after the daemon resumed")
