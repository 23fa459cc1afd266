"""Shared fixtures: unique boards that are always removed, real worker processes that
are always reaped, and deadline-based waiting (never fixed sleeps)."""

from __future__ import annotations

import importlib
import os
import pwd
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import posix_ipc
import pytest

import shmhb
from shmhb.board.core import board_words
from shmhb import Status
from shmhb.cli import units
from shmhb.board.instances import Instance
from shmhb.testing.loopback import child_env

if TYPE_CHECKING:
    from .hosts import Cluster, FakePeer

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


def use_hot_path(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """Make Boards created from now on in this test use the C ("native") or the
    pure-Python ("pure") hot path; skip "native" where the extension was not built."""
    sel = importlib.import_module("shmhb.board.native")  # the module (shmhb.native is the bool)
    if path == "native":
        try:
            ext = importlib.import_module("shmhb._native")
        except ImportError:
            pytest.skip("shmhb._native was not built (no C compiler at install)")
        monkeypatch.setattr(sel, "_ext", ext)
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


WORKER = textwrap.dedent("""
    import os, signal, sys, time
    import shmhb
    from shmhb.board.core import board_words
    name, key, interval, agent = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4] == "1"
    eps = tuple(sys.argv[5].split(",")) if len(sys.argv) > 5 and sys.argv[5] else ()
    b = shmhb.Board.attach(name)
    try:
        hb = b.register(key, endpoints=eps, agent=agent)
    except shmhb.KeyInUse:
        print("keyinuse", flush=True)
        sys.exit(3)
    hb.start(interval)
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    print(f"ready {hb.incarnation} {hb.index}", flush=True)
    while not stop:
        signal.pause()
    hb.close()
    print("closed", flush=True)
""")


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
        return self.spawn([sys.executable, "-c", WORKER, name, key, str(interval_s),
                           "1" if agent else "0", endpoints], ready=ready)

    def python(self, code: str, *args: str, ready: bool = True) -> subprocess.Popen[str]:
        return self.spawn([sys.executable, "-c", textwrap.dedent(code), *args], ready=ready)

    def cleanup(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                p.kill()
            p.wait(10)
            if p.stdout:
                p.stdout.close()


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


REGISTRY_STALL = textwrap.dedent("""
    import os, signal, sys
    import shmhb
    from shmhb.board.core import board_words
    b = shmhb.Board.attach(sys.argv[1])
    with board_words(b).registry():
        print("held", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
""")


class Stall:
    """A process that takes the registry lock of a board and stops itself."""

    def __init__(self, board: str) -> None:
        env = child_env()
        self.p = subprocess.Popen([sys.executable, "-c", REGISTRY_STALL, board],
                                  stdout=subprocess.PIPE, env=env)
        assert self.p.stdout is not None and self.p.stdout.readline().strip() == b"held"

    def release(self) -> None:
        if self.p.poll() is None:
            os.kill(self.p.pid, signal.SIGCONT)
        self.p.wait(10)
        if self.p.stdout is not None:
            self.p.stdout.close()


#: ``procs.python(ENGINE, BOARD, ENGINE_ID, ROLE, NRANKS[, IP])``: an engine's ranks and
#: its instance slot (``shmhb.board.instances``), until SIGTERM
ENGINE = """
    import signal, sys
    import shmhb
    from shmhb.board.core import board_words
    from shmhb.board.instances import register_instance
    name, engine, role, nranks = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    ip = sys.argv[5] if len(sys.argv) > 5 else "127.0.0.5"
    b = shmhb.Board.attach(name)
    hbs = [b.register(f"vllm/{engine}/dp0/tp{i}/pp0", endpoints=(f"{ip}:{31000 + i}",),
                      agent=False).start(0.02) for i in range(nranks)]
    inst = register_instance(b, hbs[0], role, engine, serving=f"{ip}:8000",
                             bootstrap=f"{ip}:8998" if role == "prefill" else None,
                             interval_s=0.02)
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    print(f"ready {inst.incarnation}", flush=True)
    while not stop:
        signal.pause()
    for hb in hbs:
        hb.close()
"""


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
    under /tmp (CI makes one there) is refused, as PrivateTmp=yes would hide it.  The
    interpreter that venv was made from stands in (the units are only verified, never
    started)."""
    if not units.under_private_tmp(units.running_command()[0]):
        return []
    base = os.path.realpath(sys.executable)
    if units.under_private_tmp(base):
        pytest.skip("no Python outside /tmp to name in the units")
    return ["--exec", base]


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
