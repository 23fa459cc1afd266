"""What ``shmhb pinger`` sets on the board it opens: its policy, its mode and group, and
the pinger settings any holder of the agent role applies (``--listen``, ``--peer``, ...).

The daemon is the one place that sets a board's policy: under systemd and in the
DaemonSet it starts first and creates the board, so its flags (carried by the units'
settings file and the DaemonSet's args) decide how every reader judges.  A policy is
fixed when a board is created (readers take their thresholds from the header once, at
attach), so a pinger whose flags ask for another policy than an existing board holds
refuses to start, naming both, rather than run under a policy nobody asked for.  A
library caller's ``Board.open(policy=...)`` on an existing board logs a warning naming
both instead (``Board.warn_policy``): a worker is not where operators set timeouts, and
it must not die of it.

Access: boards are created mode 0600, for their owner alone.  ``--board-mode 0660
--board-group G`` lets another account in group G (an exporter running as the
Prometheus user, a vLLM worker under another uid) open the board.  Unlike the policy,
a mode and a group can change under the board's users (they only decide who may open
it next), so the pinger applies them to a board that exists already, if it owns it.
"""

from __future__ import annotations

import argparse
import grp
import logging
import os
import stat

from ..board.handle import Board
from ..board.config import (DEFAULT_BUDGET_PPS, DEFAULT_PORT, Capacity, PingerConfig, Policy,
                            board_name)
from ..board import locks
from ..board.core import board_words
from ..board.layout import LOCK_DAEMON
from ..errors import BoardPermissionError, InvalidConfig, SettingsConflict
from ..board.segment import SHM_DIR
from ..net.plan import MIN_PINGS_PER_WINDOW
from ..net.settings import (board_group, drops_authentication, read_secret, settings_differences,
                            store_config, stored_settings)

log = logging.getLogger(__name__)

#: (flag, Policy field) of the policy flags of ``shmhb pinger``
POLICY_FLAGS = (
    ("--suspect-after-s", "suspect_after_s"),
    ("--dead-after-s", "dead_after_s"),
    ("--peer-suspect-after-s", "peer_suspect_after_s"),
    ("--peer-dead-after-s", "peer_dead_after_s"),
    ("--forget-after-s", "forget_after_s"),
)


def add_board_args(sp: argparse.ArgumentParser) -> None:
    g = sp.add_argument_group(
        "board policy", "timeouts of a board this pinger creates (defaults: those of "
        "shmhb.Policy); an existing board with another policy is refused, naming both")
    a = sp.add_argument_group("board access", "who else may open the board (default: its "
                              "owner only, mode 0600); applied to an existing board too")
    a.add_argument("--board-mode", default=None, metavar="MODE",
                   help="permission bits in octal, e.g. 0660 to share with --board-group")
    a.add_argument("--board-group", default=None, metavar="GROUP",
                   help="group (name or gid) of the board (this account must be a member); with mode 0660 "
                        "its members may open it")
    g.add_argument("--slots", type=int, default=None, metavar="N",
                   help=f"local worker slots of a board this pinger creates (default "
                        f"{Capacity().slots}; fixed at creation: an existing board keeps its own)")
    d = Policy()
    for flag, f in POLICY_FLAGS:
        default = getattr(d, f)
        g.add_argument(flag, type=float, default=None, metavar="S",
                       help=f"(default {'off' if default is None else format(default, 'g')})")


def asked_policy(args: argparse.Namespace) -> Policy | None:
    """The policy the flags ask for (unset ones at their defaults); None: no flag given.
    ``InvalidConfig`` if the values are refused (e.g. dead before suspect)."""
    given = {f: getattr(args, f) for _, f in POLICY_FLAGS if getattr(args, f, None) is not None}
    return Policy(**given) if given else None


