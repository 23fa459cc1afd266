"""The pure parts of shmhb.vllm: settings, the veto's rule, the hooks forwarded, the
adapters' gates (the load table and the go-ahead: test_fence.py)."""

from __future__ import annotations

import asyncio

import pytest

from .conftest import require_vllm

require_vllm()

from shmhb.errors import InvalidConfig  # noqa: E402
from shmhb.kv.fence import parse_extra  # noqa: E402
from shmhb.vllm.settings import ConnectorSettings, engine_prefix, rank_key  # noqa: E402

EP = "127.0.0.2:4000"
TOK = "0" * 32


def test_settings_and_keys() -> None:
    inner = {"kv_connector": "MooncakeConnector"}
    s = ConnectorSettings.from_extra_config({"inner": inner, "on_dead_peer": "fail"})
    assert s.on_dead_peer == "fail" and s.grant_timeout_s == 2.0 and s.grant_lease_s == 30.0
    for bad in ({}, {"inner": {"kv_connector": "ShmhbConnector"}},
                {"inner": inner, "on_dead_peer": "retry"}, {"inner": inner, "grant_timeout_s": -1},
                {"inner": inner, "grant_lease_s": 0.5}, {"inner": inner, "grant_lease_s": 4.0},
                {"inner": inner, "act_on_suspect": "yes"}, {"inner": inner, "board": 3}):
        with pytest.raises(InvalidConfig):
            ConnectorSettings.from_extra_config(bad)
    k = rank_key("e" * 80, 0, 3, 1)
    assert len(k.encode()) < 64 and k.startswith(engine_prefix("e" * 80)) and k.endswith("/tp3/pp1")
    assert rank_key("abc", 0, 0, 0) == "vllm/abc/dp0/tp0/pp0"
    assert not rank_key("abcd", 0, 0, 0).startswith(engine_prefix("abc"))
    assert parse_extra({"inc": 5, "fence": EP}) == (5, EP, None)
    assert parse_extra({"inc": 5, "fence": EP, "tok": TOK}) == (5, EP, TOK)
    assert parse_extra({"inc": 5, "fence": EP, "tok": "x"}) == (5, EP, None)
    assert parse_extra({"inc": 5, "fence": "*:1"}) is None and parse_extra("x") is None


def test_a_veto_names_the_engine_it_vetoes() -> None:
    """The newest slot at a bootstrap address may be another engine's: only the
    requested engine's own slot, or a live other engine there, says anything."""
    from shmhb import Status
    from shmhb.status import SlotStatus
    from shmhb.vllm.verdict import may_hold_blocks, producer_verdict

    def slot(engine: str, status: Status) -> SlotStatus:
        return SlotStatus(rank_key(engine, 0, 0, 0), 1, 7, status, 0.0, (EP,))

    for st, want in [(Status.ALIVE, None), (Status.SUSPECT, None), (Status.DEAD, "dead"),
                     (Status.LEFT, "left"), (Status.UNKNOWN, None)]:
        assert producer_verdict(slot("e1", st), "e1", False) == want, st
    assert producer_verdict(slot("e1", Status.SUSPECT), "e1", True) == "suspect"
    # the requested engine restarted under a new id; the board still shows its dead
    # predecessor at that address: nothing is known about the new one, so no veto
    for st in (Status.DEAD, Status.LEFT, Status.SUSPECT, Status.UNKNOWN):
        assert producer_verdict(slot("old", st), "new", True) is None, st
    # a live other engine serves the address: the requested one is not there any more
    assert producer_verdict(slot("new", Status.ALIVE), "old", False) == "gone"
    # an engine id that is a prefix of another's names only itself
    assert producer_verdict(slot("e10", Status.DEAD), "e1", False) is None
    assert producer_verdict(None, "e1", False) is None
    long_id = "x" * 80  # keyed by a digest: the same rule
    assert producer_verdict(slot(long_id, Status.DEAD), long_id, False) == "dead"
    assert producer_verdict(slot(long_id, Status.ALIVE), "y" * 80, False) == "gone"
    assert may_hold_blocks("suspect") and not any(map(may_hold_blocks, ["dead", "left", "gone"]))

# -- vLLM 0.33's hooks, forwarded; the adapter's version gate ---------------------------------

def _outer_ktc(protocol: str) -> object:
    from vllm.config import KVTransferConfig
    return KVTransferConfig(
        kv_connector="ShmhbConnector", kv_connector_module_path="shmhb.vllm",
        kv_role="kv_consumer", kv_connector_extra_config={"inner": {
            "kv_connector": "MooncakeConnector",
            "kv_connector_extra_config": {"mooncake_protocol": protocol}}})


