"""The one door for every address shmhb accepts: endpoints, watches, ``--peer``, ``--listen``
and the settings read back from a board.

An address is ``host``, ``host:port`` or ``[v6]:port``.  A host is an IPv4 literal in
dotted-quad form, an IPv6 literal (in brackets when a port follows), or an RFC 1123
hostname: dot-separated labels of 1..63 characters from ``A-Z a-z 0-9 -``, none starting
or ending with ``-``, at most 253 characters, and not readable as a number (``1.2.3``,
``0x7f`` and ``123`` all resolve to IPv4 addresses in libc).  A port is ``1..65535``
written in decimal without a sign or leading zero.

What passes is exactly what libzmq's ``tcp://`` transport accepts and what this parser
reads back identically: ``str(parse_address(x)) == x`` for every canonical ``x`` (IPv6
literals are canonicalised to their compressed lower-case form, host names to lower
case: DNS names are case-insensitive, RFC 4343, and ``Node-A:30002`` and
``node-a:30002`` must be one endpoint to every table that matches endpoints by text).  The limits are the
board's and the wire's (``shmhb.board.layout``): an endpoint is at most ``MAX_ENDPOINT_BYTES`` (63) bytes, a
pinger address at most ``MAX_ADDRESS_TEXT`` bytes (what both a frame and a board row
hold).

Pure logic: no I/O, no name resolution.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from typing import Final, NamedTuple

from ..errors import InvalidAddress
from .layout import ADDR_BYTES, MAX_ADDRESS_BYTES, MAX_ENDPOINT_BYTES

#: The pinger port, one number for the whole cluster; ``--listen``/``--peer`` override it.
DEFAULT_PORT: Final = 45645
#: The longest pinger/watch address: what a frame's address field and a board row hold.
MAX_ADDRESS_TEXT: Final = min(MAX_ADDRESS_BYTES, ADDR_BYTES - 1)
MAX_HOSTNAME: Final = 253

_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?", re.ASCII)
_PORT = re.compile(r"[1-9][0-9]{0,4}", re.ASCII)
_RULES = ("use host:port, where host is an IPv4 address, [IPv6] in brackets, or a DNS "
          "name of letters, digits, '-' and '.'")


class Address(NamedTuple):
    """A validated address; ``str()`` gives its canonical text."""

    host: str
    port: int | None

    def __str__(self) -> str:
        return format_address(self.host, self.port)

    def with_port(self, port: int | None) -> Address:
        """The same host at ``port`` (None: without a port)."""
        return Address(self.host, port)


def format_address(host: str, port: int | None) -> str:
    """The canonical text of (host, port): IPv6 hosts in brackets, ``:port`` if any."""
    h = f"[{host}]" if ":" in host else host
    return h if port is None else f"{h}:{port}"


def _refuse(text: object, why: str, what: str) -> InvalidAddress:
    return InvalidAddress(f"invalid {what} {text!r}: {why}")


def check_host(host: str, *, what: str = "host", text: object = None) -> str:
    """``host`` in canonical form, or ``InvalidAddress`` saying why not."""
    shown = host if text is None else text
    if not host:
        raise _refuse(shown, f"no host; {_RULES}", what)
    if ":" in host:
        try:
            ip6 = ipaddress.IPv6Address(host)
        except ValueError:
            raise _refuse(shown, f"{host!r} is not an IPv6 address; {_RULES}", what) from None
        if ip6.scope_id:
            raise _refuse(shown, "IPv6 scope ids (%...) are not supported; "
                                 "use a global address or a name", what)
        return str(ip6)
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        pass
    if len(host) > MAX_HOSTNAME:
        raise _refuse(shown, f"a host name is at most {MAX_HOSTNAME} characters", what)
    labels = host.split(".")
    bad = next((lab for lab in labels if not _LABEL.fullmatch(lab)), None)
    if bad is not None:
        raise _refuse(shown, f"label {bad!r} is not 1-63 characters from A-Z a-z 0-9 '-' "
                             f"(not starting or ending with '-'); {_RULES}", what)
    big = [lab for lab in labels if lab.isdigit() and int(lab) > 255]
    if len(labels) == 4 and all(lab.isdigit() for lab in labels) and big:
        raise _refuse(shown, f"not an IPv4 address: {big[0]} is above 255 (a.b.c.d, each "
                             "0-255)", what)
    if labels[-1].isdigit() or _reads_as_ipv4(host):
        raise _refuse(shown, "it reads as a number, which the resolver turns into some other "
                             "IPv4 address; write the address as a.b.c.d", what)
    return host.lower()


def _reads_as_ipv4(host: str) -> bool:
    """libc's inet_aton (used by getaddrinfo) takes ``0x7f``, ``127.1`` or ``2130706433``."""
    try:
        socket.inet_aton(host)
    except OSError:
        return False
    return True


