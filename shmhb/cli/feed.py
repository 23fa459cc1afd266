"""``shmhb feed`` and ``shmhb instances``: the command-line side of ``shmhb.cli.feeder`` and
``shmhb.board.instances`` (``shmhb.cli.main`` adds these subcommands with ``add_parsers``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import threading
from typing import Any

from ..board.handle import Board
from ..clock import MONOTONIC
from ..board.config import board_name
from ..errors import InvalidConfig
from .feeder import Action, Feeder, FeederConfig
from ..board.instances import Instance, board_instances, register_drain
from .routerapi import KINDS, RouterClient, client_for
from .stopsignal import stop_on_signals
from ..status import Status

log = logging.getLogger(__name__)


def add_parsers(sub: Any) -> None:
    sp = sub.add_parser(
        "feed", help="keep a router's worker list equal to the live instances on the board(s)",
        description="Follow the board(s) and keep each --router's worker list equal to the "
                    "live P/D instances (docs/ROUTERS.md).")
    sp.add_argument("--router", action="append", required=True, metavar="KIND=URL",
                    help=f"a router to feed: KIND is one of {sorted(KINDS)}, URL its "
                         "http://host:port (repeatable)")
    sp.add_argument("--board", dest="boards", action="append", default=None, metavar="NAME",
                    help="a board to follow (repeatable; default: $SHMHB_BOARD or 'shmhb'); "
                         "the hosts its pinger follows are included")
    sp.add_argument("--no-remote", action="store_true",
                    help="only the boards' own instances, not those of the hosts they follow")
    sp.add_argument("--act-on-suspect", action=argparse.BooleanOptionalAction, default=None,
                    help="take an instance that reads suspect out of rotation (it comes back "
                         "when it reads alive); default: yes for a router that takes a worker "
                         "back over HTTP (sglang, smg), no for vllm-router's PD mode")
    sp.add_argument("--poll-ms", type=float, default=2.0,
                    help="how often to look at the boards' change counters (default 2)")
    sp.add_argument("--resync-s", type=float, default=2.0,
                    help="how often to list each router's workers anew (default 2)")
    sp.add_argument("--json", action="store_true",
                    help="print each call the router accepted as a JSON line on stdout")
    sp.set_defaults(func=cmd_feed)

    sp = sub.add_parser(
        "drain", help="drain an instance: fed routers stop sending it new requests",
        description="Mark an instance of this host's board draining (routers fed by shmhb "
                    "take it out of rotation at once) until it leaves, the timeout passes, "
                    "or this command is stopped (then the drain ends and it is put back).")
    sp.add_argument("instance", help="the instance's key (inst/...) or engine id")
    sp.add_argument("--board", default=None, metavar="NAME")
    sp.add_argument("--timeout-s", type=float, default=600.0,
                    help="end the drain after this long if the instance has not left (600)")
    sp.set_defaults(func=cmd_drain)

    sp = sub.add_parser("instances", help="the P/D instances on the board, as JSON",
                        description="Print the P/D instances the board(s) know, with their "
                                    "status, roles and addresses, as one JSON document "
                                    "(docs/ROUTERS.md, \"What the board knows\").")
    sp.add_argument("--board", dest="boards", action="append", default=None, metavar="NAME",
                    help="a board to read (repeatable; default: $SHMHB_BOARD or 'shmhb'); "
                         "the hosts its pinger follows are included")
    sp.add_argument("--no-remote", action="store_true",
                    help="only the boards' own instances, not those of the hosts they follow")
    sp.set_defaults(func=cmd_instances)


def parse_router(text: str) -> RouterClient:
    kind, sep, url = text.partition("=")
    if not sep:
        raise InvalidConfig(f"--router takes KIND=URL (e.g. vllm=http://127.0.0.1:30000), got {text!r}")
    return client_for(kind, url)


def open_boards(names: list[str] | None) -> list[Board]:
    return [Board.attach(board_name(n)) for n in (names or [None])]  # type: ignore[list-item]


def reader(boards: list[Board], remote: bool) -> tuple[Any, Any]:
    """(read, changes) over ``boards``: with several boards, local instances are labelled
    with their board's name."""
    label = len(boards) > 1

    def read() -> list[Instance]:
        out: list[Instance] = []
        for b in boards:
            for i in board_instances(b, remote=remote):
                out.append(dataclasses.replace(i, host=b.name) if label and not i.host else i)
        return out

    def changes() -> int:
        return sum(b.changes() for b in boards)
    return read, changes


