"""The ``shmhb`` command: status, pinger, demo.  The only place that sets up logging."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from collections.abc import Sequence

from . import __version__
from .board import Board
from .config import BOARD_ENV, DEFAULT_BOARD, board_name
from .errors import ShmhbError
from .status import Status

log = logging.getLogger(__name__)

HEALTHY = (Status.ALIVE, Status.LEFT)


def _status_doc(board: Board) -> dict[str, object]:
    agent = board.agent()
    return {
        "board": board.name,
        "slots": [s.to_json() for s in sorted(board.slots(), key=lambda s: s.key)],
        "pinger": {**agent.to_json(), "held": board.agent_held(),
                   "lateness_ms": board.lateness_ms(), "stats": board.stats()},
        "peers": [p.to_json() for p in board.peers()],
        "policy": {
            "suspect_after_s": board.policy.suspect_after_s,
            "dead_after_s": board.policy.dead_after_s,
            "peer_suspect_after_s": board.policy.peer_suspect_after_s,
            "peer_dead_after_s": board.policy.peer_dead_after_s,
        },
    }


def _print_table(doc: dict[str, object]) -> None:
    p = doc["pinger"]
    assert isinstance(p, dict)
    print(f"board {doc['board']}   agent pid {p['pid'] or '-'}: {p['status']}")
    rows = [("KEY", "STATUS", "PID", "INC", "AGE_S", "ENDPOINTS")]
    for s in doc["slots"]:  # type: ignore[attr-defined]
        rows.append((s["key"], s["status"], str(s["pid"]), str(s["incarnation"]),
                     f"{s['age_s']:.3f}", ",".join(s["endpoints"])))
    for peer in doc["peers"]:  # type: ignore[attr-defined]
        rtt = "-" if peer["rtt_ms"] is None else f"{peer['rtt_ms']:.2f}ms"
        age = "-" if peer["age_s"] is None else f"{peer['age_s']:.3f}"
        rows.append((f"@{peer['address']}", peer["status"], "", "", age, f"rtt {rtt}"))
        for s in peer["slots"]:
            rows.append((f"  {s['key']}", s["status"], str(s["pid"]), str(s["incarnation"]),
                         f"{s['age_s']:.3f}", ",".join(s["endpoints"])))
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def cmd_status(args: argparse.Namespace) -> int:
    with Board.attach(args.board) as board:
        doc = _status_doc(board)
    if args.json:
        json.dump(doc, sys.stdout, indent=2)
        print()
    else:
        _print_table(doc)
    slots = doc["slots"]
    assert isinstance(slots, list)
    return 0 if all(Status(s["status"]) in HEALTHY for s in slots) else 1


def cmd_pinger(args: argparse.Namespace) -> int:
    from .agent import Agent
    from .config import AgentConfig

    Board.open(args.board).close()
    network = False
    if getattr(args, "listen", None) is not None or getattr(args, "peer", None):
        from .pinger import configure_from_args
        network = configure_from_args(args)
    agent = Agent(board_name(args.board), config=AgentConfig(tick_s=args.tick_s), network=network)
    stop = threading.Event()

    def _stop(signum: int, _frame: object) -> None:
        log.info("signal %d: stopping", signum)
        stop.set()
        agent.stop(timeout_s=0)

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    agent.start()
    log.info("pinger for board %s started (pid %d); waiting for the agent role",
             board_name(args.board), __import__("os").getpid())
    while not stop.wait(0.5):
        if agent._thread is not None and not agent._thread.is_alive():
            log.error("the agent loop ended unexpectedly")
            return 1
    agent.stop()
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo
    return run_demo(quick=args.quick)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shmhb", description="Shared-memory liveness board.")
    p.add_argument("--version", action="version", version=f"shmhb {__version__}")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    sub = p.add_subparsers(dest="command", required=True)

    def board_arg(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--board", default=None,
                        help=f"board name (default: ${BOARD_ENV} or {DEFAULT_BOARD!r})")

    sp = sub.add_parser("status", help="show the board; exit 1 if a local slot is not healthy")
    board_arg(sp)
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp.set_defaults(func=cmd_status)

    sp = sub.add_parser("pinger", help="hold the host agent role in the foreground")
    board_arg(sp)
    sp.add_argument("--tick-s", type=float, default=0.05, help="agent loop period (default 0.05)")
    sp.set_defaults(func=cmd_pinger)
    try:
        from .pinger import add_pinger_args
        add_pinger_args(sp)
    except ImportError:
        pass

    sp = sub.add_parser("demo", help="a self-contained tour: kill, hang and restart workers")
    sp.add_argument("--quick", action="store_true", help="shorter timeouts (for tests)")
    sp.set_defaults(func=cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    if args.command == "pinger":
        level = min(level, logging.INFO)
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return int(args.func(args) or 0)
    except ShmhbError as e:
        print(f"shmhb: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
