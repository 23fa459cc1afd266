"""``shmhb units``: the written units pass ``systemd-analyze verify`` and name the running
shmhb, the given user and board; the shipped files are the same template's output."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from shmhb.cli import units
from shmhb.errors import InvalidConfig

from ..conftest import ME, ROOT, install_args, install_env


def run_units(*args: str, install: bool = True) -> subprocess.CompletedProcess[str]:
    """``shmhb units ARGS``, with --exec where this test run's shmhb lives under /tmp
    (unless ``install`` is False)."""
    extra = install_args() if install else []
    return subprocess.run([sys.executable, "-m", "shmhb", "units", *extra, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env=install_env())


def directives(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line and not line.startswith(("#", "[")) and "=" in line:
            k, v = line.split("=", 1)
            out.setdefault(k, []).append(v)
    return out


@pytest.mark.system
def test_units_written_for_this_host(tmp_path: Path) -> None:
    r = run_units("--out", str(tmp_path / "u"), "--user", ME, "--board", "shmhb-units-test")
    assert r.returncode == 0, r.stderr
    d = tmp_path / "u"
    assert sorted(p.name for p in d.iterdir()) == sorted(
        [units.PINGER_UNIT, units.EXPORTER_UNIT, units.ENV_FILE])
    pinger = directives((d / units.PINGER_UNIT).read_text())
    exporter = directives((d / units.EXPORTER_UNIT).read_text())
    env = directives((d / units.ENV_FILE).read_text())
    exe = pinger["ExecStart"][0].split()[0]
    assert os.access(exe, os.X_OK), exe
    given = install_args()
    if given:  # the install named with --exec, run as `<python> -m shmhb`
        assert pinger["ExecStart"][0].startswith(f"{given[1]} -m shmhb pinger")
    else:  # the very interpreter (environment) this test runs in, not a system-wide shmhb
        assert (Path(exe).parent == Path(sys.executable).parent
                or exe == os.path.abspath(sys.executable))
    for u in (pinger, exporter):
        assert u["User"] == [ME]
        assert u["Environment"][0] == "SHMHB_BOARD=shmhb-units-test"
        assert int(u["LimitNOFILE"][0]) >= 4096
        assert "Documentation" not in u  # nothing pip installs to point at
    assert pinger["Restart"] == ["always"]
    assert exporter["Restart"] == ["on-failure"]
    assert "--addr 127.0.0.1" in env["SHMHB_EXPORTER_ARGS"][0]
    assert env["SHMHB_BOARD"] == ["shmhb-units-test"]
    assert stat.S_IMODE((d / units.ENV_FILE).stat().st_mode) == 0o600
    assert "enable --now" in r.stdout and "edit" in r.stdout
    assert r.stdout.index("edit") < r.stdout.index("enable --now")


@pytest.mark.system
@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_written_units_verify(tmp_path: Path) -> None:
    r = run_units("--out", str(tmp_path), "--user", ME)
    assert r.returncode == 0, r.stderr
    v = subprocess.run(["systemd-analyze", "verify", str(tmp_path / units.PINGER_UNIT),
                        str(tmp_path / units.EXPORTER_UNIT)],
                       capture_output=True, text=True, timeout=60)
    assert v.returncode == 0, v.stdout + v.stderr
    assert "shmhb" not in v.stderr, v.stderr  # no complaint about our units at all


@pytest.mark.system
@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_verify_catches_a_missing_executable(tmp_path: Path) -> None:
    """The verify test can fail: a unit naming a command that does not exist is refused."""
    s = units.UnitSettings(command=("/nonexistent-shmhb-test/no-such-shmhb",), user=ME, group=ME)
    (tmp_path / units.PINGER_UNIT).write_text(units.pinger_unit(s))
    v = subprocess.run(["systemd-analyze", "verify", str(tmp_path / units.PINGER_UNIT)],
                       capture_output=True, text=True, timeout=60)
    assert v.returncode != 0
    assert "no-such-shmhb" in v.stderr


def test_shipped_files_are_the_template() -> None:
    shipped = Path(ROOT) / "packaging" / "systemd"
    for name, text in units.render(units.SHIPPED).items():
        path = shipped / (name + ".example" if name == units.ENV_FILE else name)
        assert path.read_text() == text, f"{path} differs from `shmhb units` (regenerate it)"


def test_a_command_under_private_tmp_is_refused() -> None:
    # PrivateTmp=yes gives the service an empty /tmp: a venv there could never start
    for cmd in (("/tmp/venv/bin/shmhb",), ("/var/tmp/v/bin/python", "-m", "shmhb")):
        with pytest.raises(InvalidConfig, match="PrivateTmp"):
            units.UnitSettings(command=cmd, user="shmhb", group="shmhb")
    units.UnitSettings(command=("/tmpfoo/bin/shmhb",), user="shmhb", group="shmhb")  # not /tmp


@pytest.mark.system
def test_exec_names_the_install_and_a_bad_one_is_refused(tmp_path: Path) -> None:
    script = tmp_path / "bin" / "shmhb"
    script.parent.mkdir()
    script.write_text("#!/bin/sh\necho shmhb 0.1.0\n")
    script.chmod(0o755)
    assert units.given_command(str(script)) == (str(script),)
    assert units.given_command(sys.executable) == (sys.executable, "-m", "shmhb")
    for bad, why in (("bin/shmhb", "absolute"), (str(tmp_path / "none"), "no executable"),
                     (str(tmp_path), "no executable")):
        with pytest.raises(InvalidConfig, match=why):
            units.given_command(bad)
    # one under /tmp is refused by the CLI with the way out, and nothing is written
    tmp_dir = tempfile.mkdtemp(dir="/tmp")
    try:
        under = Path(tmp_dir) / "shmhb"
        under.write_text("#!/bin/sh\necho shmhb 0.1.0\n")
        under.chmod(0o755)
        out = tmp_path / "u"
        r = run_units("--exec", str(under), "--out", str(out), "--user", ME, install=False)
        assert r.returncode == 2, r.stderr
        assert "PrivateTmp" in r.stderr and "--exec" in r.stderr
        assert not out.exists()
    finally:
        shutil.rmtree(tmp_dir)


@pytest.mark.system
def test_unknown_user_and_bad_values_are_refused(tmp_path: Path) -> None:
    r = run_units("--out", str(tmp_path), "--user", "no-such-user-shmhb")
    assert r.returncode == 2
    assert "no user 'no-such-user-shmhb'" in r.stderr and "--user" in r.stderr
    assert not any(tmp_path.iterdir())
    r = run_units("--out", str(tmp_path), "--board", "a b")
    assert r.returncode == 2 and "invalid board name" in r.stderr
    with pytest.raises(InvalidConfig, match="ExecStart"):
        units.UnitSettings(command=("/opt/my env/bin/shmhb",), user=ME, group=ME)
    with pytest.raises(InvalidConfig, match="ExecStart"):
        units.UnitSettings(command=("/opt/%h/shmhb",), user=ME, group=ME)


@pytest.mark.system
def test_out_never_follows_a_planted_symlink(tmp_path: Path) -> None:
    """A link planted at ``--out DIR/NAME`` is not followed (following it would overwrite
    the file it points to and make its mode 0644): each name is replaced by a new file
    (temporary name, then rename), the target keeps its bytes and mode, and the written
    files have exactly their intended modes whatever the umask."""
    out = tmp_path / "u"
    out.mkdir()
    victims = {}
    for name in (units.PINGER_UNIT, units.EXPORTER_UNIT, units.ENV_FILE):
        victim = tmp_path / f"victim-{name}"
        victim.write_text("precious\n")
        victim.chmod(0o600)
        (out / name).symlink_to(victim)
        victims[name] = victim
    old = os.umask(0o077)  # a strict umask must not make the units unreadable either
    try:
        r = run_units("--out", str(out), "--user", ME)
    finally:
        os.umask(old)
    assert r.returncode == 0, r.stderr
    for name, victim in victims.items():
        assert victim.read_text() == "precious\n", name
        assert stat.S_IMODE(victim.stat().st_mode) == 0o600, name
        path = out / name
        assert not path.is_symlink(), name
        want = 0o600 if name == units.ENV_FILE else 0o644
        assert stat.S_IMODE(path.lstat().st_mode) == want, name
        assert path.read_text().strip(), name
    assert sorted(p.name for p in out.iterdir()) == sorted(victims)  # no temporary left


@pytest.mark.system  # it starts processes (tests/tiers.py)
def test_an_exec_that_cannot_run_shmhb_is_refused(tmp_path: Path) -> None:
    # an interpreter without shmhb: the unit would verify, then fail at every start
    python = tmp_path / "python3"
    python.write_text("#!/bin/sh\necho \"No module named shmhb\" >&2\nexit 1\n")
    python.chmod(0o755)
    with pytest.raises(InvalidConfig, match="No module named shmhb"):
        units.given_command(str(python))
    r = run_units("--exec", str(python), "--out", str(tmp_path / "u"), "--user", ME,
                  install=False)
    assert r.returncode == 2 and "No module named shmhb" in r.stderr, r.stderr
    assert not (tmp_path / "u").exists()


@pytest.mark.system  # it starts processes (tests/tiers.py)
def test_an_empty_user_is_the_current_one_and_a_numeric_board_group_is_taken(
        tmp_path: Path) -> None:
    # `--user "$USER"` in a container, where $USER is unset
    r = run_units("--out", str(tmp_path / "u"), "--user", "", "--board-mode", "0660",
                  "--board-group", "12345")
    assert r.returncode == 0, r.stderr
    unit = directives((tmp_path / "u" / units.PINGER_UNIT).read_text())
    assert unit["User"] == [ME]
    assert "--board-group 12345" in (tmp_path / "u" / units.ENV_FILE).read_text()