def test_sleep_mode_hooks_reach_the_inner_connector() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
        MooncakeConnector,
    )

    from shmhb.vllm.connector import ShmhbConnector
    calls: list[str] = []

    class Inner:
        def unregister_kv_caches(self) -> None:
            calls.append("unregister")

        def restore_kv_caches(self) -> None:
            calls.append("restore")
    c = ShmhbConnector.__new__(ShmhbConnector)  # only the forwarding is under test
    c.inner = Inner()  # type: ignore[assignment]
    c.unregister_kv_caches()
    c.restore_kv_caches()
    assert calls == ["unregister", "restore"]  # (0.33's base class would answer None)
    # Mooncake 0.33 supports sleep mode over RDMA only; the base class says yes to all.
    if hasattr(MooncakeConnector, "supports_sleep_mode"):
        assert ShmhbConnector.supports_sleep_mode(_outer_ktc("tcp")) is False
        assert ShmhbConnector.supports_sleep_mode(_outer_ktc("rdma")) is True
    else:  # 0.32: no such hook; the wrapper answers what the base class would
        assert ShmhbConnector.supports_sleep_mode(_outer_ktc("tcp")) is True


def test_prom_metrics_are_the_inner_connectors_fed_its_stats() -> None:
    import functools
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
        MooncakeConnector,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.stats import (
        MooncakeKVConnectorStats,
    )

    from shmhb.vllm.connector import ShmhbConnector
    from shmhb.vllm.stats import ShmhbKVConnectorStats
    reg = CollectorRegistry()
    types = {t: functools.partial(t, registry=reg) for t in (Counter, Gauge, Histogram)}
    cfg = SimpleNamespace(kv_transfer_config=_outer_ktc("tcp"))
    prom = ShmhbConnector.build_prom_metrics(cfg, types, ["model_name", "engine"], {0: ["m", "0"]})
    if "build_prom_metrics" not in vars(MooncakeConnector):  # 0.32: Mooncake has none
        assert prom is None
        return
    assert prom is not None
    inner = MooncakeKVConnectorStats()
    inner.record_failed_recv()
    inner.record_failed_recv()
    prom.observe(ShmhbKVConnectorStats(data={"shmhb": {"failed_loads": 2}, "inner": inner}).to_dict())
    prom.observe(ShmhbKVConnectorStats(data={"shmhb": {"failed_loads": 1}, "inner": None}).to_dict())
    got = {s.name: s.value for m in reg.collect() for s in m.samples
           if "failed_recv" in s.name and s.name.endswith("_total")}
    assert list(got.values()) == [2.0], got


