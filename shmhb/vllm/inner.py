"""The adapter contract: what ``ShmhbConnector`` needs from the connector it wraps, one
small class per inner connector (``mooncake_adapter.MooncakeAdapter``; the registry is
``adapters``).  Only adapter modules touch an inner connector's internals; each names
what it reaches in its docstring, so a vLLM upgrade that renames them breaks there,
loudly, at startup (``check()``), not silently at the first failure.

An adapter answers six things:

* ``address_fields`` and ``producer_address(*values)`` (class level: the scheduler role
  asks them with no worker built): the board endpoint of the producer a request's
  transfer params name, or None;

* ``rank()``, ``consumes()``/``produces()`` and ``endpoints()``: what the rank registers on its board
  (the side channel peers send requests to, the transfer engine's address, the
  bootstrap server if this rank runs it), and whether it loads;
* ``install(hooks)``: put the wrapper in the path of a load (consumer) and of a write
  (producer): the consumer tells ``hooks`` when a load starts and ends and adds its
  incarnation and go-ahead address to the request; where the producer writes
  (``asks_go_ahead``), it asks ``hooks.allowed`` before every write (and
  ``hooks.ask_now`` as it reads a request whose blocks are computed, so the answer is
  in by the time it writes);
* ``fence(tokens)``: cut what carries the given loads' requests, and return once that is
  done (a future), so a failure is reported only after the fence holds;
* ``evict_engine(engine_id)`` / ``evict_consumer(endpoint)``: forget what the inner
  connector caches about a peer that is gone, so the next request asks afresh.

``nixl_adapter.NixlAdapter`` is the second (the consumer reads: no go-ahead);
``ascend_adapter.AscendMooncakeAdapter`` (vllm-ascend's ``MooncakeConnectorV1``, the
consumer reads too) the third.  Each names the releases it supports (``Release``,
``check_release``): a worker on any other combination refuses to start.
"""

from __future__ import annotations

import concurrent.futures
import functools
import importlib.metadata
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol

from ..board.config import format_hostport, parse_hostport
from ..errors import ShmhbError
from ..kv.fence import Allowed
from .settings import Rank


class Hooks(Protocol):
    """What the wrapper offers an adapter (implemented by ``guard.WorkerGuard``)."""

    def load_started(self, endpoint: str, engine_id: str, reqs: dict[str, frozenset[int]],
                     token: object) -> bool: ...

    def load_ended(self, endpoint: str, req_ids: list[str]) -> dict[str, int]: ...

    def failure_held(self, n: int) -> None: ...

    def go_ahead(self, endpoint: str, req_ids: list[str]) -> list[str]: ...

    def give_up(self, req_ids: list[str]) -> list[object]: ...

    def request_extra(self, producer: str | None) -> dict[str, Any] | None: ...

    def consumer_seen(self, endpoint: str, extra: Any) -> Any: ...

    def ask_now(self, consumer: str, seen: Any, req_ids: list[str]) -> Any: ...

    def forget(self, ask: Any) -> None: ...

    async def allowed(self, consumer: str, seen: Any, req_ids: list[str],
                      asked: Any = None) -> Allowed: ...

    def lease_ran_out(self, consumer: str) -> None: ...

    def write_denied(self, consumer: str, n: int) -> None: ...


class InnerAdapter(ABC):
    """The contract; see the module docstring."""

    #: the ``kv_connector`` names this adapter serves
    names: tuple[str, ...] = ()
    #: whether a producer writes into its consumer's blocks (then it asks the
    #: consumer's go-ahead first, and consumers run the fence server that answers)
    asks_go_ahead: bool = True
    #: the transfer params that name the producer's address (``producer_address``)
    address_fields: tuple[str, ...] = ()

    @staticmethod
    def producer_address(*values: object) -> str | None:
        """The board endpoint ("host:port") of the producer that the values of
        ``address_fields`` in a request's transfer params name; None if they name none
        (untrusted input: anything else is None, never an error)."""
        return None

    def __init__(self, connector: Any) -> None:
        self.connector = connector

    @abstractmethod
    def check(self) -> None:
        """Raise ``TypeError`` if the inner connector lacks what this adapter uses."""

    @abstractmethod
    def consumes(self) -> bool:
        """Whether this rank loads KV from producers (a consumer, or both)."""

    @abstractmethod
    def produces(self) -> bool:
        """Whether this rank serves KV to consumers (a producer, or both)."""

    @abstractmethod
    def rank(self) -> Rank:
        """This worker's dp, tp and pp ranks."""

    @abstractmethod
    def endpoints(self) -> dict[str, str]:
        """Endpoints peers reach this rank at: "side", "engine", "bootstrap" ("host:port")."""

    @abstractmethod
    def install(self, hooks: Hooks) -> None: ...

    @abstractmethod
    def fence(self, tokens: list[object]) -> concurrent.futures.Future[None]: ...

    @abstractmethod
    def evict_engine(self, engine_id: str) -> None: ...

    @abstractmethod
    def evict_consumer(self, endpoint: str) -> None: ...

    def cached_engines(self) -> set[str]:
        """Remote engines the inner connector holds state for (for tests and metrics)."""
        return set()


