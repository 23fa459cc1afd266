"""The two tiers of the suite: ``fast``, every test that starts no process (pure logic,
in-process boards, agents and loopback sockets: ``python -m pytest -m fast``), and
``system``, every test that starts one (workers, pingers, loopback clusters, the CLI:
``python -m pytest -m system``).  The default run is both.

A test is ``system`` when it takes one of PROCESS_FIXTURES, lives in one of
SYSTEM_FOLDERS, or is marked ``pytest.mark.system`` (by itself or by its module's
``pytestmark``); every other test is ``fast``.  Nobody marks a test ``fast`` by hand, and the marks cannot drift: in every run,
a ``fast`` test that starts a process (``subprocess``, ``os.fork``, ``os.posix_spawn``,
``os.system``, an ``exec``) fails, whether or not its code caught the error that the
start raised.  The hooks below are imported by ``tests/conftest.py``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

#: fixtures that start processes: a test that takes one is ``system``
PROCESS_FIXTURES = frozenset({"procs", "cluster"})

#: folders of tests/ whose tests run against real third-party stacks in a venv of their
#: own (.ci/run's later stages), each test through fixtures of the folder that start
#: the stack's processes: all ``system``
SYSTEM_FOLDERS = frozenset({"routers", "vllm", "vllm_ascend", "sglang"})

TESTS = Path(__file__).resolve().parent

#: the audit events (``sys.addaudithook``) that start or replace a process
PROCESS_EVENTS = frozenset({
    "subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.system",
    "os.exec", "pty.spawn",
})

HOW = ("a test of the fast tier started a process ({what}): mark it "
       "`pytest.mark.system` (or take the `procs` fixture); see tests/tiers.py")


class _Guard:
    """Whether the running test may start processes, and what it started."""

    def __init__(self) -> None:
        self.armed = False
        self.started: list[str] = []

    def audit(self, event: str, args: tuple[Any, ...]) -> None:
        if event not in PROCESS_EVENTS:
            return
        what = event if event != "subprocess.Popen" or not args else f"{event} {args[1]!r}"
        if self.armed:
            self.started.append(what)
            raise AssertionError(HOW.format(what=what))


_GUARD = _Guard()
sys.addaudithook(_GUARD.audit)


def is_system(item: pytest.Item) -> bool:
    path = Path(item.path).resolve()
    folder = path.relative_to(TESTS).parts[0] if TESTS in path.parents else ""
    return (item.get_closest_marker("system") is not None or folder in SYSTEM_FOLDERS
            or bool(PROCESS_FIXTURES & set(getattr(item, "fixturenames", ()))))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.system if is_system(item) else pytest.mark.fast)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """Arm the guard for the whole of a fast test: its fixtures' setup and teardown too."""
    _GUARD.armed = not is_system(item)
    _GUARD.started = []
    try:
        yield
    finally:
        _GUARD.armed = False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Fail a fast test that started a process even where its code swallowed the error."""
    outcome = yield
    report = outcome.get_result()
    if _GUARD.started and report.passed:
        report.outcome = "failed"
        report.longrepr = HOW.format(what=", ".join(_GUARD.started))
    _GUARD.started = []  # one report per phase says so
