"""What an engine still owes, as its scheduler-side connector sees it: the count a drain
waits on (``shmhb.board.drain``).

Two sets, each changed by the engine's scheduler thread alone, through the connector's
public calls:

* ``running``: requests the scheduler asked the connector about
  (``get_num_new_matched_tokens``, for every request it schedules) and has not finished
  (``request_finished``, for every request that ends, aborted ones included): a decode
  finishes what it runs, a prefill computes what it accepted;
* ``sending``: finished requests whose blocks the connector keeps for a peer to read
  (``request_finished`` said "delay the free") until the worker reports the send done
  (``finished_sending`` in ``update_connector_output``, vLLM's own path; a send a peer
  never asks for ends at the inner connector's abort timeout, or with the drain's).

The drain's thread only reads ``count()``: the sum of two ``len``, each atomic under the
GIL, at most one scheduler step stale.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["OwedWork"]


class OwedWork:
    def __init__(self) -> None:
        self.running: set[str] = set()
        self.sending: set[str] = set()

    def arrived(self, request_id: str) -> None:
        self.running.add(request_id)

    def finished(self, request_id: str, delay_free: bool) -> None:
        self.running.discard(request_id)
        if delay_free:
            self.sending.add(request_id)

    def sent(self, request_ids: Iterable[str] | None) -> None:
        for rid in request_ids or ():
            self.sending.discard(rid)

    def count(self) -> int:
        return len(self.running) + len(self.sending)