def board_mode(text: str | None) -> int | None:
    """``--board-mode`` as permission bits; ``InvalidConfig`` unless it is octal in
    0600..0777 and lets the owner read and write (what ``Board.create`` accepts)."""
    if text is None:
        return None
    try:
        mode = int(text, 8)
    except ValueError:
        raise InvalidConfig(f"--board-mode must be octal permission bits such as 0660, "
                            f"got {text!r}") from None
    if not 0 <= mode <= 0o777 or mode & 0o600 != 0o600:
        raise InvalidConfig(f"--board-mode must let the owner read and write (0600..0777, e.g. "
                            f"0660 to share with a group), got {text!r}")
    return mode


def board_gid(name: str | None) -> int | None:
    """``--board-group`` (a name, or a numeric gid as containers often have no group
    database entry) as a gid; ``InvalidConfig`` if no such group exists."""
    if name is None:
        return None
    if name.isdigit():
        return int(name)
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise InvalidConfig(f"no group {name!r} on this host (--board-group)") from None


def shared_gid(args: argparse.Namespace) -> int | None:
    """The group the pinger's board will be shared with, before it is opened: the one
    the flags set (mode 0660: ``--board-group``, else this account's), else that of an
    existing board whose group may read and write it; None: the owner's alone."""
    mode = board_mode(getattr(args, "board_mode", None))
    gid = board_gid(getattr(args, "board_group", None))
    try:
        st = os.stat(os.path.join(SHM_DIR, board_name(getattr(args, "board", None))))
    except OSError:
        st = None
    if mode is None and st is not None:
        mode = stat.S_IMODE(st.st_mode)
    if mode is None or mode & 0o060 != 0o060:
        return None
    if gid is not None:
        return gid
    return st.st_gid if st is not None else os.getegid()


def check_access_args(args: argparse.Namespace) -> None:
    """The access flags through their doors, before any board is touched."""
    board_mode(getattr(args, "board_mode", None))
    board_gid(getattr(args, "board_group", None))


def apply_access(name: str, mode: int | None, gid: int | None) -> None:
    """Give board ``name`` this mode and group (None: leave as is).  Through a
    descriptor opened without following links, so the path cannot be swapped for
    another file in between.  ``BoardPermissionError`` (saying what to do) if this
    account may not: it is not the owner, or not a member of the group."""
    if mode is None and gid is None:
        return
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        try:
            if gid is not None and st.st_gid != gid:
                os.fchown(fd, -1, gid)
                log.info("board %s: group set to %d", name, gid)
            if mode is not None and stat.S_IMODE(st.st_mode) != mode:
                os.fchmod(fd, mode)
                log.info("board %s: mode set to %04o", name, mode)
        except PermissionError:
            raise BoardPermissionError(
                f"cannot set the mode or group of board {name!r} (owner uid {st.st_uid}, group "
                f"{st.st_gid}, mode {stat.S_IMODE(st.st_mode):04o}): run the pinger as its "
                "owner, and as a member of --board-group") from None
    finally:
        os.close(fd)


def open_board(args: argparse.Namespace) -> Board:
    """Open (or create) the pinger's board as its flags say: its policy (``PolicyMismatch``
    if it exists with another), its mode and group (applied to an existing one too)."""
    mode = board_mode(getattr(args, "board_mode", None))
    gid = board_gid(getattr(args, "board_group", None))
    kw: dict[str, int] = {} if mode is None else {"mode": mode}
    if getattr(args, "slots", None) is not None:
        kw["slots"] = Capacity(slots=args.slots).slots  # InvalidConfig names the range
    b = Board.open(args.board, create=True, policy=asked_policy(args), strict_policy=True,
                   **kw)
    if "slots" in kw and b.capacity.slots != kw["slots"]:
        log.warning("board %s exists with %d slots; --slots %d applies only to a board this "
                    "pinger creates (to change it: stop its users, `shmhb gc`, start again)",
                    b.name, b.capacity.slots, kw["slots"])
    try:
        apply_access(b.name, mode, gid)
    except BaseException:
        b.close()
        raise
    return b


