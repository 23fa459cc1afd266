"""The pinger's settings: stored in the board, read back by any holder of the role.

``shmhb pinger`` writes them (under the registry lock) so that whoever holds the agent
role -- the daemon, or a worker after the daemon died -- runs the same network half.
Secrets and CURVE keys are read here, at the door: a secret file readable by group or
others is refused (as ssh refuses such a key), and so is one too short.
"""

from __future__ import annotations

import dataclasses
import os
import stat

import numpy as np

from ..board.handle import Board
from ..board.core import board_words
from ..board.registrylock import bump_reg_gen
from ..board.config import PingerConfig, has_port
from ..errors import InvalidConfig
from ..board.layout import checksum
from .protocol import Secrets

# -- settings stored in the board ---------------------------------------------------------

def _cfg_checksum(h: np.ndarray) -> int:
    return checksum(int(h["cfg_gen"]), bytes(h["cfg_listen"]), bytes(h["cfg_secret_path"]),
                    bytes(h["cfg_curve_dir"]), int(h["cfg_interval_ns"]),
                    int(h["cfg_budget_mpps"]))


def store_config(board: Board, cfg: PingerConfig) -> None:
    """Write the pinger settings into the board, replacing the configured peer list.
    Under the registry lock; the agent applies them at its next tick."""
    with board_words(board).registry():
        h = board_words(board).header
        h["cfg_checksum"] = 0
        h["cfg_gen"] = int(h["cfg_gen"]) + 1
        h["cfg_listen"] = (cfg.listen or "").encode()
        h["cfg_secret_path"] = (cfg.secret_file or "").encode()
        h["cfg_curve_dir"] = (cfg.curve_keys or "").encode()
        h["cfg_interval_ns"] = int(cfg.interval_s * 1e9)
        h["cfg_budget_mpps"] = max(1, round(cfg.ping_budget_pps * 1000))
        h["cfg_checksum"] = _cfg_checksum(h)
        w = board_words(board).watch_table
        for i in np.flatnonzero((w["checksum"] != 0) & (w["owner_pid"] == 0)):
            w[int(i)]["checksum"] = 0
        bump_reg_gen(h)
    for p in cfg.peers:  # "host" (the cluster's port) or "host:port"
        board_words(board).watches.change_watch(p, +1, owner_pid=0, keep_port=has_port(p))


def load_config(board: Board) -> tuple[int, PingerConfig] | None:
    """(generation, settings) stored in the board, or None if none were ever stored or
    the copy read was caught mid-write (try again next tick).  ``InvalidConfig`` if the
    stored settings are not valid."""
    h = board_words(board).header.copy()
    gen, ck = int(h["cfg_gen"]), int(h["cfg_checksum"])
    if gen == 0 or ck != _cfg_checksum(h):
        return None

    def text(f: str) -> str | None:
        return bytes(h[f]).rstrip(b"\0").decode(errors="replace") or None

    return gen, PingerConfig(listen=text("cfg_listen"), interval_s=int(h["cfg_interval_ns"]) / 1e9,
                             secret_file=text("cfg_secret_path"), curve_keys=text("cfg_curve_dir"),
                             ping_budget_pps=int(h["cfg_budget_mpps"]) / 1000)


def stored_settings(board: Board) -> PingerConfig | None:
    """The pinger settings stored in the board, its configured peers included; None if
    none were ever stored, or they cannot be read whole (torn, or invalid)."""
    try:
        got = load_config(board)
    except InvalidConfig:
        return None
    if got is None:
        return None
    return dataclasses.replace(got[1], peers=tuple(board_words(board).watches.configured_peers()))


def settings_differences(have: PingerConfig, want: PingerConfig) -> list[str]:
    """What differs between the stored pinger settings ``have`` and those asked for,
    as ``"listen: board 10.0.0.1:45645, asked 10.0.0.1:45646"`` lines (empty: the same,
    as the board stores them)."""
    def auth(c: PingerConfig) -> str:
        return (f"secret file {c.secret_file}" if c.secret_file else
                f"CURVE keys in {c.curve_keys}" if c.curve_keys else "none")

    pairs = [("listen", have.listen or "none", want.listen or "none"),
             ("authentication", auth(have), auth(want)),
             ("peers", " ".join(sorted(have.peers)) or "none", " ".join(sorted(want.peers)) or "none"),
             ("interval_s", round(have.interval_s * 1e9), round(want.interval_s * 1e9)),
             ("ping_budget_pps", max(1, round(have.ping_budget_pps * 1000)),
              max(1, round(want.ping_budget_pps * 1000)))]
    out = []
    for name, a, b in pairs:
        if a != b:
            if isinstance(a, int) and isinstance(b, int):  # stored as ns / milli-pings
                scale = 1e9 if name == "interval_s" else 1000
                a_s, b_s = format(a / scale, "g"), format(b / scale, "g")
            else:
                a_s, b_s = str(a), str(b)
            out.append(f"{name}: board {a_s}, asked {b_s}")
    return out


