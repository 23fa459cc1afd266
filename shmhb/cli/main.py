"""The ``shmhb`` command: status, monitor, events, exporter, gc, pinger, units, demo.

The only place that sets up logging.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..version import __version__
from ..board.handle import Board
from ..board.config import BOARD_ENV, DEFAULT_BOARD, AgentConfig, PingerConfig, board_name, check_host, positive_seconds
from ..errors import BoardNotFound, InvalidConfig, ShmhbError
from .exits import (
    EXIT_BROKEN_PIPE, EXIT_ERROR, EXIT_INTERRUPTED, EXIT_NETWORK, EXIT_NO_DAEMON,
    EXIT_NO_OBSERVER, EXIT_OK, EXIT_SLOTS, EXIT_UNHEALTHY,
)
from .pipes import PipeConsole, reader_gone
from .stopsignal import stop_on_signals
from .view import STATUS_SCHEMA, View

log = logging.getLogger(__name__)


def _status_doc(view: View, native: bool) -> dict[str, object]:
    code, problems = view.health()
    policy = view.policy
    return {
        "schema": STATUS_SCHEMA,
        "board": view.board,
        "native": native,
        "health": {"exit_code": code, "problems": problems},
        "slots": [s.to_json() for s in sorted(view.slots, key=lambda s: s.key)],
        "pinger": {**view.agent.to_json(), "held": view.agent_held, "holder": view.holder(),
                   "daemon": view.daemon, "daemon_configured": view.pinger_configured,
                   "lateness_ms": view.lateness_ms, "stats": dict(view.stats)},
        "network": view.network.to_json(),
        "peers": [p.to_json() for p in view.peers],
        "policy": None if policy is None else {
            "suspect_after_s": policy.suspect_after_s,
            "dead_after_s": policy.dead_after_s,
            "peer_suspect_after_s": policy.peer_suspect_after_s,
            "peer_dead_after_s": policy.peer_dead_after_s,
        },
    }


def cmd_status(args: argparse.Namespace) -> int:
    from .view import read_view

    with Board.attach(args.board) as board:
        view = read_view(board)
        native = board.native
    if args.agent_only:  # a liveness probe of the host's agent, nothing else
        why = view.agent_problem()
        print(f"problem: {why}" if why else f"agent pid {view.agent.pid} alive")
        return EXIT_OK if why is None else EXIT_NO_OBSERVER
    code, problems = view.health()
    if args.json:
        json.dump(_status_doc(view, native), sys.stdout, indent=2)
        print()
        return code
    from .monitor import print_status

    print_status(view)
    for p in problems:
        print(f"problem: {p}")
    return code


def cmd_monitor(args: argparse.Namespace) -> int:
    from .monitor import run_monitor

    if not args.refresh_hz > 0:
        raise InvalidConfig(f"--refresh-hz must be positive, got {args.refresh_hz}")
    if not sys.stdout.isatty():
        print("shmhb: monitor needs a terminal; for logs and scripts use `shmhb events "
              "--follow` or `shmhb status --json`", file=sys.stderr)
        return 2
    stop = threading.Event()
    _stop_on_sigterm(stop)
    with Board.attach(args.board) as board:
        return run_monitor(board, refresh_hz=args.refresh_hz, stop=stop)


def cmd_events(args: argparse.Namespace) -> int:
    from .events import EventLog
    from .view import read_view

    if not args.interval_s > 0:
        raise InvalidConfig(f"--interval-s must be positive, got {args.interval_s}")
    stop = threading.Event()
    _stop_on_sigterm(stop)
    evlog = EventLog(keep=1)

    def emit(board: Board) -> None:
        for e in evlog.update(read_view(board)):
            print(json.dumps(e.to_json()) if args.json else str(e), flush=True)

    # Ctrl-C and a closed pipe (`events --follow | head`) end in main(), as for every command
    with Board.attach(args.board) as board:
        emit(board)
        while args.follow and not stop.wait(args.interval_s):
            emit(board)
    return 0


def cmd_exporter(args: argparse.Namespace) -> int:
    from .exporter import Exporter

    stop = threading.Event()
    _stop_on_sigterm(stop)
    try:
        exp = Exporter(args.board, addr=args.addr, port=args.port).start()
    except OSError as e:
        print(f"shmhb: cannot listen on {args.addr}:{args.port}: {e.strerror}", file=sys.stderr)
        return 2
    print(f"shmhb exporter: board {exp.collector.name} on {exp.url}", flush=True)
    try:
        while not stop.wait(1.0):  # SIGTERM: 0; Ctrl-C: 130, in main()
            pass
    finally:
        exp.stop()
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    from .gc import list_boards, remove, unreadable_owners
    from .screen import Columns

    boards = list_boards(args.names or None)
    # Exit statuses as for every command (docs/OPERATIONS.md): 2 for a board named that does not
    # exist, 1 when nothing was removed, 0 when something was
    missing = sorted(set(args.names or ()) - {b.name for b in boards})
    if missing:
        raise BoardNotFound(f"no board {', '.join(map(repr, missing))} in /dev/shm "
                            "(`shmhb gc` with no name lists every board)")
    hidden = {} if args.names else unreadable_owners()
    if hidden:
        print(f"/dev/shm also holds {sum(hidden.values())} file(s) this account cannot read "
              f"(owner uid {', '.join(map(str, sorted(hidden)))}): boards of another account "
              "are listed and removed by `shmhb gc` run as their owner (or root)")
    if not boards:
        print("no shmhb boards this account can read on this host: nothing to remove")
        return EXIT_UNHEALTHY
    t = Columns(None, [("NAME", "left"), ("SIZE", "right"), ("STATE", "left"),
                       ("DETAIL", "left"), ("ACTION", "left")])
    for b in boards:
        t.add_row(b.name, f"{b.size / 2**20:.1f} MiB", b.state, b.detail,
                  "remove" if b.removable else f"keep: {b.why_kept()}")
    PipeConsole(soft_wrap=True).print(t.render())
    doomed = [b for b in boards if b.removable]
    if not doomed:
        print("nothing to remove: every board is in use")
        return EXIT_UNHEALTHY
    if not args.yes:
        names = ", ".join(b.name for b in doomed)
        print(f"remove {len(doomed)} unused board(s): {names}? [y/N] ", end="", flush=True)
        answer = sys.stdin.readline()
        if not sys.stdin.isatty():
            print(answer.strip())  # echo what a script answered
        answer = answer.strip().lower()
        if answer not in ("y", "yes"):
            print("nothing removed")
            return 1
    failed = 0
    for b in doomed:
        if remove(b):
            print(f"removed {b.name}")
        else:
            print(f"kept {b.name}: it came into use (see the log)")
            failed += 1
    return 1 if failed else 0


def _stop_on_sigterm(stop: threading.Event) -> None:
    """SIGTERM ends a long-running command cleanly (the terminal restored, sockets
    closed), as Ctrl-C does.  Never ``stop.set()`` in a handler: see stopsignal."""
    stop_on_signals(stop, (signal.SIGTERM,))


def cmd_pinger(args: argparse.Namespace) -> int:
    from ..agent.role import Agent

    from .boardopts import open_board

    from ..agent.election import check_tick

    with open_board(args) as b:  # the policy flags: checked against an existing board
        check_tick(args.tick_s, b.policy, what="--tick-s")  # before any setting is stored
    if args.listen is not None or args.peer or args.secret_file or args.curve_keys:
        from .boardopts import store_pinger_args
        store_pinger_args(args)  # stored in the board: any holder of the role applies them
    agent = Agent(board_name(args.board),
                  config=AgentConfig(tick_s=args.tick_s, watchdog_s=args.watchdog_s),
                  daemon=True)
    stop = threading.Event()

    def _stop(signum: int) -> None:  # called from stopsignal's thread, not a handler
        log.info("signal %d: stopping", signum)
        agent.stop(timeout_s=0)

    from . import sdnotify

    stop_on_signals(stop, (signal.SIGTERM, signal.SIGINT), _stop)
    agent.start()
    log.info("pinger for board %s started (pid %d); waiting for the agent role",
             board_name(args.board), os.getpid())
    # Type=notify: ready once the agent's thread runs (holding the role, or a standby
    # for it); WatchdogSec=: fed while that thread makes progress, so a pinger whose
    # agent loop is stuck is restarted by systemd even if its main thread is fine.
    sdnotify.notify("READY=1\nSTATUS=agent started; holding or waiting for the role")
    wd_s = sdnotify.watchdog_interval_s()
    period_s = 0.5 if wd_s is None else min(0.5, wd_s / 4)
    holding = False
    while not stop.wait(period_s):
        now = time.monotonic_ns()
        if wd_s is not None and now - agent.last_progress_ns() < wd_s * 1e9 / 2:
            sdnotify.notify("WATCHDOG=1")
        if agent.holding.is_set() != holding:
            holding = agent.holding.is_set()
            sdnotify.notify("STATUS=" + ("holding the agent role" if holding else
                                         "standby: waiting for the agent role"))
        if agent.deposed.is_set():
            log.error("the agent loop was stuck and gave the role up: exiting so that a "
                      "supervisor restarts this pinger")
            return 1
        if not agent.is_running():
            log.error("the agent loop ended unexpectedly")
            return 1
    sdnotify.notify("STOPPING=1")
    agent.stop()
    return 0


def cmd_units(args: argparse.Namespace) -> int:
    from .units import (UnitSettings, account, given_command, next_steps, running_command,
                        write_units)

    user, group = account(args.user, args.group)
    if args.board_group is not None:
        from .boardopts import board_gid
        board_gid(args.board_group)  # a group of this host, or a numeric gid: as the pinger takes
    command = running_command() if args.exec is None else given_command(args.exec)
    settings = UnitSettings(command=command, user=user, group=group,
                            board=board_name(args.board), env_path=args.env_path,
                            board_mode=args.board_mode, board_group=args.board_group)
    paths = write_units(args.out, settings)
    for p in paths:
        print(f"wrote {p}")
    print(next_steps(paths, settings))
    return 0


def cmd_forget(args: argparse.Namespace) -> int:
    with Board.attach(args.board) as board:
        s = board.forget(args.key)
    print(f"forgot {s.key!r}: it was {s.status.value} (pid {s.pid}, incarnation {s.incarnation})")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo
    return run_demo(quick=args.quick, base_addr=args.base_addr)


#: ``shmhb status --help``: its exit statuses
STATUS_EPILOG = f"""exit status (the first that applies, in this order):
  {EXIT_ERROR}  the command failed (no such board, bad options)
  {EXIT_NO_OBSERVER}  no running agent: none ever ran, or its holder is gone, stalled or
     left; deaths are not detected at once and remote verdicts read unknown (not
     while no worker is registered, or every one left or was forgotten, and the agent
     never ran, left cleanly, or died with the last worker where no pinger is set up)
  {EXIT_NETWORK}  the configured network half (shmhb pinger --listen) is not working:
     cannot listen, secret or keys unreadable, hosts skipped, restarting
  {EXIT_NO_DAEMON}  no `shmhb pinger` daemon runs, though one stored its settings in the
     board (--listen, --peer, ...): it stopped, or is refused at each start
  {EXIT_SLOTS}  a local slot is suspect, dead or unknown
  {EXIT_OK}  healthy: an agent runs, its network half works (or none is configured),
     every local slot is alive or left