@dataclass(frozen=True)
class Release:
    """Releases of one package an adapter was written and tested against: each entry of
    ``versions`` is a release line ("0.32": any 0.32.x) or one exact version ("0.23.0",
    "0.23.0.post1"; a local suffix such as "+cpu" is ignored)."""

    package: str
    versions: tuple[str, ...]

    def matches(self, version: str | None) -> bool:
        if version is None:
            return False
        v = version.split("+", 1)[0]
        for want in self.versions:
            if want.count(".") == 1:
                if release_line(v) == release_line(want):
                    return True
            elif v == want:
                return True
        return False


#: the vLLM releases the upstream adapters (vLLM's own MooncakeConnector, NixlConnector)
#: were written and tested against; on another, their ``check()`` fails at startup
UPSTREAM_VLLM = (Release("vllm", ("0.32", "0.33")),)
UPSTREAM_HINT = "install 'vllm>=0.32,<0.34'"


def release_line(version: str | None) -> tuple[int, int] | None:
    """(major, minor) of ``version``; None if unreadable."""
    parts = (version or "").split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def vllm_release(version: str | None = None) -> tuple[int, int] | None:
    """(major, minor) of ``version``, or of the installed vLLM; None if unreadable."""
    return release_line(version if version is not None else installed("vllm"))


def installed(package: str) -> str | None:
    """The version of ``package`` this process runs: its module's ``__version__`` where it
    is imported already, else its installed metadata (nothing is imported); None if
    absent."""
    mod = sys.modules.get(package.replace("-", "_"))
    version = getattr(mod, "__version__", None)
    if isinstance(version, str):
        return version
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_release(adapter: str, releases: tuple[Release, ...] = UPSTREAM_VLLM,
                  hint: str = UPSTREAM_HINT) -> None:
    """``TypeError``, saying what to install, unless every package of ``releases`` is
    installed at one of its versions: an adapter relies on internals (how a release
    settles a transfer, which tables it keeps) that no attribute check can see."""
    have = {r.package: installed(r.package) for r in releases}
    wrong = [r for r in releases if not r.matches(have[r.package])]
    if wrong:
        got = ", ".join(f"{r.package} {have[r.package] or '(absent)'}" for r in releases)
        want = ", ".join(f"{r.package} {' or '.join(r.versions)}" for r in releases)
        raise TypeError(f"shmhb's {adapter} adapter supports {want}, not {got}: {hint}, "
                        "or a shmhb written for these releases")


def host_port_address(*values: object) -> str | None:
    """The board endpoint of a producer that transfer params name by a host and a port
    (``remote_host``, ``remote_port``: NIXL's handshake listener, vllm-ascend's side
    channel), or None (untrusted input: anything but a valid pair is None)."""
    host, port = (values + (None, None))[:2]
    if not isinstance(host, str) or isinstance(port, bool) or not isinstance(port, int):
        return None
    try:  # formatted, then read back through the one address door: validated
        return format_hostport(*parse_hostport(format_hostport(host, port)))
    except (ShmhbError, ValueError):
        return None


@functools.lru_cache(maxsize=1024)
def zmq_hostport(addr: str) -> str:
    """"tcp://host:port" -> "host:port" (as the board spells endpoints).  Memoised: it
    runs per load on a transfer's path, over the few addresses of an engine's peers
    (a malformed one raises ``ValueError`` each time: errors are not kept)."""
    rest = addr.split("://", 1)[-1]
    host, port = parse_hostport(rest)
    return format_hostport(host, port)
