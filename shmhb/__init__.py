"""shmhb: a shared-memory liveness board for co-located workers.

Workers register a slot in their host's board and beat; any local process reads the
board lock-free to learn whether a worker (local or on a followed remote host) is
alive, suspect, dead, left, or unknown, and which incarnation it is.
"""

from .agent.embedded import Board
from .clock import FakeClock, MonotonicClock
from .board.config import DEFAULT_BOARD, DEFAULT_PORT, AgentConfig, Capacity, PingerConfig, Policy
from .errors import (
    BoardCorrupt, BoardExists, BoardFull, BoardNotFound, BoardPermissionError,
    BoardSpaceError, BoardVersionMismatch, HeartbeatClosed, InvalidAddress, InvalidConfig, InvalidKey,
    InvalidName, KeyInUse, KeyNotFound, LockTimeout, PolicyMismatch, ProtocolError, ShmhbError,
    StaleBoard,
    WatchTableFull,
)
from .board.heartbeat import Heartbeat
from .board.native import native
from .board.reaper import DropReason, Link, LinkReaper
from .status import AgentStatus, NetworkStatus, PeerStatus, SlotStatus, Status
from .version import __version__


__all__ = [
    "AgentConfig", "AgentStatus", "Board", "BoardCorrupt", "BoardExists", "BoardFull",
    "BoardNotFound", "BoardPermissionError", "DropReason", "Link", "LinkReaper", "BoardSpaceError", "BoardVersionMismatch",
    "Capacity", "DEFAULT_BOARD", "DEFAULT_PORT", "FakeClock", "Heartbeat", "HeartbeatClosed",
    "InvalidAddress", "InvalidConfig", "InvalidKey", "InvalidName", "KeyInUse", "KeyNotFound",
    "LockTimeout", "MonotonicClock", "NetworkStatus", "PeerStatus", "PingerConfig", "Policy",
    "PolicyMismatch",
    "ProtocolError", "ShmhbError", "SlotStatus", "StaleBoard", "Status", "WatchTableFull",
    "__version__", "get_include", "native",
]


def get_include() -> str:
    """The directory holding ``shmhb.h``, the board's byte map and judging rule in C99
    (numpy's convention: ``cc -I"$(python -c 'import shmhb; print(shmhb.get_include())')"``)."""
    import os

    return os.path.join(os.path.dirname(__file__), "include")
