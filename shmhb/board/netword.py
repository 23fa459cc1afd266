"""The net_state word's vocabulary and its reading: what the agent role holder's network
half records in the board header (``layout.pack_net_state``), and what a reader of the
board (``Board.network()``, ``shmhb status``) makes of it.

Part of the board, not of the network half: a reader decodes the word without importing
the pinger (``shmhb.net.state``, which writes it, builds on this module).
"""

from __future__ import annotations

import enum

from .layout import inc_tag, net_cfg_gen, net_checksum, unpack_net_state, word_tag
from ..status import NetworkStatus


class NetState(enum.IntEnum):
    """Codes stored in the net_state word (0: never written, e.g. an older holder)."""

    NONE = 0
    OFF = 1
    STARTING = 2
    LISTENING = 3
    DEGRADED = 4

    @property
    def label(self) -> str:
        return "not configured" if self is NetState.OFF else self.name.lower()


class NetReason(enum.IntEnum):
    """Why the network half is degraded (stored in the net_state word)."""

    NONE = 0
    BIND = 1  # cannot listen: address in use, not local, invalid
    SECRET = 2  # the secret file is unreadable, too short or readable by others
    CURVE = 3  # CURVE keys missing or unreadable (this host's secret key)
    CONFIG = 4  # the stored settings are invalid
    ERROR = 5  # an unexpected error stopped the network half
    HOST_KEY = 6  # followed hosts skipped: no public key for them
    ADDRESS = 7  # followed hosts skipped: an address that cannot be connected to
    FDS = 8  # out of file descriptors (EMFILE/ENFILE)

    @property
    def label(self) -> str:
        return self.name.lower()


class NetAuth(enum.IntEnum):
    NONE = 0
    HMAC = 1
    CURVE = 2

    @property
    def label(self) -> str:
        return self.name.lower()


def working(state: NetState) -> bool:
    """Whether a network half in ``state`` counts as working for ``shmhb status``:
    ``off`` (not configured) and the brief ``starting`` do; ``degraded`` does not.
    NONE (an older holder that never wrote the word) is given the benefit of the doubt."""
    return state is not NetState.DEGRADED


def decode_network(head: object, agent_term: int, agent_running: bool) -> NetworkStatus:
    """The network half as recorded in a copy of the board header (``head``, a record of
    ``layout.HEADER_DTYPE``), by the holder of term ``agent_term``.

    The state word alone decides ``working``: it is one aligned word, written last of a
    change's words (before the checksum), so no ordering between words is relied on.
    The details (address, error text, settings generation) are shown only when their
    checksum, which covers the state word too, matches: otherwise they were caught
    mid-write and are left out, never mixed with another state's."""
    h = head  # numpy record; typed loosely to keep this module free of numpy
    word = int(h["net_state"])  # type: ignore[index]
    f = unpack_net_state(word)
    term, listening, reason = f.term, f.listening, f.reason
    try:
        state = NetState(f.state)
    except ValueError:
        state = NetState.NONE
    if int(h["cfg_gen"]) == 0 and (not agent_running or state in (NetState.NONE, NetState.OFF)):  # type: ignore[index]
        # No pinger settings were ever stored: there is no network half whoever holds
        # the role, or whether anyone does (docs/PINGER.md: "network not configured").
        return NetworkStatus(NetState.OFF.label, True, False, None, "none", None, 0, None, 0,
                             None, agent_term)
    if not agent_running or word == 0 or term != inc_tag(agent_term) or state is NetState.NONE:
        # No running holder, or one that has not written its state yet: nothing is
        # claimed either way (``status`` reports a missing agent on its own).
        return NetworkStatus("unknown", True, False, None, "none", None, 0, None, 0,
                             None, agent_term)
    gen_word = int(h["net_gen"])  # type: ignore[index]
    listen_b = bytes(h["net_listen"]).rstrip(b"\0")  # type: ignore[index]
    error_b = bytes(h["net_error"]).rstrip(b"\0")  # type: ignore[index]
    ok = int(h["net_ck"]) == net_checksum(word, gen_word, listen_b, error_b)  # type: ignore[index]
    listen = listen_b.decode(errors="replace") if ok and listen_b and listening else None
    error = error_b.decode(errors="replace") if ok and error_b else None
    gen = net_cfg_gen(gen_word) if ok and word_tag(gen_word) == term else None
    try:
        why: str | None = NetReason(reason).label if reason else None
    except ValueError:
        why = f"code {reason}"
    try:
        auth_s = NetAuth(f.auth).label
    except ValueError:
        auth_s = f"code {f.auth}"
    return NetworkStatus(state.label, working(state), listening, listen, auth_s, why, f.errno,
                         error, f.skipped, gen, agent_term)
