"""What ``shmhb pinger`` sets on the board it opens: the policy it creates it with.

The daemon is the one place that sets a board's policy: under systemd and in the
DaemonSet it starts first and creates the board, so its flags (carried by the units'
settings file and the DaemonSet's args) decide how every reader judges.  A policy is
fixed when a board is created (readers take their thresholds from the header once, at
attach), so a pinger whose flags ask for another policy than an existing board holds
refuses to start, naming both, rather than run under a policy nobody asked for.  A
library caller's ``Board.open(policy=...)`` on an existing board logs a warning naming
both instead (``Board.warn_policy``): a worker is not where operators set timeouts, and
it must not die of it.
"""

from __future__ import annotations

import argparse

from .board import Board
from .config import Policy

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


def open_board(args: argparse.Namespace) -> Board:
    """Open (or create) the pinger's board as its flags say; ``PolicyMismatch`` if it
    exists with another policy than the flags ask for."""
    return Board.open(args.board, policy=asked_policy(args), strict_policy=True)