def drops_authentication(have: PingerConfig, want: PingerConfig) -> bool:
    """Whether ``want`` runs without the authentication ``have`` has."""
    return bool(have.secret_file or have.curve_keys) and not (want.secret_file or want.curve_keys)


def board_group(board: Board) -> int | None:
    """The group ``board`` is shared with (its file's gid where the group may read and
    write it, ``shmhb pinger --board-mode 0660 --board-group G``), else None."""
    fd = board_words(board).new_fd()
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    return st.st_gid if st.st_mode & 0o060 == 0o060 else None


def read_secret(path: str, *, shared_gid: int | None = None) -> Secrets:
    """The shared secrets in ``path``: one, or two on two lines (the first signs, both
    are accepted: a rotation, docs/OPERATIONS.md).  ``InvalidConfig`` (saying what to
    do) if the file cannot be read, is readable or writable by group or others, holds
    more than two lines, or a secret of fewer than 16 bytes.  The caller must never
    fall back to running without it.

    ``shared_gid``: the group a board is shared with (``board_group``).  Its members'
    workers may hold the agent role, network half included, so a secret readable by
    that group alone (mode 0640, that group) is accepted: it reaches no one who could
    not already write the board."""
    way = ("give it the board's group, readable by it alone (`chgrp GROUP FILE; chmod 640 "
           "FILE`), so that a worker of another account that holds the agent role can read "
           "it" if shared_gid is not None else "run the pinger as the file's owner")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise InvalidConfig(f"cannot read the secret file {path!r} as uid {os.geteuid()}: "
                            f"{e.strerror}; {way}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidConfig(f"the secret file {path!r} is not a regular file")
        group_ok = shared_gid is not None and st.st_gid == shared_gid
        if st.st_mode & (0o037 if group_ok else 0o077):
            raise InvalidConfig(
                f"run `chmod {640 if group_ok else 600} {path}`: the secret file is "
                f"accessible by {'others, or writable by its group' if group_ok else 'group or others'} "
                f"(mode {stat.S_IMODE(st.st_mode):04o}, group {st.st_gid}"
                + ("" if shared_gid is None or group_ok else
                   f"; a board shared with group {shared_gid} accepts mode 0640 for that group")
                + ")")
        with os.fdopen(fd, "rb", closefd=False) as f:
            secret = f.read(4097).strip()
    except OSError as e:
        raise InvalidConfig(f"cannot read the secret file {path!r}: {e.strerror}") from None
    finally:
        os.close(fd)
    if len(secret) > 4096:
        raise InvalidConfig(f"the secret in {path!r} is longer than 4096 bytes")
    lines = [line.strip() for line in secret.split(b"\n")]
    if len(lines) > 2:
        raise InvalidConfig(f"the secret file {path!r} holds {len(lines)} lines: one secret, "
                            "or two during a rotation (the first signs, both are accepted)")
    if any(len(line) < 16 for line in lines):
        raise InvalidConfig(f"a secret in {path!r} is shorter than 16 bytes (one secret per "
                            "line, as text); use e.g. "
                            "`head -c 32 /dev/urandom | base64 > FILE; chmod 600 FILE`")
    return Secrets(lines[0], lines[1] if len(lines) == 2 else None)


def curve_keypair(keys_dir: str, host: str) -> tuple[bytes, bytes]:
    """(public, secret) CURVE key of ``host`` from ``keys_dir/<host>.key_secret``;
    ``InvalidConfig`` if missing or unreadable."""
    import zmq.auth

    path = os.path.join(keys_dir, f"{host}.key_secret")
    try:
        pub, sec = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise InvalidConfig(f"cannot read this host's CURVE secret key {path!r} ({e}); "
                            "create it with zmq.auth.create_certificates") from None
    if sec is None:
        raise InvalidConfig(f"{path!r} holds no secret key")
    return pub, sec


def curve_public_key(keys_dir: str, host: str) -> bytes:
    """The CURVE public key of ``host`` (``keys_dir/<host>.key``); ``InvalidConfig`` if
    missing or unreadable."""
    import zmq.auth

    path = os.path.join(keys_dir, f"{host}.key")
    try:
        pub, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise InvalidConfig(f"no CURVE public key for host {host!r} ({path!r}: {e}); copy "
                            "that host's .key file there") from None
    return pub
