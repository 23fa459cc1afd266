"""The previous release, built from this checkout's own git history, and loopback hosts
that run it beside this one (a rolling upgrade, host by host).

:func:`build_old_release` extracts ``PREVIOUS_RELEASE`` with ``git archive`` and installs
it into a venv of its own, made without pip and given this interpreter's site-packages
through a ``.pth`` file (numpy, pyzmq, posix_ipc and setuptools come from there: no
network).  The venv's own site-packages comes first on its ``sys.path``, so ``import
shmhb`` there is the old release, which the build checks.

A process of the old release always runs as ``python -I`` (no ``PYTHONPATH``, no
current directory on ``sys.path``), with ``PYTHONPATH`` removed from its environment
and its current directory outside the checkout: the checkout on its path would shadow
the old release with this one.

:class:`OldHost` is a :class:`~tests.hosts.Host` whose board is created by the old
release, and whose pinger and workers run it; :class:`MixedCluster` starts each
process with the environment its release needs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import site
import subprocess
import sys
import time
import venv
from collections.abc import Iterator
from typing import Any

import shmhb

from .conftest import ROOT, WORKER, Procs, unlink_quietly
from .hosts import FAST, INTERVAL_S, Cluster, Host, cluster_fixture

#: The release this checkout must run beside: None while this is the first release
#: (0.1.0: board layout, wire and fence wire all version 1), so the upgrade tests skip.
#: Set it to the first release's commit when the next release is made: the test then
#: checks the release being made against the one that clusters run.
PREVIOUS_RELEASE: str | None = None


class Unavailable(Exception):
    """The previous release cannot be built here (the reason says why)."""


@dataclasses.dataclass(frozen=True)
class OldRelease:
    """An installed previous release: run it with :meth:`cmd`, :meth:`env` and ``cwd``."""

    prefix: str   # its venv
    python: str   # the venv's interpreter
    cwd: str      # a directory outside the checkout, the current one of its processes
    package: str  # where its ``shmhb`` package is
    native: bool  # whether its C hot path was built
    build_s: float

    def cmd(self, *args: str) -> list[str]:
        return [self.python, "-I", *args]

    def env(self) -> dict[str, str]:
        return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def run(self, *args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.cmd(*args), capture_output=True, text=True, cwd=self.cwd,
                              env=self.env(), timeout=timeout_s)


def _git(*args: str, **kw: Any) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, timeout=120, **kw)


def _check_commit() -> str:
    if PREVIOUS_RELEASE is None:
        raise Unavailable("no earlier release exists: this is the first release, so there "
                          "is nothing to upgrade from (tests/oldrelease.py: PREVIOUS_RELEASE)")
    if shutil.which("git") is None:
        raise Unavailable("needs git to extract the previous release")
    r = _git("cat-file", "-e", f"{PREVIOUS_RELEASE}^{{commit}}")
    if r.returncode != 0:
        raise Unavailable(f"commit {PREVIOUS_RELEASE[:12]} (the previous release) is not in "
                          f"this clone (a shallow one? `git fetch --unshallow`): "
                          f"{r.stderr.decode(errors='replace').strip()}")
    return PREVIOUS_RELEASE


def _deps_path() -> list[str]:
    """This interpreter's site-packages (its third-party packages), wherever they are: a
    venv inside the checkout (the README's ``./.venv``) included.  Their ``shmhb``, if
    any, is this release's, but it cannot shadow the old one: the old venv's own
    site-packages comes first on its path (``build_old_release`` checks which it
    imports), and the directories listed in a ``.pth`` file are added as they are,
    their own ``.pth`` files (an editable install's) unread.  Only the checkout itself
    is left out: its ``shmhb/`` is this release."""
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    root = os.path.realpath(ROOT)
    return [d for d in dict.fromkeys(dirs)
            if os.path.isdir(d) and os.path.realpath(d) != root]


def _extract(src: str, commit: str) -> None:
    os.makedirs(src)
    archive = subprocess.Popen(["git", "-C", ROOT, "archive", "--format=tar", commit],
                               stdout=subprocess.PIPE)
    assert archive.stdout is not None
    tar = subprocess.run(["tar", "-x", "-C", src], stdin=archive.stdout, capture_output=True)
    archive.stdout.close()
    if archive.wait(120) != 0 or tar.returncode != 0:
        raise AssertionError(f"git archive {commit} | tar -x failed: "
                             f"{tar.stderr.decode(errors='replace')}")


def _install(rel: OldRelease, src: str) -> None:
    """The release's package, its C extension built in place as CI builds this one's
    (``setup.py build_ext --inplace``; optional, as in ``pip install``: without setuptools
    or a compiler the old release runs its pure-Python hot path), copied into the venv's
    site-packages.  Not through pip: that would want ``wheel`` too, or the network."""
    out = rel.run("-c", "import sysconfig; print(sysconfig.get_path('purelib'))")
    assert out.returncode == 0, out.stderr
    purelib = out.stdout.strip()
    with open(os.path.join(purelib, "_shmhb_test_deps.pth"), "w") as f:
        f.write("".join(d + "\n" for d in _deps_path()))
    if rel.run("-c", "import setuptools").returncode == 0:
        r = subprocess.run(rel.cmd("setup.py", "--quiet", "build_ext", "--inplace"),
                           capture_output=True, text=True, cwd=src, env=rel.env(), timeout=300)
        assert r.returncode == 0, f"building the previous release failed:\n{r.stdout}{r.stderr}"
    shutil.copytree(os.path.join(src, "shmhb"), os.path.join(purelib, "shmhb"),
                    ignore=shutil.ignore_patterns("__pycache__"))


def build_old_release(tmp: str) -> OldRelease:
    """The previous release installed under ``tmp``; ``Unavailable`` if it cannot be."""
    t0 = time.monotonic()
    commit = _check_commit()
    prefix, cwd = os.path.join(tmp, "venv"), os.path.join(tmp, "run")
    os.makedirs(cwd)
    _extract(os.path.join(tmp, "src"), commit)
    venv.EnvBuilder(with_pip=False, symlinks=os.name != "nt").create(prefix)
    rel = OldRelease(prefix, os.path.join(prefix, "bin", "python"), cwd, "", False, 0.0)
    _install(rel, os.path.join(tmp, "src"))
    out = rel.run("-c", "import numpy, posix_ipc, zmq, shmhb; print(shmhb.__file__); "
                  "print(shmhb.native)")
    assert out.returncode == 0, f"the previous release does not import:\n{out.stderr}"
    path, native = out.stdout.split()
    assert os.path.realpath(path).startswith(os.path.realpath(prefix) + os.sep), \
        f"the old venv imports shmhb from {path}, not from its own site-packages"
    return dataclasses.replace(rel, package=os.path.dirname(path), native=native == "True",
                               build_s=time.monotonic() - t0)


# -- hosts of the previous release --------------------------------------------------------

#: ``CREATE NAME SLOTS POLICY_JSON``: create a board (in an old-release process)
CREATE = ("import json, sys, shmhb; shmhb.Board.create(sys.argv[1], slots=int(sys.argv[2]), "
          "policy=shmhb.Policy(**json.loads(sys.argv[3]))).close()")


class MixedCluster(Cluster):
    """A :class:`Cluster` whose processes run either release, each with its environment."""

    def __init__(self, tmp: str, procs: Procs, old: OldRelease) -> None:
        super().__init__(tmp, procs)
        self.old = old

    def spawn(self, cmd: list[str], label: str, **kw: Any) -> subprocess.Popen[bytes]:
        if cmd[0] != self.old.python:
            return super().spawn(cmd, label, **kw)
        log = open(os.path.join(self.tmp, label + ".log"), "wb")
        try:
            p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                 env=self.old.env(), cwd=self.old.cwd, **kw)
        finally:
            log.close()
        self._spawned.append((p, label))
        return p

    def old_worker(self, h: Host, key: str, *endpoints: str,
                   interval_s: float = 0.05) -> subprocess.Popen[str]:
        """``tests.conftest.WORKER`` run by the old release on ``h``'s board."""
        p = subprocess.Popen(self.old.cmd(WORKER, h.name, key, str(interval_s), "0",
                                          ",".join(endpoints)),
                             stdout=subprocess.PIPE, text=True, env=self.old.env(),
                             cwd=self.old.cwd)
        self.procs.procs.append(p)
        line = p.stdout.readline() if p.stdout else ""
        assert line.startswith("ready"), f"old worker did not start: {line!r}"
        p.ready_line = line  # type: ignore[attr-defined]
        return p

    def pair(self) -> tuple[OldHost, Host]:
        """An old host on 127.0.0.2 and a new one on 127.0.0.3, each following the other
        (``--peer``: the pinger's own setting, no watch held by any process)."""
        o_ip, n_ip = "127.0.0.2", "127.0.0.3"
        o = OldHost(self, o_ip, peers=(n_ip,))
        self.hosts.append(o)
        o.start_pinger()
        n = self.host(ip=n_ip, peers=(o_ip,))
        return o, n


class OldHost(Host):
    """A host of the previous release: its board created, its pinger and workers run, by
    the old release (this process, of this release, reads the board)."""

    def __init__(self, cluster: MixedCluster, ip: str, *, peers: tuple[str, ...]) -> None:
        super().__init__(cluster, ip, policy=FAST, slots=64, interval_s=INTERVAL_S,
                         secret_file=None, curve_keys=None, netns=None, peers=peers)
        self.old = cluster.old
        # Host made the board with this release: the old release makes it anew
        self.board.close()
        unlink_quietly(self.name)
        r = self.old.run("-c", CREATE, self.name, "64", json.dumps(dataclasses.asdict(FAST)))
        assert r.returncode == 0, f"the old release could not create a board:\n{r.stderr}"
        self.board = shmhb.Board.attach(self.name)

    def pinger_cmd(self, *, configure: bool = True, wall_offset_s: float = 0.0) -> list[str]:
        cmd = super().pinger_cmd(configure=configure, wall_offset_s=wall_offset_s)
        assert cmd[0] == sys.executable, cmd
        return self.old.cmd(*cmd[1:])

    def worker(self, key: str, *endpoints: str, interval_s: float = 0.05) -> subprocess.Popen[str]:
        assert isinstance(self.cluster, MixedCluster)
        return self.cluster.old_worker(self, key, *endpoints, interval_s=interval_s)


def start_pinger_of(h: Host, cmd: list[str]) -> subprocess.Popen[bytes]:
    """Start ``cmd`` (a pinger of either release, ``Host.pinger_cmd``'s arguments) as
    ``h``'s pinger and wait until it holds the role and listens."""
    p = h.cluster.spawn(cmd, f"{h.name}-pinger-{os.urandom(3).hex()}")
    h.wait_pinger(p)
    return p


def mixed_fixture(tmp_path: Any, old: OldRelease) -> Iterator[MixedCluster]:
    """Body of the ``mixed`` fixture: ``tests.hosts.cluster_fixture`` of a MixedCluster."""
    yield from cluster_fixture(tmp_path, lambda tmp, procs: MixedCluster(tmp, procs, old))
