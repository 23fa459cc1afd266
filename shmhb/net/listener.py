"""The pinger's listening socket, made so that the next holder of the agent role can
listen beside a holder that is stopped as a whole.

**The problem.**  A holder stopped as a whole (SIGSTOP, a frozen container) keeps its
lock byte and its listening socket; a standby takes the role over after the stall bound
(``shmhb.agent.election``).  Had the new holder no way to listen on the host's address
until the stopped one resumed, every host that follows this one would hear nothing:
its pings go to a process that does not run, and it reads this host and all its live
workers DEAD for as long as the stop lasts.  The new holder must be heard.

**The design: share the port, steer new connections to the newest listener.**

* Every listener is made here, with ``SO_REUSEPORT``, and handed to libzmq
  (``ZMQ_USE_FD``).  So a successor can bind the same address while the stopped holder
  still has it: the kernel puts both sockets in one reuseport group.
* In a plain reuseport group the kernel hashes each new connection to one of the
  sockets; the stopped holder's share (half, with two) would be swallowed: the
  kernel completes the TCP handshake on its behalf and queues the connection where
  nobody accepts it.  So the successor attaches a classic BPF program to the group
  (``SO_ATTACH_REUSEPORT_CBPF``, no privilege needed) that returns its own index in
  the group: every new connection goes to it.  A socket joins at the end of the
  group's array, so its index is the number of listeners on the address once it
  listens, less one.  Should the stopped holder close first (it resumed and stood
  down), the kernel moves the last socket into the freed place; the program's index
  then lies past the end, and the kernel falls back to its hash, over the sockets
  left -- ours alone, or ours and another stopped one (two holders stopped in a row:
  then half the new connections may still be lost until it resumes).
* A follower's existing connection to the stopped holder stays open (the kernel keeps
  it up); the follower's client socket drops it through ZMTP heartbeats, which a
  stopped process does not answer, and a new connection that landed in the stopped
  holder's queue before the successor listened is dropped by the client's handshake
  timeout (``shmhb.net.transport``).  Each reconnect after the successor listens
  reaches it.
* **No stranger joins.**  The kernel lets only sockets of the same effective uid share
  a port, and this module lets a socket join a group only when the caller says that the
  listener there is a stalled holder of the same board, replaced now (``beside``: the
  agent read from the board's words of the replaced term that it listened on this very
  address, and checked with ``listens_there`` that the process named there holds a
  listener on it -- a word of the board alone is not trusted to name another board's
  pinger for us to take connections from).  Where that process cannot be seen (another
  pid namespace, or uid), the successor does not join: the old behaviour below.
  Any other listener on the address makes ``open_listener`` fail with
  EADDRINUSE, as a plain bind would: a probe socket without ``SO_REUSEPORT`` is bound
  first (it conflicts with every listener, wildcard ones included); and since two
  processes may pass the probe at once, the listeners on the address are counted
  again once ours listens: more than ours, unless allowed, is EADDRINUSE too.
* Where the address is not a numeric IP (an interface name, ``*``), libzmq binds it
  itself, without sharing: such a host keeps the old behaviour (the successor reads
  degraded, and retries, until the stopped holder resumes).  So does a host whose
  holders run as different uids (the kernel refuses to share): EADDRINUSE, degraded.
"""

from __future__ import annotations

import ctypes
import errno
import ipaddress
import os
import socket
import struct

__all__ = ["listeners_on", "listens_there", "numeric_ip", "open_listener"]

#: linux/asm-generic/socket.h; Python's socket module does not name it
SO_ATTACH_REUSEPORT_CBPF = 51
#: the accept backlog libzmq uses for its own listeners
BACKLOG = 100
_BPF_RET_K = 6  # BPF_RET (0x06) | BPF_K (0): return the constant k


def numeric_ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``host`` as an IP address, None if it is not a numeric one."""
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def _proc_hex(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int) -> str:
    """How /proc/net/tcp{,6} writes ``ip:port`` as a local address: the address as
    32-bit words in the host's byte order, each in hex, then the port."""
    raw = ip.packed
    words = struct.unpack("=" + "I" * (len(raw) // 4), raw)
    return "".join(f"{w:08X}" for w in words) + f":{port:04X}"


def _listening_inodes(ip: ipaddress.IPv4Address | ipaddress.IPv6Address,
                      port: int) -> list[str] | None:
    """The inodes of the TCP sockets of this network namespace that listen on exactly
    ``ip:port`` (``/proc/self/net/tcp`` or ``tcp6``); None if that cannot be read."""
    want = _proc_hex(ip, port)
    path = "/proc/self/net/tcp" if ip.version == 4 else "/proc/self/net/tcp6"
    try:
        with open(path) as f:
            next(f, None)
            return [p[9] for p in (line.split() for line in f)
                    if len(p) > 9 and p[1] == want and p[3] == "0A"]
    except OSError:
        return None


def listeners_on(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int) -> int:
    """How many TCP sockets of this network namespace listen on exactly ``ip:port``;
    -1 if that cannot be read."""
    got = _listening_inodes(ip, port)
    return -1 if got is None else len(got)


def listens_there(pid: int, ip: ipaddress.IPv4Address | ipaddress.IPv6Address,
                  port: int) -> bool:
    """Whether process ``pid`` (of our pid namespace) holds a socket listening on
    ``ip:port`` in our network namespace: its descriptors (``/proc/PID/fd``, readable
    for a process of our uid, stopped or not) against the listeners' inodes.  False
    when that cannot be told (another uid, another pid namespace, gone)."""
    inodes = _listening_inodes(ip, port)
    if not inodes or pid <= 0:
        return False
    want = {f"socket:[{i}]" for i in inodes}
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in want:
                return True
        except OSError:
            continue  # closed meanwhile
    return False


def _in_use(why: str) -> OSError:
    return OSError(errno.EADDRINUSE, f"{os.strerror(errno.EADDRINUSE)} ({why})")


def _steer_to(sock: socket.socket, index: int) -> None:
    """Attach to ``sock``'s reuseport group a program that picks socket ``index``."""
    insn = ctypes.create_string_buffer(struct.pack("HBBI", _BPF_RET_K, 0, 0, index))
    prog = struct.pack("HP", 1, ctypes.addressof(insn))  # struct sock_fprog {len; filter*}
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_REUSEPORT_CBPF, prog)


def open_listener(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int, *,
                  beside: bool = False) -> socket.socket:
    """A non-blocking TCP socket listening on ``ip:port`` with ``SO_REUSEPORT``, for
    libzmq to take over (``ZMQ_USE_FD``).  ``beside``: the address may be held by a
    stalled holder of the same board, which this one replaces: then listen beside it
    and steer every new connection here.  ``OSError`` (EADDRINUSE) if anything else
    listens there, or on a wildcard address covering it."""
    family = socket.AF_INET if ip.version == 4 else socket.AF_INET6
    addr = (str(ip), port)
    probe = socket.socket(family, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as libzmq: TIME_WAIT is no conflict
        probe.bind(addr)
        taken = False
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            raise
        taken = True
    finally:
        probe.close()
    if taken and not beside:
        raise _in_use("another process listens there")
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(addr)
        s.listen(BACKLOG)
        s.setblocking(False)
        n = listeners_on(ip, port)
        if n > 1 and not beside:
            raise _in_use("another process began to listen there at the same moment")
        if beside and n > 1:
            _steer_to(s, n - 1)
    except BaseException:
        s.close()
        raise
    return s