# -- the pinger settings ----------------------------------------------------------------

def add_pinger_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--listen", metavar="HOST:PORT", default=None,
                    help=f"address to answer pings on (port default {DEFAULT_PORT}, "
                         "one number for the whole cluster)")
    sp.add_argument("--peer", metavar="HOST[:PORT]", action="append", default=[],
                    help="a host to follow even if no local process watches it (repeatable)")
    sp.add_argument("--interval-s", type=float, default=0.2,
                    help="shortest ping interval per host (default 0.2); longer when the "
                         "budget needs it")
    sp.add_argument("--ping-budget-pps", type=float, default=DEFAULT_BUDGET_PPS, metavar="N",
                    help=f"pings per second to all followed hosts together (default "
                         f"{DEFAULT_BUDGET_PPS:g}); each host still gets at least "
                         f"{MIN_PINGS_PER_WINDOW} pings per peer dead-after window")
    sp.add_argument("--replace-settings", action="store_true",
                    help="store these settings even while another shmhb pinger runs on the "
                         "board, or when they turn its authentication off (without it such a "
                         "pinger is refused: exit 2)")
    auth = sp.add_mutually_exclusive_group()
    auth.add_argument("--secret-file", metavar="F", default=None,
                      help="shared secret: HMAC on every frame, unauthenticated pings unanswered")
    auth.add_argument("--curve-keys", metavar="DIR", default=None,
                      help="CURVE keys: DIR/<host>.key public keys of all hosts, "
                           "DIR/<listen host>.key_secret this host's")


def store_pinger_args(args: argparse.Namespace) -> bool:
    """Store the command line's pinger settings in the board; True: network half on.

    Settings that differ from those stored change under the holder of the role, so they
    are stored only when no other ``shmhb pinger`` runs on the board (this one replaces
    it: a restart with new flags) and they keep the board's authentication; otherwise
    ``SettingsConflict`` names the differences, unless ``--replace-settings`` says the
    operator means it.  The same settings are not stored again (the holder's network
    half is not restarted for nothing)."""
    cfg = PingerConfig(listen=args.listen, peers=tuple(args.peer), interval_s=args.interval_s,
                       secret_file=args.secret_file, curve_keys=args.curve_keys,
                       ping_budget_pps=args.ping_budget_pps)
    with Board.open(args.board, create=True) as b:
        if cfg.secret_file:  # fail now, with the reason, not in the agent thread
            read_secret(cfg.secret_file, shared_gid=board_group(b))
        have = stored_settings(b)
        if have is not None:
            diffs = settings_differences(have, cfg)
            if not diffs:
                return True
            if not getattr(args, "replace_settings", False):
                _refuse_silent_change(b, have, cfg, diffs)
            log.warning("board %s: pinger settings replaced: %s", b.name, "; ".join(diffs))
        store_config(b, cfg)
    return True


def _refuse_silent_change(b: Board, have: PingerConfig, want: PingerConfig,
                          diffs: list[str]) -> None:
    """``SettingsConflict`` if storing ``want`` over ``have`` would change the settings
    under another running pinger, or turn authentication off."""
    fd = board_words(b).new_fd()
    try:
        other_daemon = locks.is_held(fd, LOCK_DAEMON)  # before ours takes it (Agent.elect)
    finally:
        os.close(fd)
    if other_daemon:
        raise SettingsConflict(
            f"board {b.name}: another shmhb pinger runs on this board with other settings "
            f"({'; '.join(diffs)}); nothing was changed.  Run this one with the board's "
            "settings, or with none (a standby applies the board's); to change them, "
            "restart the running pinger with the new flags, or add --replace-settings to "
            "replace them under it")
    if drops_authentication(have, want):
        raise SettingsConflict(
            f"board {b.name}: these flags turn off the authentication the board's settings "
            f"have ({'; '.join(diffs)}); nothing was changed.  Give --secret-file (or "
            "--curve-keys) again, or add --replace-settings to run without authentication")