def test_adapter_refuses_a_vllm_it_was_not_written_for(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm

    from shmhb.vllm.mooncake_adapter import MooncakeAdapter
    from shmhb.vllm.inner import vllm_release
    assert vllm_release("0.33.0") == (0, 33) and vllm_release("0.32.1.dev3+gabc") == (0, 32)
    assert vllm_release("dev") is None
    worker = type("W", (), {"is_kv_producer": False, "is_kv_consumer": True})()
    a = MooncakeAdapter(type("C", (), {"connector_worker": worker})())
    with pytest.raises(TypeError, match="lacks"):  # this vLLM, but not its Mooncake worker
        a.check()
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    with pytest.raises(TypeError, match="0.34.0"):
        a.check()


def test_adapters_read_the_producer_address_from_untrusted_params() -> None:
    """The scheduler's veto looks the producer up by the address its transfer params
    name: each adapter reads its own fields, and anything that is not an address is
    None (no veto, no crash)."""
    from shmhb.vllm.adapters import adapter_class
    from shmhb.vllm.mooncake_adapter import MooncakeAdapter
    from shmhb.vllm.nixl_adapter import NixlAdapter
    assert adapter_class("MooncakeConnector") is MooncakeAdapter
    assert adapter_class("NixlConnector") is NixlAdapter
    with pytest.raises(TypeError, match="no adapter"):
        adapter_class("LMCacheConnectorV1")
    m, n = MooncakeAdapter.producer_address, NixlAdapter.producer_address
    assert MooncakeAdapter.address_fields == ("remote_bootstrap_addr",)
    assert m("http://127.0.0.2:8998") == m("127.0.0.2:8998/x") == "127.0.0.2:8998"
    for bad in (None, 8998, "http://", "http://a b:1", "http://127.0.0.2:99999", ["x"]):
        assert m(bad) is None, bad
    assert NixlAdapter.address_fields == ("remote_host", "remote_port")
    assert n("127.0.0.2", 5600) == "127.0.0.2:5600" and n("::1", 5600) == "[::1]:5600"
    for bad in ((None, 5600), ("127.0.0.2", "5600"), ("127.0.0.2", True), ("127.0.0.2", -1),
                ("127.0.0.2", 1 << 20), ("a b", 1), ("127.0.0.2",), ()):
        assert n(*bad) is None, bad
    assert not NixlAdapter.asks_go_ahead and MooncakeAdapter.asks_go_ahead


class _Worker32:
    """The fields of a vLLM 0.32 Mooncake consumer worker that the backported settlement
    uses (its own settlement must not run)."""

    def __init__(self) -> None:
        import queue
        from types import SimpleNamespace
        self.finished_recving_reqs: set[str] = set()
        self._invalid_block_ids: queue.Queue[set[int]] = queue.Queue()
        self._failed_recv_reqs: queue.Queue[str] = queue.Queue()
        self._is_hma_required = False
        self.xfer_stats = SimpleNamespace(record_failed_recv=lambda: None)

    def _handle_failed_recv(self, *a: object) -> None:
        raise AssertionError("0.32's own settlement must not run")

    def process_pulling_result(self, *a: object) -> None:
        raise AssertionError("0.32's own settlement must not run")


def test_ledger_settles_each_workers_share_once_and_reports_after_the_last() -> None:
    """vLLM 0.32's fields, 0.33's rule (the backport): a request pulled from two
    producer workers is reported once, after both settled, its blocks invalid once."""
    from types import SimpleNamespace

    from shmhb.vllm.mooncake_pulls import Ledger, settles_per_peer

    w = _Worker32()
    assert not settles_per_peer(w)
    ended: list[tuple[str, list[str]]] = []

    def on_settled(ep: str, reqs: list[str]) -> dict[str, int]:
        ended.append((ep, reqs))
        return {}
    ledger = Ledger(w, on_settled, lambda n: None)
    ledger.install()
    pm = SimpleNamespace(pull_tasks_count=2, failed=False, local_block_ids=[[4, 5]], d_req_id="r")

    async def worker(ep: str, ok: bool) -> list[str]:
        task = asyncio.current_task()
        mine = {"r": pm}
        ledger.begin(task, ep)
        if ok:  # this worker's write landed and it said so
            w.process_pulling_result(SimpleNamespace(ok_reqs=["r"], err_reqs=None, err_msg=None), mine)
            w.process_pulling_result(SimpleNamespace(ok_reqs=["r"], err_reqs=None, err_msg=None), mine)
        left = ledger.finish(task, {"r": pm})  # then fenced: settle what it left
        ledger.fail_now({"r": pm}, left, "fenced")
        return left

    async def run() -> tuple[list[str], set[str], list[str]]:
        a = await worker("A", ok=True)
        after_a = set(w.finished_recving_reqs)
        b = await worker("B", ok=False)
        return a, after_a, b
    a, after_a, b = asyncio.run(run())
    assert a == [] and b == ["r"]  # A settled by its result (once), B by the fence
    assert after_a == set()  # not reported while B could still write
    assert w.finished_recving_reqs == {"r"} and pm.pull_tasks_count == 0 and pm.failed
    assert w._invalid_block_ids.get_nowait() == {4, 5} and w._invalid_block_ids.empty()
    assert ended == [("A", ["r"])]


def test_ledger_holds_a_granted_loads_failure_until_its_lease_ran_out() -> None:
    """The inner gives a granted load up on its own (its receive timed out): the
    producer may still start its write until the grant's lease ends, so the failure
    (which hands the blocks back to vLLM) is reported only then.  A failure the producer
    itself reported is not held: its write call is over."""
    import time
    from types import SimpleNamespace

    from shmhb.vllm.mooncake_pulls import Ledger

    w = _Worker32()
    lease_s = 0.4
    held: list[int] = []
    ledger = Ledger(w, lambda ep, reqs: {r: time.monotonic_ns() + int(lease_s * 1e9)
                                         for r in reqs}, held.append)
    ledger.install()

    def pm(rid: str) -> SimpleNamespace:
        return SimpleNamespace(pull_tasks_count=1, failed=False, local_block_ids=[[1]], d_req_id=rid)
    timed_out, answered = pm("t"), pm("a")

    async def run() -> tuple[set[str], float]:
        task = asyncio.current_task()
        ledger.begin(task, "P")
        w._handle_failed_recv({"t": timed_out}, ["t"], "transfer failed: Resource temporarily unavailable")
        w.process_pulling_result(SimpleNamespace(ok_reqs=None, err_reqs=["a"], err_msg="x"),
                                 {"a": answered})
        ledger.finish(task, {})
        at_once = set(w.finished_recving_reqs)
        t0 = time.monotonic()
        while "t" not in w.finished_recving_reqs and time.monotonic() - t0 < 10:
            await asyncio.sleep(0.01)
        return at_once, time.monotonic() - t0
    at_once, took = asyncio.run(run())
    assert at_once == {"a"}  # the producer's own answer: at once
    assert w.finished_recving_reqs == {"a", "t"} and timed_out.failed
    assert lease_s - 0.05 <= took < lease_s + 5, took  # the inner's give-up: at the lease's end
    assert held == [1]
