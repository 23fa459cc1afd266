"""The C hot path (``shmhb._native``) and the C header (``shmhb.h``) against the
pure-Python path and ``shmhb/board/layout.py``: the same words, judged alike, bit for bit."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import shmhb
from shmhb.board.core import board_words
from shmhb.board import judge as J
from shmhb.board import layout as L
from shmhb.clock import FakeClock
from shmhb.testing.loopback import child_env
from shmhb.net.protocol import DigestEntry
from shmhb.net.rowwriter import RowWriter
from shmhb.status import Status

from ..conftest import ROOT, Procs, native_extension, use_hot_path, wait_until

HEADER = os.path.join(shmhb.get_include(), "shmhb.h")
EXAMPLE_C = os.path.join(ROOT, "examples", "board_status.c")


def _ext() -> ModuleType:
    return native_extension()


def _defines() -> dict[str, int]:
    with open(HEADER) as f:
        text = f.read()
    pattern = r"^#define (SHMHB_[A-Z0-9_]+) (0x[0-9a-fA-F]+|\d+)(?:ULL|U|LL)?\b"
    return {m[1]: int(m[2], 0) for m in re.finditer(pattern, text, re.M)}


# -- the header and layout.py agree -------------------------------------------------------

def test_header_defines_agree_with_layout() -> None:
    d = _defines()
    for name in ("MAGIC", "LAYOUT_VERSION", "HEADER_BYTES", "ALIGN", "STATE_READY",
                 "TS_SHIFT", "TS_UNIT_NS", "INC_BITS", "INC_SHIFT", "INC_MASK", "LEFT_BIT",
                 "TS39_MASK", "TS40_MASK", "GEN_BITS", "GEN_SHIFT", "GEN_MASK", "CODE_SHIFT",
                 "CODE_MASK", "RTT_MASK", "KEY_BYTES", "ENDPOINTS_BYTES", "ADDR_BYTES",
                 "PATH_BYTES", "MAX_ENDPOINTS"):
        assert d.pop(f"SHMHB_{name}") == getattr(L, name), name
    sections = {"HDR": L.HEADER_DTYPE, "SLOT": L.SLOT_WORDS_DTYPE, "REC": L.SLOT_RECORD_DTYPE,
                "PEER": L.PEER_ROW_DTYPE, "REMOTE": L.REMOTE_ROW_DTYPE, "WATCH": L.WATCH_ROW_DTYPE}
    for prefix, dt in sections.items():
        if prefix != "HDR":
            assert d.pop(f"SHMHB_{prefix}_BYTES") == dt.itemsize, prefix
        for field, (_, off) in dt.fields.items():  # type: ignore[misc]
            assert d.pop(f"SHMHB_{prefix}_{field.upper()}") == off, (prefix, field)
    for st in Status:
        assert d.pop(f"SHMHB_STATUS_{st.name}") == st.code, st
    # nothing in the header that layout.py does not have (a renamed or dropped field)
    assert not d, f"defines with no counterpart in layout.py: {sorted(d)}"


def test_memo_slots_agree_with_localreads() -> None:
    """Board.slot()'s per-key memo is a list read by position on both sides: the slots
    _native.c names (SHMHB_MEMO_*) are those shmhb/board/localreads.py names (MEMO_*)."""
    from shmhb.board import localreads

    with open(os.path.join(ROOT, "shmhb", "_native.c")) as f:
        text = f.read()
    c = {m[1]: int(m[2]) for m in re.finditer(r"^#define SHMHB_(MEMO_[A-Z]+) (\d+)\b", text, re.M)}
    py = {n: v for n, v in vars(localreads).items() if n.startswith("MEMO_")}
    assert c and c == py
    assert sorted(v for n, v in py.items() if n != "MEMO_SLOTS") == list(range(py["MEMO_SLOTS"]))


# -- the C rule is the Python rule ----------------------------------------------------------

def _words(rng: random.Random, now: int) -> list[int]:
    """Interesting words near ``now``: each bit field at its edges, plus noise."""
    incs = [1, 2, L.INC_MASK, rng.getrandbits(24) or 1]
    tss = [0, 1, now, now - 1, now + 1, now - 3, now - 12, now + 5, L.TS39_MASK,
           rng.getrandbits(39)]
    out = [0, (1 << 64) - 1, rng.getrandbits(64)]
    for _ in range(8):
        out.append(L.pack_hb(rng.choice(incs), rng.choice(tss) & L.TS39_MASK, rng.random() < 0.2))
    return out


def test_c_judging_matches_python_bit_for_bit() -> None:
    ext = _ext()
    rng = random.Random(1234)
    n = 0
    for _ in range(400):
        now = rng.choice([0, 5, 1 << 20, rng.getrandbits(39), L.TS39_MASK])
        th = J.Thresholds(rng.choice([0, 1, 2, 3]), rng.choice([1, 4, 10, 1 << 40]), 3, 2, 5)
        words = _words(rng, now)
        for hb in words:
            for v in words[:6] + [L.pack_verdict(hb >> L.INC_SHIFT, now)]:
                st, age = J.judge_local(hb, v, now, th)
                got = ext.judge_local(hb, v, now, th.suspect, th.dead)
                assert got == (st.code, age), (hb, v, now, th)
                n += 1
            ok = rng.random() < 0.7
            gen = rng.choice([hb >> L.GEN_SHIFT, rng.getrandbits(20), 0])
            row = J.judge_row(hb, gen, ok, now)
            assert ext.judge_row(hb, gen, ok, now) == (None if row is None else (row[0].code, row[1]))
            assert ext.agent_fresh(hb, now, th.agent_stale) == J.agent_fresh(hb, now, th)
    for reported in Status:
        for host in Status:
            assert ext.combine_remote(reported.code, host.code) == J.combine_remote(reported, host).code
    assert n > 10_000


def test_c_record_checksum_matches_python() -> None:
    ext = _ext()
    rng = random.Random(99)
    recs = np.zeros(200, L.SLOT_RECORD_DTYPE)
    for k, rec in enumerate(recs):
        for f in ("incarnation", "pid", "pid_start", "pid_ns", "registered_ns"):
            rec[f] = rng.getrandbits(64)
        klen = [0, 1, 63, rng.randrange(64)][k % 4]
        rec["key"] = bytes(rng.randrange(1, 256) for _ in range(klen))
        elen = [0, 255, 128, rng.randrange(256)][k % 4]  # 128 + the other fields: > one block
        rec["endpoints"] = bytes(rng.randrange(1, 256) for _ in range(elen))
        assert ext.record_checksum(rec.tobytes()) == L.record_checksum(rec), k


# -- the two paths read the same board alike ------------------------------------------------

def _pair(monkeypatch: pytest.MonkeyPatch, board_name: str, clock: FakeClock, **create: Any
          ) -> tuple[shmhb.Board, shmhb.Board]:
    _ext()
    use_hot_path(monkeypatch, "native")
    nat = shmhb.Board.create(board_name, slots=8, clock=clock, **create)
    use_hot_path(monkeypatch, "pure")
    pure = shmhb.Board.attach(board_name, clock=clock)
    assert nat.native and not pure.native
    return nat, pure


def _same(a: Any, b: Any) -> None:
    """Equal, and their floats equal bit for bit."""
    assert a == b
    if a is not None:
        for x, y in zip(a, b):
            if isinstance(x, float):
                assert struct.pack("<d", x) == struct.pack("<d", y)


def test_both_paths_judge_local_slots_alike(monkeypatch: pytest.MonkeyPatch, board_name: str) -> None:
    clock = FakeClock()
    nat, pure = _pair(monkeypatch, board_name, clock, suspect_after_s=0.5, dead_after_s=1.5)
    try:
        hb = nat.register("w", endpoints=("127.0.0.1:7001",), agent=False)
        assert type(hb.beat).__name__ == "builtin_function_or_method"  # the C beat
        seen = []
        for step in range(40):  # through ALIVE, SUSPECT and DEAD by age, beats in between
            clock.advance(0.07 * (step % 7))
            if step % 9 == 0:
                hb.beat()
            a, b = nat.slot("w"), pure.slot("w")
            _same(a, b)
            assert nat.status("w") is pure.status("w") is a.status  # type: ignore[union-attr]
            assert nat.changes() == pure.changes()
            idx = np.array([hb.index], np.intp)
            assert board_words(nat).oldest_beat_age(idx) == board_words(pure).oldest_beat_age(idx)
            seen.append(a.status)  # type: ignore[union-attr]
        assert {Status.ALIVE, Status.SUSPECT, Status.DEAD} <= set(seen)
        hb.beat()
        # a verdict on this incarnation (the agent's word), then on an older one
        q, vi = nat._q, nat._hb0 + hb.index * 8 + 1
        q[vi] = L.pack_verdict(hb.incarnation, clock.monotonic_ns() >> L.TS_SHIFT)
        _same(nat.slot("w"), pure.slot("w"))
        assert nat.slot("w").status is Status.DEAD  # type: ignore[union-attr]
        q[vi] = L.pack_verdict(hb.incarnation - 1, 0)
        _same(nat.slot("w"), pure.slot("w"))
        assert nat.slot("w").status is Status.ALIVE  # type: ignore[union-attr]
        hb.close()
        _same(nat.slot("w"), pure.slot("w"))
        assert pure.slot("w").status is Status.LEFT  # type: ignore[union-attr]
        hb2 = pure.register("w", agent=False)  # the other path registers anew, same slot
        assert hb2.incarnation != hb.incarnation
        for _ in range(3):
            hb2.beat()
            clock.advance(0.3)
            _same(nat.slot("w"), pure.slot("w"))
        assert nat.slot("w").incarnation == hb2.incarnation  # type: ignore[union-attr]
        assert nat.slot("nobody") is None and pure.slot("nobody") is None
        hb2.close()
    finally:
        pure.close()
        nat.close()


def test_both_paths_judge_remote_slots_alike(monkeypatch: pytest.MonkeyPatch, board_name: str) -> None:
    clock = FakeClock()
    nat, pure = _pair(monkeypatch, board_name, clock)
    try:
        w = RowWriter(nat)
        q, ai = nat._q, board_words(nat).agent_hb_index

        def agent_beat() -> None:
            q[ai] = L.pack_hb(1, clock.monotonic_ns() >> L.TS_SHIFT)

        def both(ep: str) -> Any:
            a, b = nat.remote(ep), pure.remote(ep)
            _same(a, b)
            return a

        ep = "10.0.0.2:30003"
        agent_beat()
        assert both(ep) is None
        p, pgen = w.new_peer("10.0.0.2:45645")  # type: ignore[misc]
        w.peer_status(p, pgen, Status.ALIVE, clock.monotonic_ns())
        held = w.put_remote(p, pgen, None, DigestEntry("r0", 11, Status.ALIVE.code, 42, 0, (ep,)),
                            clock.monotonic_ns())
        assert held is not None
        s = both(ep)
        assert s.status is Status.ALIVE and s.incarnation == 11
        s = both(ep)  # the memo: same words, same clock unit, the very same object
        assert nat.remote(ep) is nat.remote(ep) and pure.remote(ep) is pure.remote(ep)
        clock.advance(0.5)
        assert both(ep).age_s > s.age_s
        w.peer_status(p, pgen, Status.SUSPECT, clock.monotonic_ns() - 10**9)
        assert both(ep).status is Status.SUSPECT
        clock.advance(2.0)  # the agent goes stale: nobody observes, so UNKNOWN
        assert both(ep).status is Status.UNKNOWN
        agent_beat()
        w.peer_status(p, pgen, Status.DEAD, clock.monotonic_ns() - 6 * 10**9)
        assert both(ep).status is Status.DEAD
        w.peer_status(p, pgen, Status.ALIVE, clock.monotonic_ns())
        held = w.put_remote(p, pgen, held, DigestEntry("r0", 12, Status.ALIVE.code, 43, 0, (ep,)),
                            clock.monotonic_ns())  # a restart: the row is rewritten
        assert both(ep).incarnation == 12
        w.remote_status(held, Status.LEFT.code, clock.monotonic_ns())  # type: ignore[arg-type]
        assert both(ep).status is Status.LEFT
        w.free_remote(held[0])  # type: ignore[index]
        assert both(ep) is None
    finally:
        pure.close()
        nat.close()


# -- hot-path behaviour, on each path -------------------------------------------------------

def test_slot_memo_answers_until_a_word_or_the_clock_unit_moves(hot_path: str, board_name: str) -> None:
    clock = FakeClock()
    b = shmhb.Board.create(board_name, slots=4, clock=clock)
    try:
        assert b.native is (hot_path == "native")
        hb = b.register("m", agent=False)
        first = b.slot("m")
        assert first is not None and first.status is Status.ALIVE
        assert b.slot("m") is b.slot("m")  # nothing moved: the same object
        clock.advance(L.TS_UNIT_NS / 1e9)
        moved = b.slot("m")
        assert moved is not first and moved.age_s == L.TS_UNIT_NS / 1e9  # type: ignore[union-attr]
        hb.beat()
        beat = b.slot("m")
        assert beat is not moved and beat.age_s == 0.0  # type: ignore[union-attr]
        hb.close()
        assert b.slot("m").status is Status.LEFT  # type: ignore[union-attr]
        with pytest.raises(shmhb.HeartbeatClosed):
            hb.beat()
    finally:
        b.close()


def test_beat_uses_the_real_clock(hot_path: str, board_name: str) -> None:
    import time

    b = shmhb.Board.create(board_name, slots=4)
    try:
        hb = b.register("c", agent=False)
        t0 = time.monotonic_ns() >> L.TS_SHIFT
        hb.beat()
        w = b._q[b._hb0 + hb.index * 8]
        t1 = time.monotonic_ns() >> L.TS_SHIFT
        assert w >> L.INC_SHIFT == L.inc_tag(hb.incarnation) and not w & L.LEFT_BIT
        assert t0 <= w & L.TS39_MASK <= t1
        assert board_words(b).oldest_beat_age(np.array([hb.index], np.intp)) in (0, 1)
        assert board_words(b).oldest_beat_age(np.array([], np.intp)) is None
        if hot_path == "native":
            with pytest.raises(IndexError):
                board_words(b).oldest_beat_age(np.array([4], np.intp))
        hb.close()
    finally:
        b.close()


@pytest.mark.system
def test_pure_python_env_forces_the_fallback(board_name: str) -> None:
    code = "import shmhb; print(shmhb.native)"
    env = child_env(SHMHB_PURE_PYTHON="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr
    env.pop("SHMHB_PURE_PYTHON")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    try:
        importlib.import_module("shmhb._native")
        built = True
    except ImportError:
        built = False
    assert out.stdout.strip() == str(built), out.stderr
    b = shmhb.Board.create(board_name, slots=4)
    try:
        for pure in ("1", ""):
            env["SHMHB_PURE_PYTHON"] = pure
            out = subprocess.run([sys.executable, "-m", "shmhb", "status", "--json", "--board",
                                  board_name], env=env, capture_output=True, text=True)
            assert json.loads(out.stdout)["native"] is (built and not pure), out.stderr
    finally:
        b.close()


# -- a C program reads a board written by Python ----------------------------------------------

def _compile(tmp_path: Any) -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        pytest.skip("no C compiler")
    exe = str(tmp_path / "board_status")
    base = [cc, "-std=c99", "-O2", "-Wall", "-Werror", "-I", shmhb.get_include(), EXAMPLE_C, "-o", exe]
    for extra in ([], ["-lrt"]):
        r = subprocess.run(base + extra, capture_output=True, text=True)
        if r.returncode == 0:
            return exe
    pytest.skip(f"the C compiler {cc} could not build the example: {r.stderr[-500:]}")


def test_c_reader_prints_what_status_json_prints(board: shmhb.Board, procs: Procs, agent: Any,
                                                 tmp_path: Any) -> None:
    exe = _compile(tmp_path)
    procs.worker(board.name, "alive-1")
    victim = procs.worker(board.name, "killed")
    left = board.register("left-\"quoted\" ключ", agent=False)
    left.close()
    wait_until(lambda: board.slot("killed") is not None, what="the victim's slot")
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    wait_until(lambda: board.status("killed") is Status.DEAD, what="DEAD via the agent")

    def statuses(doc: dict[str, Any]) -> tuple[Any, ...]:
        slots = sorted((s["key"], s["pid"], s["incarnation"], s["status"]) for s in doc["slots"])
        return tuple(slots), doc["pinger"]["status"], doc["pinger"]["term"]

    env = child_env()
    c = subprocess.run([exe, board.name], capture_output=True, text=True)
    py = subprocess.run([sys.executable, "-m", "shmhb", "status", "--json", "--board", board.name],
                        capture_output=True, text=True, env=env)
    got, want = statuses(json.loads(c.stdout)), statuses(json.loads(py.stdout))
    assert got == want
    assert {s[3] for s in got[0]} == {"alive", "dead", "left"} and got[1] == "alive"
    assert c.returncode == py.returncode == 1  # a dead slot: unhealthy, for both


# -- packaging: the extension is optional ----------------------------------------------------

@pytest.mark.system
@pytest.mark.slow
@pytest.mark.parametrize("cc", ["false", None])
def test_build_with_and_without_a_compiler(tmp_path: Any, cc: str | None) -> None:
    """``CC=false`` (no working compiler): the build still succeeds, without the
    extension but with the header as package data; with the compiler (where there is
    one) it carries both.  (``pip install .`` runs this same setuptools build.)"""
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("no setuptools")
    if cc is None and not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler")
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "*.so", "__pycache__", "bench", "tests",
        "docs", "examples", "packaging"))
    env = dict(os.environ)
    if cc is not None:
        env["CC"] = cc
    r = subprocess.run([sys.executable, "setup.py", "-q", "build", "--build-base", "b"],
                       cwd=src, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    (lib,) = (src / "b").glob("lib*")
    assert (lib / "shmhb" / "include" / "shmhb.h").is_file()
    built = list((lib / "shmhb").glob("_native*.so"))
    assert bool(built) is (cc is None), (built, r.stderr[-2000:])
    if cc is not None:
        assert "_native" in r.stderr and "failed" in r.stderr  # said so, and went on
