"""``shmhb units``: systemd units for the pinger and the exporter, written for this host.

The units name the ``shmhb`` that is running (a virtual environment's ``bin/shmhb``, or
``python -m shmhb`` where no script exists), the account the workers run as, and the
board; the settings that differ per host (listen address, peers, secret) go into an
environment file the operator edits before enabling anything.  The files shipped in
``packaging/systemd/`` are this module's output for the example values in
``SHIPPED`` (a test keeps them equal), so there is one template.

Pure text in, text out, apart from ``running_command`` and ``account`` (which look at
this process and the user database) and ``write_units`` (which writes the files).
"""

from __future__ import annotations

import grp
import os
import pwd
import re
import secrets
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ..board.config import DEFAULT_BOARD, board_name
from ..errors import InvalidConfig

PINGER_UNIT = "shmhb-pinger.service"
EXPORTER_UNIT = "shmhb-exporter.service"
ENV_FILE = "shmhb.env"
DEFAULT_ENV_PATH = "/etc/default/shmhb"

#: The pinger holds one pidfd per local worker, a ZMQ socket per followed host and reads
#: /proc; systemd's default of 1024 descriptors is tight at thousands of slots.
PINGER_NOFILE = 65536
EXPORTER_NOFILE = 4096

# What may appear unquoted in a unit file's ExecStart= and User=: no whitespace, no
# quotes, no '%' (a systemd specifier), no '$' (an environment expansion), no '\'.
_SAFE_PATH = re.compile(r"^/[A-Za-z0-9_./+@:=,-]*$")
#: what PrivateTmp=yes (in the units' hardening) hides from the service
_PRIVATE_TMP_DIRS = ("/tmp", "/var/tmp")
_SAFE_ACCOUNT = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,31}\$?$")


def under_private_tmp(path: str) -> bool:
    """Whether ``path`` lies where the units' PrivateTmp=yes shows the service an empty
    directory (/tmp, /var/tmp)."""
    return any(path == d or path.startswith(d + "/") for d in _PRIVATE_TMP_DIRS)


@dataclass(frozen=True)
class UnitSettings:
    """What the units are written for; validated on construction."""

    command: tuple[str, ...]  # the shmhb command: ("/venv/bin/shmhb",) or (python, "-m", "shmhb")
    user: str
    group: str
    board: str = DEFAULT_BOARD
    env_path: str = DEFAULT_ENV_PATH
    #: who else may open the board: the pinger's --board-mode / --board-group, prefilled
    #: into SHMHB_PINGER_ARGS (None: the owner only, mode 0600)
    board_mode: str | None = None
    board_group: str | None = None

    def __post_init__(self) -> None:
        if not self.command:
            raise InvalidConfig("the shmhb command is empty")
        for part in self.command:
            if not (_SAFE_PATH.match(part) or part in ("-m", "shmhb")):
                raise InvalidConfig(
                    f"cannot put {part!r} into a unit's ExecStart=: install shmhb under a path "
                    "of letters, digits and / . _ - only (no spaces, quotes, % or $)")
            if under_private_tmp(part):
                raise InvalidConfig(
                    f"{part!r} is under /tmp or /var/tmp, which the units' PrivateTmp=yes "
                    "replaces with an empty directory: the service could not start it. "
                    "Install shmhb elsewhere (e.g. python3 -m venv /opt/shmhb) and write "
                    "the units from there, or name that install with --exec PATH")
        for what, name in (("user", self.user), ("group", self.group)):
            if not _SAFE_ACCOUNT.match(name):
                raise InvalidConfig(f"invalid {what} name {name!r}")
        board_name(self.board)  # raises InvalidName with the rule
        if self.board_mode is not None and not re.match(r"^0?[67][0-7][0-7]$", self.board_mode):
            raise InvalidConfig(f"invalid board mode {self.board_mode!r}: octal bits that let "
                                "the owner read and write, e.g. 0660")
        if self.board_group is not None and not (self.board_group.isdigit()
                                                 or _SAFE_ACCOUNT.match(self.board_group)):
            # a numeric gid, as `shmhb pinger --board-group` takes (containers often have
            # no group database entry)
            raise InvalidConfig(f"invalid board group {self.board_group!r}: a group name "
                                "or a numeric gid")
        if not _SAFE_PATH.match(self.env_path):
            raise InvalidConfig(f"invalid environment file path {self.env_path!r}: use an absolute "
                                "path of letters, digits and / . _ -")

    @property
    def exec(self) -> str:
        return " ".join(self.command)

    @property
    def pinger_args(self) -> str:
        """The initial SHMHB_PINGER_ARGS: the board's access, if any was asked for."""
        out = []
        if self.board_mode is not None:
            out += ["--board-mode", self.board_mode]
        if self.board_group is not None:
            out += ["--board-group", self.board_group]
        return " ".join(out)


