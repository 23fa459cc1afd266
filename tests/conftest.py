"""Shared fixtures: unique boards that are always removed, real worker processes that
are always reaped, and deadline-based waiting (never fixed sleeps)."""

from __future__ import annotations

import importlib
import os
import pwd
import shutil
import signal
import site
import subprocess
import sys
import sysconfig
import time
import uuid
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

import posix_ipc
import pytest

import shmhb
from shmhb import Status
from shmhb.cli import units
from shmhb.board.instances import Instance
from shmhb.testing.loopback import OFFLINE_ENV, child_env

from .children import child
from .stopping import end, resume
from .tiers import (  # noqa: F401  (the hooks that sort tests into tiers)
    pytest_collection_modifyitems, pytest_runtest_makereport, pytest_runtest_protocol)

if TYPE_CHECKING:
    from .hosts import Cluster, FakePeer

# A suite started in the background by a shell without job control has SIGINT ignored
# (POSIX: asynchronous commands ignore it), and an ignored signal stays ignored across
# exec, so every process the tests interrupt would shrug its Ctrl-C off.  A handled
# signal is reset to its default at exec: handling it here gives each child a fresh one.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ME = pwd.getpwuid(os.getuid()).pw_name  # the user running the tests


def wait_until(pred: Callable[[], Any], timeout_s: float = 10.0, poll_s: float = 0.002,
               what: str = "condition") -> Any:
    """Poll ``pred`` until it returns something truthy; fail the test at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(poll_s)


def unlink_quietly(name: str) -> None:
    try:
        posix_ipc.unlink_shared_memory("/" + name)
    except posix_ipc.ExistentialError:
        pass


def pytest_configure(config: pytest.Config) -> None:
    """Everything the tests start runs offline for every model hub (``OFFLINE_ENV``),
    whether or not it is started through ``child_env``."""
    os.environ.update(OFFLINE_ENV)


def native_extension() -> ModuleType:
    """``shmhb._native`` as the tests import it (from this checkout); where it is missing,
    skip with the true reason, or fail where a run must test the C path
    (``SHMHB_REQUIRE_NATIVE=1``, as CI sets)."""
    try:
        return importlib.import_module("shmhb._native")
    except ImportError as e:
        why = str(e)
    here = os.path.dirname(shmhb.__file__)
    reason = (f"shmhb._native is not built in {here}, the shmhb these tests import "
              f"({why}): build it there with `pip install -e .` (the README's test command) "
              f"or `python setup.py build_ext --inplace`")
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        reason += f"; no C compiler ({cc}) is on PATH, so install one first"
    if os.environ.get("SHMHB_REQUIRE_NATIVE") == "1":
        pytest.fail(reason + " (SHMHB_REQUIRE_NATIVE=1: the C path must be tested)")
    pytest.skip(reason)


def use_hot_path(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """Make Boards created from now on in this test use the C ("native") or the
    pure-Python ("pure") hot path; "native" where the extension is missing: see
    ``native_extension``."""
    sel = importlib.import_module("shmhb.board.native")  # the module (shmhb.native is the bool)
    if path == "native":
        monkeypatch.setattr(sel, "_ext", native_extension())
    else:
        monkeypatch.setattr(sel, "_ext", None)


@pytest.fixture(params=["native", "pure"])
def hot_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test once on each hot path (see ``use_hot_path``)."""
    use_hot_path(monkeypatch, request.param)
    return str(request.param)


@pytest.fixture
def board_name() -> Iterator[str]:
    name = f"shmhb-test-{uuid.uuid4().hex[:12]}"
    yield name
    unlink_quietly(name)


@pytest.fixture
def board(board_name: str, request: pytest.FixtureRequest) -> Iterator[shmhb.Board]:
    """A board of 64 slots on short timeouts (suspect after 0.5 s, dead after 1.5 s).

    Under ``pytestmark = pytest.mark.slow_suspicion``: slow suspicion (5 s, dead after
    10 s), for modules whose tests are not about hangs: on a loaded machine a worker's
    beat thread can be starved for a second (kills are seen at once through the agent's
    pidfd whatever the policy)."""
    slow = request.node.get_closest_marker("slow_suspicion") is not None
    b = shmhb.Board.create(board_name, slots=64, suspect_after_s=5.0 if slow else 0.5,
                           dead_after_s=10.0 if slow else 1.5)
    yield b
    b.close()


WORKER = child("worker")


