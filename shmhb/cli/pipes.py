"""Output to a reader that may go away (``shmhb status | head``).

Python ignores SIGPIPE, so a write to a closed pipe raises ``BrokenPipeError``; the
command then ends quietly with :data:`EXIT_BROKEN_PIPE`, the Python documentation's way
("Note on SIGPIPE", module ``signal``): stdout is pointed at /dev/null so that the
interpreter's own flush at exit raises nothing more.  rich's ``Console`` has its own
handler that exits 1, which for ``shmhb status`` means "a slot is unhealthy":
:class:`PipeConsole` raises ``BrokenPipeError`` instead, so every command ends the same
way through :func:`reader_gone`.
"""

from __future__ import annotations

import os
import sys

from rich.console import Console

from .exits import EXIT_BROKEN_PIPE


class PipeConsole(Console):
    """A rich ``Console`` that lets a closed pipe reach the command's caller."""

    def on_broken_pipe(self) -> None:
        self.quiet = True  # nothing more from this console
        raise BrokenPipeError("the reader of the output went away")


def reader_gone() -> int:
    """Call on ``BrokenPipeError``: stdout to /dev/null; returns ``EXIT_BROKEN_PIPE``."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)
    return EXIT_BROKEN_PIPE


__all__ = ["PipeConsole", "reader_gone"]
