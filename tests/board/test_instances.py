"""Instances on the board (shmhb.board.instances): the key format, the judging rule, and real
engine processes (a rank slot plus the instance slot, as ShmhbConnector registers
them) killed, closed and restarted under this test's own agent."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

import shmhb
from shmhb import Status
from shmhb.errors import InvalidConfig, InvalidKey
from shmhb.board.instances import (
    board_instances, drain_key, instance_key, instances_from, judge_instance,
    parse_instance_key, register_instance,
)

from ..conftest import ENGINE, Procs, wait_until

A, S, D, L, U = Status.ALIVE, Status.SUSPECT, Status.DEAD, Status.LEFT, Status.UNKNOWN

#: one engine: its rank slots (argv[4] of them: tp0, tp1, ...) in this process, the
#: instance slot beside tp0 (serving :8000 and bootstrap :8998 on argv[5], 127.0.0.5)
def slot(key: str, st: Status = A, *eps: str, inc: int = 7) -> shmhb.SlotStatus:
    return shmhb.SlotStatus(key, 1, inc, st, 0.0, eps)


def test_key_format_round_trips_and_refuses_what_does_not_fit() -> None:
    k = instance_key("prefill", "eng-1", bootstrap_port=8998)
    assert k == "inst/prefill/8998/eng-1"
    assert parse_instance_key(k) == ("prefill", 8998, "eng-1")
    assert instance_key("decode", "e", bootstrap_port=None) == "inst/decode/-/e"
    assert parse_instance_key("inst/decode/-/e") == ("decode", None, "e")
    for bad in ("inst/prefill/8998", "inst/router/-/e", "inst/prefill/x/e", "inst/prefill/0/e",
                "inst/prefill/65536/e", "inst/prefill/08998/e", "vllm/e/dp0/tp0/pp0",
                "inst/prefill/-/e/f"):
        assert parse_instance_key(bad) is None, bad
    with pytest.raises(InvalidConfig):
        instance_key("router", "e", bootstrap_port=None)
    with pytest.raises(InvalidConfig):
        instance_key("decode", "e", bootstrap_port=None, serving=False)
    with pytest.raises(InvalidConfig):
        instance_key("decode", "e", bootstrap_port=70000)
    with pytest.raises(InvalidConfig):
        instance_key("decode", "a/b", bootstrap_port=None)
    with pytest.raises(InvalidKey):
        instance_key("decode", "x" * 60, bootstrap_port=None)


def test_an_instance_is_as_bad_as_its_worst_row() -> None:
    assert judge_instance(A, [A, A]) is A
    assert judge_instance(A, []) is A
    assert judge_instance(A, [A, S]) is S
    assert judge_instance(A, [U, S]) is U
    assert judge_instance(A, [L, U]) is L
    assert judge_instance(L, [D, A]) is D
    assert judge_instance(D, [A]) is D


def test_rows_become_instances_with_their_ranks_and_bad_rows_are_skipped() -> None:
    rows = [slot("inst/prefill/8998/e1", A, "127.0.0.5:8000"),
            slot("vllm/e1/dp0/tp0/pp0", A, "127.0.0.5:31000"),
            slot("vllm/e1/dp0/tp1/pp0", D, "127.0.0.5:31001"),
            slot("vllm/e10/dp0/tp0/pp0", A, "127.0.0.7:31002"),  # another engine's
            slot("inst/decode/-/e2", A, "127.0.0.6:8000"),
            slot("inst/prefill/8999/e4"),                        # no serving: the ranks' host
            slot("vllm/e4/dp0/tp0/pp0", A, "127.0.0.8:8999"),
            slot("inst/decode/-/e3", A),                         # neither address
            slot("inst/decode/-/e5", A, "127.0.0.6:1", "127.0.0.6:2")]  # two endpoints
    got = {i.engine: i for i in instances_from(rows, "127.0.0.5")}
    assert set(got) == {"e1", "e2", "e4"}
    assert got["e1"].status is D and got["e1"].ranks == 2
    assert (got["e1"].serving, got["e1"].bootstrap) == ("127.0.0.5:8000", "127.0.0.5:8998")
    assert got["e2"].status is A and got["e2"].bootstrap is None and got["e2"].ranks == 0
    assert (got["e4"].serving, got["e4"].bootstrap) == (None, "127.0.0.8:8999")
    assert got["e1"].to_json()["url"] == "http://127.0.0.5:8000"


def test_a_live_drain_slot_marks_its_instance_draining() -> None:
    rows = [slot("inst/prefill/8998/e1", A, "127.0.0.5:8000"),
            slot("inst/decode/-/e2", A, "127.0.0.6:8000"),
            slot("inst/decode/-/e3", A, "127.0.0.6:8001"),
            slot(drain_key("inst/prefill/8998/e1"), S),   # a drain under way (even if slow)
            slot(drain_key("inst/decode/-/e2"), D),       # its holder died: the drain ended
            slot("drain/decode/-/e9", A)]                 # of no instance here: ignored
    got = {i.engine: i for i in instances_from(rows)}
    assert (got["e1"].draining, got["e2"].draining, got["e3"].draining) == (True, False, False)
    assert got["e1"].status is A and got["e1"].to_json()["draining"] is True
    with pytest.raises(InvalidConfig):
        drain_key("vllm/e1/dp0/tp0/pp0")


@pytest.mark.system  # it starts processes (tests/tiers.py)
def test_shmhb_drain_holds_the_drain_until_the_instance_leaves(board: shmhb.Board,
                                                               agent: object) -> None:
    """The command marks the instance draining while it runs and exits 0 once the
    instance left; an instance it cannot name is a clear error."""
    hb = board.register("vllm/e7/dp0/tp0/pp0", endpoints=("127.0.0.5:8998",), agent=False).start(0.05)
    register_instance(board, hb, "prefill", "e7", serving="127.0.0.5:8000",
                      bootstrap="127.0.0.5:8998", interval_s=0.05)
    cmd = [sys.executable, "-m", "shmhb", "drain", "--board", board.name]
    bad = subprocess.run(cmd + ["nope"], capture_output=True, text=True, timeout=30)
    assert bad.returncode != 0 and "no instance" in bad.stderr
    p = subprocess.Popen(cmd + ["e7"], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and json.loads(p.stdout.readline())["event"] == "draining"
        wait_until(lambda: board_instances(board)[0].draining, what="e7 draining")
        hb.close()  # a graceful leave: the instance slot closes with its rank
        assert p.wait(10) == 0
        assert json.loads(p.stdout.readline())["why"] == "left"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        if p.stdout is not None:
            p.stdout.close()


def test_the_instance_slot_shares_no_endpoint_with_a_rank(board: shmhb.Board) -> None:
    """Lookups by endpoint (Board.remote, the LinkReaper) must keep finding the rank."""
    hb = board.register("vllm/e/dp0/tp0/pp0", endpoints=("127.0.0.5:8998",), agent=False)
    inst = register_instance(board, hb, "prefill", "e", serving=None, bootstrap="127.0.0.5:8998")
    assert inst.endpoints == ()
    (i,) = board_instances(board)
    assert i.bootstrap == "127.0.0.5:8998" and i.serving is None
    hb.close()


def test_a_serving_address_is_taken_as_a_url_too(board: shmhb.Board) -> None:
    # the form the connector's serving_url takes, and what `shmhb instances` prints
    hb = board.register("vllm/u/dp0/tp0/pp0", endpoints=("127.0.0.5:8997",), agent=False)
    register_instance(board, hb, "decode", "u", serving="http://127.0.0.5:8100/", bootstrap=None)
    (i,) = board_instances(board)
    assert i.serving == "127.0.0.5:8100" and i.to_json()["url"] == "http://127.0.0.5:8100"
    hb.close()


def engine(procs: Procs, board: shmhb.Board, eng: str, role: str = "prefill",
           nranks: int = 1) -> tuple[subprocess.Popen[str], int]:
    p = procs.program(ENGINE, board.name, eng, role, str(nranks))
    return p, int(p.ready_line.split()[1])  # type: ignore[attr-defined]


def only(board: shmhb.Board, eng: str) -> shmhb.board.instances.Instance | None:
    got = [i for i in board_instances(board) if i.engine == eng]
    return got[0] if got else None


def test_kill_close_and_restart_of_real_engines(board: shmhb.Board, agent: object,
                                                procs: Procs) -> None:
    p, inc = engine(procs, board, "eng-a")
    wait_until(lambda: (i := only(board, "eng-a")) is not None and i.status is A, 5,
               what="eng-a alive")
    assert only(board, "eng-a").incarnation == inc  # type: ignore[union-attr]
    p.send_signal(signal.SIGKILL)
    p.wait(5)
    wait_until(lambda: only(board, "eng-a").status is D, 5, what="eng-a dead")  # type: ignore[union-attr]
    # a restart under the same engine id: a new incarnation, alive again
    p2, inc2 = engine(procs, board, "eng-a")
    assert inc2 > inc
    wait_until(lambda: (i := only(board, "eng-a")) is not None and i.status is A
               and i.incarnation == inc2, 5, what="eng-a back")
    p2.send_signal(signal.SIGTERM)  # a graceful shutdown closes the rank, and the instance with it
    p2.wait(5)
    wait_until(lambda: only(board, "eng-a").status is L, 5, what="eng-a left")  # type: ignore[union-attr]


def test_one_rank_killed_makes_its_instance_dead(board: shmhb.Board, agent: object,
                                                 procs: Procs) -> None:
    """Ranks in other processes: the instance reads DEAD when any of them dies."""
    p, _ = engine(procs, board, "eng-b", role="decode")
    other = procs.worker(board.name, "vllm/eng-b/dp0/tp1/pp0")
    wait_until(lambda: (i := only(board, "eng-b")) is not None and i.status is A
               and i.ranks == 2, 5, what="eng-b alive with 2 ranks")
    other.send_signal(signal.SIGKILL)
    other.wait(5)
    wait_until(lambda: only(board, "eng-b").status is D, 5, what="eng-b dead")  # type: ignore[union-attr]
    assert p.poll() is None
