"""This process's time namespace, as far as CLOCK_MONOTONIC goes.

Timestamps on a board are CLOCK_MONOTONIC readings of the processes that write them,
compared with the readers' own.  A process in a time namespace (``unshare --time``,
some container runtimes) reads that clock shifted by its namespace's offset: its beats
would look far in the future (ALIVE forever) or the past (DEAD at once).  The offset
is in ``/proc/self/timens_offsets`` (Linux 5.6 and later); without that file there are
no time namespaces and the offset is 0.
"""

from __future__ import annotations

import functools
import os


@functools.lru_cache(maxsize=1)
def monotonic_offset_ns() -> int:
    """This process's CLOCK_MONOTONIC offset from the host's, in ns (0: none)."""
    try:
        with open("/proc/self/timens_offsets") as f:
            for line in f:
                parts = line.split()
                if len(parts) == 3 and parts[0] in ("monotonic", "1"):
                    return int(parts[1]) * 1_000_000_000 + int(parts[2])
    except (OSError, ValueError):
        pass
    return 0


def _reset_after_fork() -> None:
    monotonic_offset_ns.cache_clear()  # a child may be the first in a new namespace


os.register_at_fork(after_in_child=_reset_after_fork)
