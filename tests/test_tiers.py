"""The tiers (tests/tiers.py): a test that starts a process is ``system``, every other
``fast``, and a ``fast`` test that starts one fails, even where it swallows the error."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shmhb.testing.loopback import child_env

from .tiers import HOW, TESTS, _Guard, is_system

INNER = '''
import subprocess
import pytest

def test_pure():
    assert sum(range(4)) == 6

def test_starts_a_process():
    subprocess.run(["true"], check=True)

def test_swallows_the_error():
    try:
        subprocess.run(["true"])
    except Exception:  # noqa: BLE001 - the point: the guard must still fail it
        pass

@pytest.mark.system
def test_marked_system():
    subprocess.run(["true"], check=True)

def test_takes_the_procs_fixture(procs):
    subprocess.run(["true"], check=True)
'''

CONFTEST = '''
import pytest
from tests.tiers import (pytest_collection_modifyitems, pytest_runtest_makereport,
                         pytest_runtest_protocol)

@pytest.fixture
def procs():
    yield None
'''


def test_the_guard_refuses_a_start_only_while_armed() -> None:
    g = _Guard()
    g.audit("subprocess.Popen", ("true", ["true"], None, None))  # not armed: let through
    g.audit("open", ("/dev/null", "r", 0))
    assert g.started == []
    g.armed = True
    g.audit("open", ("/dev/null", "r", 0))  # not a process
    with pytest.raises(AssertionError, match="started a process"):
        g.audit("os.fork", ())
    assert g.started == ["os.fork"]


@pytest.mark.system
def test_a_fast_test_that_starts_a_process_fails(tmp_path: Path) -> None:
    (tmp_path / "test_inner.py").write_text(INNER)
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "pytest.ini").write_text(textwrap.dedent("""
        [pytest]
        markers =
            fast: no process
            system: processes
        """))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
                          str(tmp_path)], cwd=tmp_path, env=child_env(), capture_output=True,
                         text=True, timeout=120)
    got = {line.split()[1].split("::")[1]: line.split()[0] for line in out.stdout.splitlines()
           if line.startswith(("PASSED ", "FAILED "))}
    assert got == {"test_pure": "PASSED", "test_starts_a_process": "FAILED",
                   "test_swallows_the_error": "FAILED", "test_marked_system": "PASSED",
                   "test_takes_the_procs_fixture": "PASSED"}, out.stdout + out.stderr
    assert HOW.split("(")[0] in out.stdout
    fast = subprocess.run([sys.executable, "-m", "pytest", "-q", "--co", "-m", "fast",
                           "-p", "no:cacheprovider", str(tmp_path)], cwd=tmp_path,
                          env=child_env(), capture_output=True, text=True, timeout=120)
    assert "3/5 tests collected" in fast.stdout, fast.stdout + fast.stderr


class _Item:
    """What ``is_system`` reads of a pytest item."""

    def __init__(self, path: Path, fixtures: tuple[str, ...] = (), marked: bool = False) -> None:
        self.path, self.fixturenames, self.marked = path, fixtures, marked

    def get_closest_marker(self, name: str) -> object | None:
        return object() if self.marked and name == "system" else None


def test_a_test_is_system_by_its_mark_its_fixtures_or_its_folder() -> None:
    here = TESTS / "board" / "test_x.py"
    assert not is_system(_Item(here, ("board", "tmp_path")))  # type: ignore[arg-type]
    assert is_system(_Item(here, ("procs",)))  # type: ignore[arg-type]
    assert is_system(_Item(here, marked=True))  # type: ignore[arg-type]
    assert is_system(_Item(TESTS / "vllm" / "test_x.py"))  # type: ignore[arg-type]
    assert is_system(_Item(TESTS / "routers" / "test_x.py"))  # type: ignore[arg-type]
    assert not is_system(_Item(TESTS / "test_x.py"))  # type: ignore[arg-type]