def parse_address(text: object, *, what: str = "address", need_port: bool = False,
                  default_port: int | None = None,
                  max_bytes: int = MAX_ADDRESS_TEXT) -> Address:
    """Validate ``text`` ("host", "host:port" or "[v6]:port") and return it parsed.

    ``need_port``: a port must be given.  ``default_port``: the port of an address given
    without one (else ``port`` is None).  ``max_bytes``: the longest canonical text
    accepted.  ``InvalidAddress`` (a ``ValueError``) names the rule broken."""
    if not isinstance(text, str):
        raise _refuse(text, "an address must be a str", what)
    if text.startswith("["):
        inner, sep, rest = text[1:].partition("]")
        if not sep or ":" not in inner:
            raise _refuse(text, "brackets hold an IPv6 address: [v6]:port", what)
        if rest and not rest.startswith(":"):
            raise _refuse(text, "only ':port' may follow ']'", what)
        host, port_s = inner, (rest[1:] if rest else None)
    elif text.count(":") == 1:
        host, port_s = text.split(":")
    elif ":" in text:
        host, port_s = text, None  # a bare IPv6 literal; check_host decides
    else:
        host, port_s = text, None
    host = check_host(host, what=what, text=text)
    port: int | None = None
    if port_s is not None:
        if not _PORT.fullmatch(port_s) or not 0 < int(port_s) < 65536:
            raise _refuse(text, "the port must be a number in 1..65535", what)
        port = int(port_s)
    elif need_port:
        raise _refuse(text, "no port; use host:port", what)
    else:
        port = default_port
    addr = Address(host, port)
    n = len(str(addr).encode())
    if n > max_bytes:
        raise _refuse(text, f"{n} bytes; the wire holds at most {max_bytes}", what)
    return addr


def check_endpoint(text: object) -> str:
    """A worker's endpoint ("host:port", at most ``MAX_ENDPOINT_BYTES`` bytes), canonical.

    A Kubernetes headless-service name is often longer than the wire holds; the message
    says to advertise the pod IP instead."""
    if isinstance(text, str) and len(text.encode(errors="replace")) > MAX_ENDPOINT_BYTES:
        raise InvalidAddress(
            f"endpoint {text!r} is {len(text.encode(errors='replace'))} bytes; the wire "
            f"limit is {MAX_ENDPOINT_BYTES} bytes: advertise the pod IP (e.g. "
            "10.1.2.3:30003) or a shorter name (e.g. the pod's hostname) instead")
    return str(parse_address(text, what="endpoint", need_port=True,
                             max_bytes=MAX_ENDPOINT_BYTES))


def is_canonical(text: str, *, need_port: bool = False,
                 max_bytes: int = MAX_ADDRESS_TEXT) -> bool:
    """Whether ``text`` passes the door unchanged: the test readers apply to what a
    board holds (it may have been written by an older, laxer version)."""
    try:
        return str(parse_address(text, need_port=need_port, max_bytes=max_bytes)) == text
    except InvalidAddress:
        return False


def canonical_or_none(text: str, *, need_port: bool = False,
                      max_bytes: int = MAX_ADDRESS_TEXT) -> str | None:
    """The canonical text of ``text``, or None if the door refuses it: how readers take
    what a board holds (an older version stored ``Node-A:1`` or ``[FD00:0::1]:1``)."""
    try:
        return str(parse_address(text, need_port=need_port, max_bytes=max_bytes))
    except InvalidAddress:
        return None


def is_endpoint(text: str) -> bool:
    return is_canonical(text, need_port=True, max_bytes=MAX_ENDPOINT_BYTES)
