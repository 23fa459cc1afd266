"""What goes into a board's rows and comes back out: the doors for keys and endpoints
at registration, and the check of what a reader finds (an earlier, laxer version may
have stored what today's doors refuse: skipped, with a rate-limited warning).

Pure logic; the memoised checks make a hot read pay one hash of the raw bytes.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from typing import NamedTuple

from .address import canonical_or_none
from .config import check_endpoint
from ..errors import InvalidKey
from .layout import (
    ENDPOINTS_BYTES, KEY_BYTES, MAX_ENDPOINT_BYTES, MAX_ENDPOINTS, MAX_KEY_BYTES, encode_endpoints,
)
from ..ratelog import RateLimitedLog

log = logging.getLogger(__name__)

RETRIES = 8  # re-reads of a row caught mid-write before giving up on it for now


class SlotInfo(NamedTuple):
    """The validated record of a slot (``LocalReads.read_slot``)."""

    key: str
    pid: int
    incarnation: int
    endpoints: tuple[str, ...]

#: rows that today's doors refuse (written by an older version, or damaged): skipped
skipped = RateLimitedLog(log)


def shown(text: str) -> str:
    """``text`` as it may reach a terminal, a log line or a Prometheus label: every
    character ``str.isprintable`` refuses (C0/C1 controls such as CSI U+009B and NEL
    U+0085, bidi overrides such as U+202E, line separators, unassigned code points) is
    written as a ``\\uXXXX`` escape, so no key or address can move the cursor, reorder
    a line or forge a line of its own.  The doors already refuse such text; this is
    for whatever slipped in anyway (an older version's row)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else f"\\u{ord(c):04x}" for c in text)


def check_key(key: object) -> bytes:
    """``key`` encoded, or ``InvalidKey``: 1..63 UTF-8 bytes (the wire's
    ``MAX_KEY_BYTES``, what a slot holds), every character printable
    (``str.isprintable``: no NUL, no C0 or C1 controls such as U+0085 NEL or U+009B CSI,
    no format characters such as the bidi override U+202E, no line separators, no
    spaces but U+0020): a key reaches terminals, logs and Prometheus labels."""
    if not isinstance(key, str) or not key:
        raise InvalidKey(f"a key must be a non-empty str, got {key!r}")
    try:
        kb = key.encode()
    except UnicodeEncodeError:
        raise InvalidKey(f"key {key!r} is not valid Unicode text: use UTF-8 text") from None
    if len(kb) > MAX_KEY_BYTES or len(kb) >= KEY_BYTES:
        raise InvalidKey(f"key {key!r} is {len(kb)} bytes; the wire limit is "
                         f"{MAX_KEY_BYTES}: choose a shorter key")
    if not key.isprintable():
        raise InvalidKey(f"key {shown(key)!r} contains control, format or separator "
                         "characters (C0/C1 controls, bidi overrides, ...): use printable text")
    return kb


def stored_text(raw: bytes) -> str | None:
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return None


@functools.lru_cache(maxsize=1 << 12)
def _valid_key(raw: bytes) -> str | None:
    text = stored_text(raw)
    try:
        check_key(text)
    except InvalidKey:
        return None
    return text


@functools.lru_cache(maxsize=1 << 12)
def _valid_endpoints(raw: bytes) -> tuple[tuple[str, ...], bool]:
    """(the endpoints today's door accepts, whether some were refused); memoised, so a
    hot read pays one hash of the raw bytes."""
    text = stored_text(raw)
    eps = tuple(text.split(",")) if text else ()
    canon = (canonical_or_none(e, need_port=True, max_bytes=MAX_ENDPOINT_BYTES) for e in eps)
    good = tuple(e for e in canon if e is not None)
    return good, text is None or len(good) != len(eps)


def stored_key(raw: bytes, table: str, row: int) -> str | None:
    """A key read back from row ``row`` of ``table``, or None (logged) if today's door
    refuses it."""
    key = _valid_key(raw)
    if key is None:
        skipped.warn("key", "skipping %s %d: its key %r is not valid (written by an older "
                     "shmhb?)", table, row, raw)
    return key


def stored_endpoints(raw: bytes, table: str, row: int) -> tuple[str, ...]:
    """Endpoints read back from the board, without those today's door refuses (logged):
    the worker itself still counts, only the bad endpoint is not served."""
    good, refused = _valid_endpoints(raw)
    if refused:
        skipped.warn("endpoint", "%s %d: skipping endpoint(s) in %r: not valid (written by "
                     "an older shmhb?); re-register the worker with host:port endpoints of "
                     "at most 63 bytes", table, row, raw)
    return good


def check_registration(key: str, endpoints: Iterable[str]) -> tuple[bytes, bytes, tuple[str, ...]]:
    kb = check_key(key)
    eps = (endpoints,) if isinstance(endpoints, str) else tuple(endpoints)
    if len(eps) > MAX_ENDPOINTS:
        raise InvalidKey(f"at most {MAX_ENDPOINTS} endpoints per slot, got {len(eps)}")
    eps = tuple(check_endpoint(e) for e in eps)
    eb = encode_endpoints(eps)
    if len(eb) >= ENDPOINTS_BYTES:
        raise InvalidKey(f"endpoints take {len(eb)} bytes; at most {ENDPOINTS_BYTES - 1}")
    return kb, eb, eps


def stored_address(raw: bytes, table: str, row: int) -> str | None:
    """A watch or peer address read back from the board, or None (logged) if today's
    door refuses it."""
    text = _valid_address(raw)
    if text is None:
        skipped.warn("address", "skipping %s %d: address %r is not valid (written by an "
                     "older shmhb?); unwatch it, or remove the board when idle (`shmhb gc`)",
                     table, row, raw)
    return text


@functools.lru_cache(maxsize=1 << 12)
def _valid_address(raw: bytes) -> str | None:
    text = stored_text(raw)
    return None if text is None else canonical_or_none(text)