def cmd_instances(args: argparse.Namespace) -> int:
    read, _ = reader(open_boards(args.boards), not args.no_remote)
    from .instview import SCHEMA
    print(json.dumps({"schema": SCHEMA, "instances": [i.to_json() for i in read()]}, indent=2))
    return 0


def find_instance(insts: list[Instance], name: str) -> Instance:
    """The instance whose key or engine id is ``name`` (``InvalidConfig`` if none, or more
    than one)."""
    got = [i for i in insts if name in (i.key, i.engine)]
    if len(got) != 1:
        raise InvalidConfig(f"{'no' if not got else 'more than one'} instance on this board "
                            f"has key or engine id {name!r} (see `shmhb instances --no-remote`)")
    return got[0]


def cmd_drain(args: argparse.Namespace) -> int:
    if isinstance(args.timeout_s, bool) or not 0 < args.timeout_s <= 86400:
        raise InvalidConfig(f"--timeout-s is in (0, 86400], got {args.timeout_s!r}")
    board = Board.attach(board_name(args.board))  # type: ignore[arg-type]
    inst = find_instance(board_instances(board, remote=False), args.instance)
    hb = register_drain(board, inst.key)
    done = threading.Event()
    stop_on_signals(done)  # never done.set() in a handler: see shmhb.cli.stopsignal
    deadline = MONOTONIC.monotonic_ns() + int(args.timeout_s * 1e9)
    print(json.dumps({"event": "draining", "key": inst.key}), flush=True)
    why = "stopped"
    try:
        while not done.wait(0.05):
            now = [i for i in board_instances(board, remote=False) if i.key == inst.key]
            if not now or now[0].incarnation != inst.incarnation or now[0].status in (
                    Status.LEFT, Status.DEAD):
                why = "left"
                break
            if MONOTONIC.monotonic_ns() > deadline:
                why = "timeout"
                break
    finally:
        hb.close()
    print(json.dumps({"event": "drain_ended", "key": inst.key, "why": why}), flush=True)
    return 0 if why == "left" else 1


def cmd_feed(args: argparse.Namespace) -> int:
    clients = [parse_router(r) for r in args.router]
    cfg = FeederConfig(poll_s=args.poll_ms / 1000, resync_s=args.resync_s,
                       act_on_suspect=args.act_on_suspect)
    boards = open_boards(args.boards)
    read, changes = reader(boards, not args.no_remote)
    out_lock = threading.Lock()

    def emit(doc: dict[str, Any]) -> None:
        if args.json:
            with out_lock:
                sys.stdout.write(json.dumps(doc) + "\n")
                sys.stdout.flush()

    feeders = []
    for c in clients:
        def on_action(a: Action, t_ns: int, c: RouterClient = c) -> None:
            emit({"event": a.op, "router": c.base, "url": a.url, "role": a.role,
                  "why": a.why, "t_ns": t_ns})
        feeders.append(Feeder(read, changes, c, cfg, MONOTONIC, on_action).start())
    done = threading.Event()
    stop_on_signals(done)  # never done.set() in a handler: see shmhb.cli.stopsignal
    emit({"event": "ready", "routers": [c.base for c in clients],
          "boards": [b.name for b in boards], "t_ns": MONOTONIC.monotonic_ns()})
    log.info("shmhb feed: following %s for %s", [b.name for b in boards], [c.base for c in clients])
    try:
        done.wait()
    finally:
        for f in feeders:
            f.stop()
    return 0
