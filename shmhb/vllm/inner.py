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

``nixl_adapter.NixlAdapter`` is the second (the consumer reads: no go-ahead); a
vllm-ascend adapter would be the same shape (see docs/VLLM.md).
"""

from __future__ import annotations

import concurrent.futures
import functools
from abc import ABC, abstractmethod
from typing import Any, Protocol

from ..board.config import format_hostport, parse_hostport
from .settings import Rank


class Hooks(Protocol):
    """What the wrapper offers an adapter (implemented by ``guard.WorkerGuard``)."""

    def load_started(self, endpoint: str, engine_id: str, reqs: dict[str, frozenset[int]],
                     token: object) -> bool: ...

    def load_ended(self, endpoint: str, req_ids: list[str]) -> list[str]: ...

    def go_ahead(self, endpoint: str, req_ids: list[str]) -> list[str]: ...

    def give_up(self, req_ids: list[str]) -> list[object]: ...

    def request_extra(self, producer: str | None) -> dict[str, Any] | None: ...

    def consumer_seen(self, endpoint: str, extra: Any) -> Any: ...

    def ask_now(self, consumer: str, seen: Any, req_ids: list[str]) -> Any: ...

    def forget(self, ask: Any) -> None: ...

    async def allowed(self, consumer: str, seen: Any, req_ids: list[str],
                      asked: Any = None) -> list[str]: ...

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


#: the vLLM releases (major, minor) whose connectors' internals the adapters were written
#: and tested against; on another, an adapter's ``check()`` fails at startup
SUPPORTED_VLLM = ((0, 32), (0, 33))


def vllm_release(version: str | None = None) -> tuple[int, int] | None:
    """(major, minor) of ``version``, or of the installed vLLM; None if unreadable."""
    if version is None:
        import vllm
        version = str(getattr(vllm, "__version__", ""))
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def check_release(adapter: str) -> None:
    """``TypeError`` (saying what to install) unless the installed vLLM is supported."""
    if vllm_release() not in SUPPORTED_VLLM:
        import vllm
        raise TypeError(
            f"shmhb's {adapter} adapter supports vLLM 0.32 and 0.33, not "
            f"{getattr(vllm, '__version__', '?')}: install 'vllm>=0.32,<0.34', or a "
            "shmhb written for this vLLM")


@functools.lru_cache(maxsize=1024)
def zmq_hostport(addr: str) -> str:
    """"tcp://host:port" -> "host:port" (as the board spells endpoints).  Memoised: it
    runs per load on a transfer's path, over the few addresses of an engine's peers
    (a malformed one raises ``ValueError`` each time: errors are not kept)."""
    rest = addr.split("://", 1)[-1]
    host, port = parse_hostport(rest)
    return format_hostport(host, port)