class Procs:
    """Starts real worker processes and makes sure they are gone after the test."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def spawn(self, args: list[str], *, ready: bool = True, env: dict[str, str] | None = None
              ) -> subprocess.Popen[str]:
        e = child_env(**(env or {}))
        p = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=e)
        self.procs.append(p)
        if ready:
            line = p.stdout.readline() if p.stdout else ""
            assert line.startswith("ready"), f"worker did not start: {line!r}"
            p.ready_line = line  # type: ignore[attr-defined]
        return p

    def worker(self, name: str, key: str, *, interval_s: float = 0.02, agent: bool = False,
               endpoints: str = "", ready: bool = True) -> subprocess.Popen[str]:
        return self.spawn([sys.executable, WORKER, name, key, str(interval_s),
                           "1" if agent else "0", endpoints], ready=ready)

    def program(self, path: str, *args: str, ready: bool = True) -> subprocess.Popen[str]:
        """Run a child program (``tests.children.child(NAME)``) with ``args``."""
        return self.spawn([sys.executable, path, *args], ready=ready)

    def cleanup(self) -> None:
        for p in self.procs:
            end(p)


@pytest.fixture
def procs() -> Iterator[Procs]:
    ps = Procs()
    yield ps
    ps.cleanup()


@pytest.fixture
def agent(board: shmhb.Board) -> Iterator[Any]:
    """This test's own agent (local half), holding the role on ``board``."""
    from shmhb.agent.role import Agent

    a = Agent(board.name, config=shmhb.AgentConfig(tick_s=0.02)).start()
    assert a.holding.wait(5), "agent never took the role"
    yield a
    a.stop()


@pytest.fixture
def local_agent(board: shmhb.Board) -> Iterator[Any]:
    """An agent without its network half, holding the role on ``board`` (so peer and
    remote rows a test writes by hand, as FakePinger's, are left alone)."""
    from shmhb.agent.role import Agent

    a = Agent(board.name, config=shmhb.AgentConfig(tick_s=0.02), network=False).start()
    assert a.holding.wait(5)
    yield a
    a.stop()


REGISTRY_STALL = child("registry_holder")


class Stall:
    """A process that takes the registry lock of a board and stops itself."""

    def __init__(self, board: str) -> None:
        env = child_env()
        self.p = subprocess.Popen([sys.executable, REGISTRY_STALL, board],
                                  stdout=subprocess.PIPE, env=env)
        assert self.p.stdout is not None and self.p.stdout.readline().strip() == b"held"

    def release(self) -> None:
        """Let it go on: it leaves the lock and exits."""
        resume(self.p.pid)
        self.p.wait(10)
        if self.p.stdout is not None:
            self.p.stdout.close()


ENGINE = child("engine")


def inst(engine: str, st: Status, *, serving: str | None = "127.0.0.5:8000",
         bootstrap: str | None = "127.0.0.5:8998", inc: int = 1, role: str = "prefill") -> Instance:
    """An instance as a reader of the board reports it (no board involved)."""
    return Instance(host="", key=f"inst/{role}/sb/{engine}", engine=engine, role=role,
                    serving=serving, bootstrap=bootstrap, incarnation=inc, status=st, ranks=1)


def pids_with_cmdline(needle: str) -> list[int]:
    """Pids of live processes whose command line contains ``needle`` (zombies excluded)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if needle in cmd and int(d) != os.getpid():
            out.append(int(d))
    return out


def install_args() -> list[str]:
    """``--exec`` for the units, where the running shmhb cannot be named in them: a venv
    under /tmp (a clone or CI's venv there) is refused, as PrivateTmp=yes would hide it.
    The interpreter that venv was made from stands in (the units are only verified, never
    started); run ``shmhb units`` with :func:`install_env`, so that the stand-in finds
    this run's packages when ``shmhb units`` tries it (``--exec`` must run shmhb)."""
    if not units.under_private_tmp(units.running_command()[0]):
        return []
    base = os.path.realpath(sys.executable)
    if units.under_private_tmp(base):
        pytest.skip("no Python outside /tmp to name in the units")
    return ["--exec", base]


def install_env() -> dict[str, str]:
    """The environment for ``shmhb units ... *install_args()``: ``child_env``, plus, where
    the stand-in interpreter is named, this venv's site-packages on ``PYTHONPATH`` (the
    stand-in has none of shmhb's dependencies of its own)."""
    env = child_env()
    if install_args():
        env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], *site.getsitepackages()])
    return env


# -- the loopback cluster (tests/hosts.py imports this module, so it is imported late) ---------

@pytest.fixture
def cluster(tmp_path: Any) -> Iterator[Cluster]:
    """Hosts on their own loopback addresses, each its own board and pinger; all ended
    and their boards removed at the end."""
    from .hosts import cluster_fixture
    yield from cluster_fixture(tmp_path)


@pytest.fixture
def fake_peers() -> Iterator[list[FakePeer]]:
    """Fake followed hosts a test sets up; all closed at the end."""
    from .hosts import fake_peers_fixture
    yield from fake_peers_fixture()