#: The example values the files in packaging/systemd/ are rendered with.
SHIPPED = UnitSettings(command=("/usr/local/bin/shmhb",), user="shmhb", group="shmhb")


def running_command() -> tuple[str, ...]:
    """The ``shmhb`` this process runs as: the console script if this process is it (or
    one sits next to this interpreter, as in a virtual environment), else
    ``<python> -m shmhb``.  The interpreter's path is kept as it is (not resolved), so
    a virtual environment's ``bin/python`` stays the one that finds its packages."""
    argv0 = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if argv0 is not None and argv0.name == "shmhb" and os.access(argv0, os.X_OK):
        return (os.path.abspath(argv0),)
    beside = Path(sys.executable).parent / "shmhb"
    if os.access(beside, os.X_OK):
        return (os.path.abspath(beside),)
    return (os.path.abspath(sys.executable), "-m", "shmhb")


def given_command(path: str) -> tuple[str, ...]:
    """The command for ``--exec PATH``: a ``shmhb`` console script as it is, any other
    executable (a Python interpreter that has shmhb installed) as ``PATH -m shmhb``.  The
    path must be absolute and executable here; the units' own rules are checked later by
    :class:`UnitSettings`."""
    if not os.path.isabs(path):
        raise InvalidConfig(f"--exec {path!r}: give an absolute path (the units run it "
                            "with no PATH search)")
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise InvalidConfig(f"--exec {path!r}: no executable file there: give the shmhb "
                            "console script of the install the service should run, or its "
                            "Python interpreter")
    cmd = (path,) if Path(path).name == "shmhb" else (path, "-m", "shmhb")
    # The unit would verify and then fail at start: try it here, as its ExecStart runs it
    # (an interpreter without shmhb, a console script of a removed environment).
    try:
        out = subprocess.run([*cmd, "--version"], capture_output=True, text=True,
                             timeout=60, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise InvalidConfig(f"--exec {path!r}: cannot run `{' '.join(cmd)} --version`: "
                            f"{e}") from None
    if out.returncode != 0 or not out.stdout.startswith("shmhb "):
        last = (out.stderr.strip().splitlines() or [f"exit {out.returncode}, {out.stdout!r}"])[-1]
        raise InvalidConfig(f"--exec {path!r}: `{' '.join(cmd)} --version` fails ({last}): "
                            "give the shmhb console script of the install the service "
                            "should run, or a Python interpreter that has shmhb installed")
    return cmd


def account(user: str | None, group: str | None) -> tuple[str, str]:
    """``user`` (default: who runs this) and ``group`` (default: the user's primary
    group), both checked against this host's user database."""
    if not user:  # not given, or given empty (`--user "$USER"` where $USER is unset)
        try:
            user = pwd.getpwuid(os.getuid()).pw_name
        except KeyError:
            raise InvalidConfig(f"this account (uid {os.getuid()}) has no name in the user "
                                "database: pass --user with the account the workers run "
                                "as") from None
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        raise InvalidConfig(
            f"no user {user!r} on this host: pass --user with the account the workers run "
            f"as (boards are mode 0600), or create one (`useradd --system {user}`)") from None
    if group is None:
        try:
            group = grp.getgrgid(pw.pw_gid).gr_name
        except KeyError:
            group = str(pw.pw_gid)
    else:
        try:
            grp.getgrnam(group)
        except KeyError:
            raise InvalidConfig(f"no group {group!r} on this host") from None
    return user, group


_HARDENING = """\
# Hardening that leaves /dev/shm shared with the workers. Do NOT add PrivateDevices=,
# PrivateIPC= or ProtectSystem=strict without ReadWritePaths=/dev/shm: this service must
# see the same /dev/shm as the workers. ProtectHome=read-only (not yes): shmhb may be
# installed in a virtual environment under a home directory.
NoNewPrivileges=yes
ProtectHome=read-only
ProtectSystem=full
PrivateTmp=yes
"""


def pinger_unit(s: UnitSettings) -> str:
    return f"""\
# The host agent of the shmhb liveness board, as a daemon: watches every local worker
# through a pidfd and, with its network half, pings the hosts local workers link to.
# Written by `shmhb units`; help: `{s.exec} pinger --help`.
# Edit {s.env_path} (listen address, peers, secret) BEFORE `systemctl enable --now`.
[Unit]
Description=shmhb pinger (host agent of the shmhb liveness board)
Wants=network-online.target
After=network-online.target

[Service]
# The pinger says READY=1 once its agent runs (holding the role or waiting for it) and
# feeds systemd's watchdog while the agent's thread makes progress: a pinger whose
# agent loop is stuck for WatchdogSec is killed (SIGABRT) and restarted, on top of the
# agent's own 10 s watchdog, which gives the role up and exits 1.
Type=notify
NotifyAccess=main
WatchdogSec=30
# The account the workers run as: boards are created with mode 0600, and only their
# owner can register, watch or hold the agent role.
User={s.user}
Group={s.group}
Environment=SHMHB_BOARD={s.board}
Environment=SHMHB_PINGER_ARGS=
EnvironmentFile=-{s.env_path}
ExecStart={s.exec} pinger $SHMHB_PINGER_ARGS
# A killed pinger costs nothing but the time to restart: a worker runs the role
# embedded meanwhile, and the board keeps every verdict. Always come back.
Restart=always
RestartSec=1
# Exit 2 is a start refused for its settings (a policy the board does not have, an
# unreadable secret, a bad flag): no restart can fix it, so the unit fails at once with
# the reason in its log (`systemctl status`) rather than crash-looping; `shmhb status`
# exits 5 meanwhile (no daemon runs) while a worker holds the role embedded.
RestartPreventExitStatus=2
# The agent exits 1 when its loop was stuck and it gave the role up: restarted above.
# SIGTERM: the agent writes a clean "left" and releases the role at once.
KillSignal=SIGTERM
TimeoutStopSec=10
# One pidfd per local worker, one socket per followed host, /proc reads; a connection
# flood past the limit only degrades the network half (half-open handshakes end after 2 s).
LimitNOFILE={PINGER_NOFILE}
{_HARDENING}
[Install]
WantedBy=multi-user.target
"""


def exporter_unit(s: UnitSettings) -> str:
    return f"""\
# Prometheus metrics of the shmhb board (docs/METRICS.md). Read-only: one board read
# per scrape, nothing in between. Works with or without the pinger running.
# Written by `shmhb units`; help: `{s.exec} exporter --help`.
[Unit]
Description=shmhb exporter (Prometheus metrics of the shmhb liveness board)
After=network-online.target {PINGER_UNIT}

[Service]
Type=simple
# The board's owner (boards are mode 0600).
User={s.user}
Group={s.group}
Environment=SHMHB_BOARD={s.board}
# Loopback by default; set --addr to the host's address (or 0.0.0.0) in
# {s.env_path} for a Prometheus server on another host.
Environment="SHMHB_EXPORTER_ARGS=--port 9645 --addr 127.0.0.1"
EnvironmentFile=-{s.env_path}
ExecStart={s.exec} exporter $SHMHB_EXPORTER_ARGS
Restart=on-failure
RestartSec=2
TimeoutStopSec=10
LimitNOFILE={EXPORTER_NOFILE}
{_HARDENING}
[Install]
WantedBy=multi-user.target
"""


def env_file(s: UnitSettings) -> str:
    return f"""\
# {s.env_path}: settings of {PINGER_UNIT} and {EXPORTER_UNIT}.
# Written by `shmhb units`. Edit it before `systemctl enable --now`.
#
# The board both use (also the default of every worker that reads $SHMHB_BOARD).
SHMHB_BOARD={s.board}
#
# `shmhb pinger` options. Empty: the local half only (deaths of local workers are
# recorded; no host is pinged and nobody can ping this one). For the network half, set
# this host's listen address, hosts to follow even when no local worker watches them,
# and authentication (docs/PINGER.md, "Security"), for example:
#   SHMHB_PINGER_ARGS=--listen 10.0.0.1:45645 --peer 10.0.0.2 --secret-file /etc/shmhb/secret
# The secret must be readable by the account above and by nobody else (mode 0600):
#   (umask 077; head -c 32 /dev/urandom | base64 > /etc/shmhb/secret)
# The board's policy is set here too, and only here: the pinger starts before the
# workers and creates the board with it (a worker's Board.open(policy=...) cannot change
# an existing board's and logs a warning naming both), e.g.
#   --suspect-after-s 2 --dead-after-s 10 --peer-suspect-after-s 1 --peer-dead-after-s 5
# A board that exists with another policy makes the pinger refuse to start, naming both.
# Who else may open the board (mode 0600 by default: the owner only), e.g. an exporter
# running as the prometheus account, a member of the group:
#   --board-mode 0660 --board-group prometheus   (`shmhb units --board-mode/--board-group`)
SHMHB_PINGER_ARGS={s.pinger_args}
#
# `shmhb exporter` options. Loopback only by default; --addr 0.0.0.0 (or this host's
# address) to be scraped from another host.
SHMHB_EXPORTER_ARGS=--port 9645 --addr 127.0.0.1
"""


def render(s: UnitSettings) -> dict[str, str]:
    """File name -> contents, for the three files."""
    return {PINGER_UNIT: pinger_unit(s), EXPORTER_UNIT: exporter_unit(s), ENV_FILE: env_file(s)}


def write_units(out_dir: str | os.PathLike[str], s: UnitSettings) -> list[Path]:
    """Write the three files into ``out_dir`` (created if missing); returns their paths.
    Unit files get mode 0644, the environment file 0600 (it may come to name secrets).

    Each file is written to a fresh temporary name in ``out_dir`` (``O_EXCL``: never an
    existing file, never through a link) with its mode set before any byte is written,
    then renamed over the name: a symlink planted at ``out_dir/NAME`` is replaced, never
    followed, so the file it points to is neither overwritten nor re-moded, and a reader
    never sees a half-written unit."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render(s).items():
        path = out / name
        mode = 0o600 if name == ENV_FILE else 0o644
        _replace_file(path, text, mode)
        written.append(path)
    return written


def _replace_file(path: Path, text: str, mode: int) -> None:
    """``path`` replaced by a new file holding ``text`` with exactly ``mode``."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            fd = os.open(tmp, flags, 0o600)
        except FileExistsError:
            continue  # someone holds that name: draw another
        break
    else:
        raise FileExistsError(f"{path.parent}: no free temporary name to write {path.name}")
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), mode)  # the umask does not decide a unit's mode
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # rename(2) replaces a link at ``path``, never follows it
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def next_steps(paths: list[Path], s: UnitSettings) -> str:
    """What to do with the written files, for the command's output."""
    d = paths[0].parent
    return f"""\
next:
  1. edit {d / ENV_FILE}: the pinger's --listen, --peer and --secret-file (empty = local only)
  2. sudo install -m 0644 {d / PINGER_UNIT} {d / EXPORTER_UNIT} /etc/systemd/system/
     sudo install -m 0600 {d / ENV_FILE} {s.env_path}
  3. sudo systemctl daemon-reload && sudo systemctl enable --now shmhb-pinger shmhb-exporter
  4. shmhb status --board {s.board}"""
