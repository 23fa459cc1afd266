"""How a Mooncake consumer settles its pulls: each (producer worker, request) exactly
once, and a request reported to vLLM (``finished_recving``, and its blocks as invalid
if any of its pulls failed) only once every producer worker it pulls from has settled.
Part of the Mooncake adapter (``mooncake_adapter.MooncakeAdapter``), split out for length; like
it, it reaches into the inner worker, and names what it uses.

One decode rank can pull one request from several producer ranks (prefill TP 2, decode
TP 1: ``receive_kv`` starts one ``receive_kv_from_single_worker`` task per producer
worker, all on one ``pull_metas`` dict, with ``PullReqMeta.pull_tasks_count`` set to
the number of workers).  The two vLLM versions settle them differently:

* vLLM 0.33: each task copies the dict; ``_handle_failed_recv`` and
  ``process_pulling_result`` *pop* what they settle from the dict they are given and
  count ``pull_tasks_count`` down (``_complete_pull_task``); a failure is sticky and the
  request is reported when the count reaches 0.  Settling a (worker, request) twice
  reports the request twice or early; never settling it never reports it.
* vLLM 0.32: every task shares the dict; the first failure marks the request failed
  and reports it at once, while another worker's write into its blocks may still be
  under way (a write after the blocks went back to vLLM), and every later result for
  it is ignored.

Here both get 0.33's rule.  The adapter hands each worker's task a dict of its own
(``dict(pull_metas)``), so "pop what you settle" is per worker on both versions; on 0.32
``_handle_failed_recv`` and ``process_pulling_result`` are replaced by 0.33's
(``_backport_*`` below: the same code, over 0.32's same fields).  Every settlement made
inside a task is recorded per task (``Ledger``), so that when the task ends (fenced, or
returned with requests still unsettled) the adapter settles exactly the rest.

**A granted load's failure waits for its lease.**  A failure that the inner settles on
its own (its receive timed out, the socket failed, the producer finished without a word
on the request) is reported only once the lease of the load's grant has run out
(``grants``, "The lease"): until then the producer that holds the grant may still start
its write, and reporting the failure hands the blocks back to vLLM.  The report is put
off on the receiver loop (``loop.call_at``: nothing cancels it) and counts the request's
share as settled then.  A result the producer itself sent (``process_pulling_result``)
is reported at once: the producer answers after its write call returned.

Uses, on the consumer's ``connector_worker``: ``_handle_failed_recv`` and
``process_pulling_result`` (wrapped; on 0.32 replaced), ``_complete_pull_task`` (0.33;
its presence is how the versions are told apart), and on 0.32 ``finished_recving_reqs``,
``_invalid_block_ids``, ``_failed_recv_reqs``, ``_is_hma_required``, ``xfer_stats``;
``PullReqMeta.failed``/``pull_tasks_count``/``local_block_ids``/``d_req_id``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

#: what a 0.32 worker needs for the backported settlement
BACKPORT_NEEDS = ("finished_recving_reqs", "_invalid_block_ids", "_failed_recv_reqs",
                  "_is_hma_required", "xfer_stats", "_handle_failed_recv",
                  "process_pulling_result")
#: what a 0.33 worker needs (its own settlement is used)
PER_PEER_NEEDS = ("_complete_pull_task", "_handle_failed_recv", "process_pulling_result")

FailFn = Callable[[dict[str, Any], Collection[str], str], None]


def settles_per_peer(worker: Any) -> bool:
    """True where the inner worker settles pulls per producer worker itself (0.33)."""
    return hasattr(worker, "_complete_pull_task")


def needs(worker: Any) -> tuple[str, ...]:
    return PER_PEER_NEEDS if settles_per_peer(worker) else BACKPORT_NEEDS


@dataclass
class _Task:
    endpoint: str
    settled: set[str] = field(default_factory=set)


class Ledger:
    """Receiver loop only (every method runs there: no lock).  ``begin``/``finish``
    bracket one worker task; ``install`` puts the recording wrappers in place."""

    def __init__(self, worker: Any, on_settled: Callable[[str, list[str]], dict[str, int]],
                 on_held: Callable[[int], None]) -> None:
        self.w = worker
        #: (endpoint, req ids): the loads are over; returns those whose failure must
        #: wait, each with when its grant's lease ends (``time.monotonic_ns``)
        self.on_settled = on_settled
        self.on_held = on_held  # (n): n failures put off
        self._tasks: dict[Any, _Task] = {}
        self.fail: FailFn = worker._handle_failed_recv  # replaced in install()

    def install(self) -> None:
        w = self.w
        if settles_per_peer(w):
            fail: FailFn = w._handle_failed_recv
            result = w.process_pulling_result
        else:
            fail, result = self._backport_failed, self._backport_result
        self.fail = fail

        def handle_failed_recv(pull_metas: dict[str, Any], req_ids: Collection[str],
                               reason: str) -> None:
            # The inner failing these on its own (a producer's answer is recorded first,
            # in process_pulling_result, so none of its loads is held here).
            held = self._record(pull_metas, req_ids)
            if held:
                self.fail_later(pull_metas, held, reason)
                req_ids = [r for r in req_ids if r not in held]
            fail(pull_metas, req_ids, reason)

        def process_pulling_result(response: Any, pull_metas: dict[str, Any]) -> None:
            # The producer's own answer: its write call is over, nothing is held.
            self._record(pull_metas, list(response.err_reqs or ()) + list(response.ok_reqs or ()))
            result(response, pull_metas)

        w._handle_failed_recv = handle_failed_recv
        w.process_pulling_result = process_pulling_result

    # -- one worker task ----------------------------------------------------------------------

    def begin(self, task: Any, endpoint: str) -> None:
        self._tasks[task] = _Task(endpoint)

    def finish(self, task: Any, mine: dict[str, Any]) -> list[str]:
        """The task is over: the requests of ``mine`` it has not settled."""
        t = self._tasks.pop(task, None)
        done = t.settled if t is not None else set()
        return [r for r in mine if r not in done]

    def fail_now(self, metas: dict[str, Any], req_ids: list[str], reason: str,
                 held: dict[str, int] | None = None) -> None:
        """Settle these (worker, request) pairs as failed: once, by the caller, who
        owns them (the task that held them is over, or never asked); those in ``held``
        (``on_settled``'s answer) once their lease has run out."""
        held = {r: u for r, u in (held or {}).items() if r in req_ids}
        if held:
            self.fail_later(metas, held, reason)
            req_ids = [r for r in req_ids if r not in held]
        if req_ids:
            self.fail({r: metas[r] for r in req_ids if r in metas}, req_ids, reason)

    def fail_later(self, metas: dict[str, Any], held: dict[str, int], reason: str) -> None:
        """Settle ``held`` as failed once the last of their leases has run out (on this
        loop; nothing cancels it)."""
        mine = {r: metas[r] for r in held if r in metas}
        if not mine:
            return
        self.on_held(len(mine))
        wait_s = max(0.0, (max(held.values()) - time.monotonic_ns()) / 1e9)
        log.info("shmhb: %d failed load(s) reported in %.1f s, once the producer's grant has "
                 "run out (it may start its write until then): %s", len(mine), wait_s, reason)
        asyncio.get_running_loop().call_later(wait_s, self.fail, mine, list(mine), reason)

    def _record(self, pull_metas: dict[str, Any], req_ids: Collection[str]) -> dict[str, int]:
        """Records these as settled by the current task; returns ``on_settled``'s
        answer (those whose failure must wait)."""
        try:
            task = asyncio.current_task()
        except RuntimeError:
            return {}
        t = self._tasks.get(task)
        if t is None:
            return {}
        now = [r for r in req_ids if r in pull_metas and r not in t.settled]
        if not now:
            return {}
        t.settled.update(now)
        return self.on_settled(t.endpoint, now)

    # -- vLLM 0.33's settlement, for 0.32 -------------------------------------------------------

    def _complete(self, pm: Any) -> None:
        if pm.pull_tasks_count > 0:
            pm.pull_tasks_count -= 1
        if pm.pull_tasks_count == 0 and any(pm.local_block_ids):
            self.w.finished_recving_reqs.add(pm.d_req_id)

    def _backport_failed(self, pull_metas: dict[str, Any], req_ids: Collection[str],
                         reason: str) -> None:
        w = self.w
        failed = []
        for r in req_ids:
            pm = pull_metas.pop(r, None)
            if pm is None:
                continue
            if not pm.failed:
                pm.failed = True
                failed.append(r)
                w.xfer_stats.record_failed_recv()
                invalid = {b for g in pm.local_block_ids for b in g}
                if invalid:  # (none: a pull that only releases the producer's blocks)
                    if w._is_hma_required:
                        w._failed_recv_reqs.put(pm.d_req_id)
                    else:
                        w._invalid_block_ids.put(invalid)
            self._complete(pm)
        if failed:
            log.error("pulling kv_caches for %s failed: %s", failed, reason)

    def _backport_result(self, response: Any, pull_metas: dict[str, Any]) -> None:
        if response.err_reqs:
            self._backport_failed(pull_metas, response.err_reqs,
                                  response.err_msg or "unknown error")
        for r in response.ok_reqs or ():
            pm = pull_metas.pop(r, None)
            if pm is not None:
                self._complete(pm)
