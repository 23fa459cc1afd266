"""The exit statuses of every ``shmhb`` command, in one place (docs/OPERATIONS.md, "Exit
statuses").

``shmhb status`` reports the first that applies, in this order: 2, 3, 4, 5, 1, 0;
``EXIT_OK`` also when no worker is registered or every one left and no agent runs
because none ever ran or it left cleanly: an empty board is not an error."""

from __future__ import annotations

from typing import Final

#: an agent runs, its network half works or is not configured, every slot alive or left
EXIT_OK: Final = 0
#: ``shmhb status``: some local slot is suspect, dead or unknown
EXIT_SLOTS: Final = 1
#: the other commands: the thing asked for did not happen (``shmhb gc``: nothing removed)
EXIT_UNHEALTHY: Final = 1
#: the command failed: no such board, bad options
EXIT_ERROR: Final = 2
#: no running agent: none ever ran, its holder is gone, stalled or left
EXIT_NO_OBSERVER: Final = 3
#: the configured network half is not working (degraded: see the reason)
EXIT_NETWORK: Final = 4
#: a ``shmhb pinger`` stored its settings in the board, but no daemon runs
EXIT_NO_DAEMON: Final = 5
#: interrupted (Ctrl-C): 128 + SIGINT, as a shell reports it
EXIT_INTERRUPTED: Final = 130
#: the reader of the output went away (``| head``): 128 + SIGPIPE, what a shell reports
#: for a command killed by SIGPIPE, distinct from every verdict code of ``shmhb status``
EXIT_BROKEN_PIPE: Final = 141

__all__ = ["EXIT_BROKEN_PIPE", "EXIT_ERROR", "EXIT_INTERRUPTED", "EXIT_NETWORK",
           "EXIT_NO_DAEMON", "EXIT_NO_OBSERVER", "EXIT_OK", "EXIT_SLOTS", "EXIT_UNHEALTHY"]
