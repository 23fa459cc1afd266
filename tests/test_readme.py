"""The README's worker example does what its comments say: a worker ended by `kill PID`
or by Ctrl-C reads LEFT, not DEAD."""

from __future__ import annotations

import os
import re
import signal
import sys

import pytest

import shmhb
from shmhb import Status

from .conftest import ROOT, Procs, wait_until


def _worker_part() -> str:
    """The README's first Python example, up to where a reader takes over."""
    with open(os.path.join(ROOT, "README.md")) as f:
        block = re.search(r"```python\n(.*?)```", f.read(), re.S)
    assert block is not None
    code = block.group(1)
    return code[:code.index("\nreader = ")] + "\nprint('ready', flush=True)\nsignal.pause()\n"


@pytest.mark.parametrize("sig, rc", [(signal.SIGINT, 130), (signal.SIGTERM, 0)])
def test_the_readme_worker_reads_left_when_stopped(board: shmhb.Board, procs: Procs,
                                                    sig: signal.Signals, rc: int) -> None:
    p = procs.spawn([sys.executable, "-c", _worker_part()], env={"SHMHB_BOARD": board.name})
    wait_until(lambda: board.status("decode-rank-3") is Status.ALIVE, what="the worker beats")
    p.send_signal(sig)
    assert p.wait(30) == rc
    assert board.status("decode-rank-3") is Status.LEFT
