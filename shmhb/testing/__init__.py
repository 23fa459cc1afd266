"""Seams for tests, this package's and a connector author's: what the library takes
injected, in forms a test can drive.

- ``FakeClock`` (re-exported from ``shmhb.clock``): a clock the test moves;
- ``network`` (``FakeNetwork``): an in-process network for the network half, real ZMQ
  sockets and frames, no TCP and no ports;
- ``loopback``: loopback addresses and free ports for simulated hosts on one machine.

May import: the top-level vocabulary modules, ``shmhb.board``, ``shmhb.net`` and this
folder.  The library (``shmhb.board``, ``shmhb.net``, ``shmhb.agent``, ``shmhb.vllm``)
never imports it; the operator tools may (``shmhb demo`` runs on loopback hosts).
"""

from __future__ import annotations

from ..clock import FakeClock
from .loopback import child_env, free_port, loopback_addrs
from .network import FakeNetwork, FakeTransport, Frame

__all__ = ["FakeClock", "FakeNetwork", "FakeTransport", "Frame", "child_env", "free_port",
           "loopback_addrs"]