--json prints the same facts ("schema": {STATUS_SCHEMA}) and exits with the same code.
{EXIT_BROKEN_PIPE} (any command) the reader of the output went away (`| head`)."""


#: ``command(name, help, board=True, **add_parser_kwargs)``: a subcommand's parser that
#: takes the common flags, and ``--board`` unless ``board=False`` (see ``build_parser``)
AddCommand = Callable[..., argparse.ArgumentParser]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shmhb", description="Shared-memory liveness board.")
    p.add_argument("--version", action="version", version=f"shmhb {__version__}")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    # -v after the subcommand too (`shmhb status -v`): every subparser takes it from this
    # parent; SUPPRESS keeps the count given before the subcommand when none comes after
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                        help="more logging (-vv: debug)")
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, help: str, board: bool = True, **kw: Any) -> argparse.ArgumentParser:
        sp: argparse.ArgumentParser = sub.add_parser(name, parents=[common], help=help, **kw)
        if board:
            sp.add_argument("--board", default=None,
                            help=f"board name (default: ${BOARD_ENV} or {DEFAULT_BOARD!r})")
        return sp

    _add_status(command)
    _add_pinger(command)
    _add_readers(command)
    _add_housekeeping(command)
    sp = command("demo", "a self-contained tour: kill, hang and restart workers", board=False)
    sp.add_argument("--quick", action="store_true", help="shorter timeouts (for tests)")
    sp.add_argument("--base-addr", default=None, metavar="ADDR",
                    help="host A's loopback address, B gets the next (default: "
                         "$SHMHB_LOOPBACK_BASE or 127.0.0.2; must be in 127.0.0.0/8)")
    sp.set_defaults(func=cmd_demo)
    from .feed import add_parsers  # shmhb feed, shmhb instances (P/D routers)
    add_parsers(sub)
    return p


def _add_status(command: AddCommand) -> None:
    """``shmhb status``: the host's health, as text, JSON or an exit status."""
    sp = command(
        "status", "show the board; the exit status says whether the host is healthy",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Show the board: the agent, its network half, local slots, remote hosts.",
        epilog=STATUS_EPILOG)
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp.add_argument("--agent-only", action="store_true",
                    help=f"check only that an agent runs and holds the role: exit {EXIT_OK} or "
                         f"{EXIT_NO_OBSERVER} (a liveness probe for the pinger's container)")
    sp.set_defaults(func=cmd_status)


def _add_pinger(command: AddCommand) -> None:
    """``shmhb pinger``: the daemon that holds the agent role."""
    sp = command("pinger", "hold the host agent role in the foreground")
    sp.add_argument("--tick-s", type=float, default=AgentConfig().tick_s,
                    help=f"agent loop period (default {AgentConfig().tick_s:g}, <= agent_stale_s/4)")
    sp.add_argument("--watchdog-s", type=float, default=10.0,
                    help="give the role up (and exit 1) when the agent loop is blocked this "
                         "long (default 10)")
    sp.set_defaults(func=cmd_pinger)
    from .boardopts import add_board_args, add_pinger_args
    add_pinger_args(sp)
    add_board_args(sp)


def _add_readers(command: AddCommand) -> None:
    """The commands that follow the board: a screen, an event stream, metrics."""
    sp = command("monitor", "live full-screen view of the board (Ctrl-C quits)")
    sp.add_argument("--refresh-hz", type=float, default=4.0,
                    help="screen refreshes per second (default 4)")
    sp.set_defaults(func=cmd_monitor)

    sp = command("events", "what changes on the board, one line per event")
    sp.add_argument("--follow", "-f", action="store_true",
                    help="keep printing events as they happen (default: print the state and exit)")
    sp.add_argument("--json", action="store_true", help="JSON lines")
    sp.add_argument("--interval-s", type=float, default=0.1,
                    help="with --follow: how often to read the board (default 0.1)")
    sp.set_defaults(func=cmd_events)

    sp = command("exporter", "serve Prometheus metrics of the board over HTTP")
    sp.add_argument("--port", type=int, default=9645, help="TCP port (default 9645; 0: any free)")
    sp.add_argument("--addr", default="127.0.0.1",
                    help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    sp.set_defaults(func=cmd_exporter)


def _add_housekeeping(command: AddCommand) -> None:
    """The operator's commands: remove unused boards, install the units, clear a slot."""
    sp = command("gc", "remove boards that no live process uses", board=False)
    sp.add_argument("names", nargs="*", metavar="NAME",
                    help="only these boards (default: every board in /dev/shm)")
    sp.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    sp.set_defaults(func=cmd_gc)

    sp = command("units", "write systemd units (pinger, exporter) and their settings file")
    sp.add_argument("--out", default="shmhb-units", help="directory to write into (default ./shmhb-units)")
    sp.add_argument("--user", default=None,
                    help="account the services run as: the workers' (default: the current user)")
    sp.add_argument("--group", default=None, help="group (default: the user's primary group)")
    sp.add_argument("--env-path", default="/etc/default/shmhb",
                    help="where the units read their settings (default /etc/default/shmhb)")
    sp.add_argument("--exec", default=None, metavar="PATH",
                    help="the shmhb the units run: its console script, or a Python "
                         "interpreter that has it (default: the shmhb running this command)")
    sp.add_argument("--board-mode", default=None, metavar="MODE",
                    help="the board's mode for the pinger to set (e.g. 0660; default 0600)")
    sp.add_argument("--board-group", default=None, metavar="GROUP",
                    help="the board's group for the pinger to set (e.g. the Prometheus "
                         "account's group, with --board-mode 0660)")
    sp.set_defaults(func=cmd_units)

    sp = command("forget", "clear a dead or left slot, so probes recover after a crash")
    sp.add_argument("key", metavar="KEY", help="the key of the slot (see `shmhb status`)")
    sp.set_defaults(func=cmd_forget)


def check_args(args: argparse.Namespace) -> None:
    """Every flag through the same doors as the library's own arguments, before any
    command touches a board: ``InvalidConfig``/``InvalidName`` say which and why."""
    if getattr(args, "board", None) is not None:
        board_name(args.board)
    for name in getattr(args, "names", None) or ():
        board_name(name)
    for flag in ("interval_s", "tick_s"):
        v = getattr(args, flag, None)
        if v is not None:
            positive_seconds("--" + flag.replace("_", "-"), v)
    hz = getattr(args, "refresh_hz", None)
    if hz is not None and not (math.isfinite(hz) and hz > 0):
        raise InvalidConfig(f"--refresh-hz must be a positive number, got {hz}")
    port = getattr(args, "port", None)
    if port is not None and not 0 <= port <= 65535:
        raise InvalidConfig(f"--port must be in 0..65535 (0: any free port), got {port}")
    addr = getattr(args, "addr", None)
    if addr is not None:
        check_host(addr, what="--addr")
    if args.command == "pinger":
        PingerConfig(listen=args.listen, peers=tuple(args.peer), interval_s=args.interval_s,
                     secret_file=args.secret_file, curve_keys=args.curve_keys)
        from .boardopts import asked_policy, check_access_args, shared_gid
        asked_policy(args)
        check_access_args(args)
        if args.secret_file:  # before the board is created: a refused start leaves none
            from ..net.settings import read_secret
            read_secret(args.secret_file, shared_gid=shared_gid(args))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # a malformed command line: usage, exit 2
    level = logging.WARNING - 10 * min(args.verbose, 2)
    if args.command == "pinger":
        level = min(level, logging.INFO)
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        check_args(args)
        rc = int(args.func(args) or 0)
        sys.stdout.flush()  # inside the try: a closed pipe is found here, not at exit
        return rc
    except BrokenPipeError:
        return reader_gone()
    except ShmhbError as e:  # a refused input or board state: one line, no traceback
        print(f"shmhb: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
