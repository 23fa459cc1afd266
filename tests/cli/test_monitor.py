"""The ``shmhb status`` table and the ``shmhb monitor`` live view: rendered into captured
rich consoles and checked for content, then driven in a real terminal (tmux)."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest
from rich.console import Console

import shmhb
from shmhb import AgentStatus, PeerStatus, SlotStatus, Status
from shmhb.agent.role import Agent
from shmhb.cli.events import EventLog
from shmhb.testing.loopback import child_env
from shmhb.cli.monitor import (
    fmt_age,
    local_table,
    monitor_renderable,
    print_status,
    run_monitor,
    status_text,
)
from shmhb.cli.view import View, read_view

from ..children import child
from ..conftest import ROOT, Procs, pids_with_cmdline, wait_until
from ..fakes import FakePinger

A, S, D, L, U = Status.ALIVE, Status.SUSPECT, Status.DEAD, Status.LEFT, Status.UNKNOWN


#: conftest's board with slow suspicion (5 s): these tests are not about hangs
pytestmark = pytest.mark.slow_suspicion


def synthetic_view() -> View:
    slots = tuple(SlotStatus(f"rank-{i}", 1000 + i, 10 + i, [A, S, D, L][i % 4], 0.004 * i,
                             (f"10.0.0.1:{30000 + i}",)) for i in range(16))
    peers = (
        PeerStatus("10.0.0.2:45645", A, 0.25, 0.05, [
            SlotStatus("decode-0", 501, 3, A, 0.05, ("10.0.0.2:31000",)),
            SlotStatus("decode-1", 502, 4, D, 0.05, ("10.0.0.2:31001",))]),
        PeerStatus("10.0.0.3:45645", S, None, 1.5, [
            SlotStatus("prefill-0", 601, 1, S, 1.5, ("10.0.0.3:32000",))]),
    )
    return View(time.time(), slots, AgentStatus(4242, A, 0.012, 3), peers, "shmhb-x", True,
                {"bad_auth": 2, "bad_magic": 0, "bad_replay": 5, "loop_late": 1,
                 "deaths_seen": 7, "pings_sent": 90, "acks_received": 88}, 0.4)


def capture(width: int = 140, height: int = 50, color: bool = False) -> Console:
    return Console(file=io.StringIO(), record=True, width=width, height=height,
                   force_terminal=color, color_system="standard" if color else None)


def test_age_formatting() -> None:
    assert [fmt_age(x) for x in (None, 0.0123, 3.44, 125, 7300)] == [
        "-", "12 ms", "3.4 s", "2m05s", "2h01m"]


def test_status_table_has_local_and_remote_rows() -> None:
    c = capture()
    print_status(synthetic_view(), c)
    out = c.export_text()
    lines = out.splitlines()
    assert lines[0].startswith("agent pid 4242 alive") and "term 3" in lines[0]
    row = next(ln for ln in lines if ln.startswith("rank-2 "))
    assert row.split()[:6] == ["rank-2", "dead", "1002", "12", "8", "ms"]
    assert "10.0.0.1:30002" in row
    # natural order is the view's business; the table keeps the order it is given
    assert [ln.split()[0] for ln in lines if ln.startswith("rank-")][:3] == ["rank-0", "rank-1", "rank-2"]
    host = next(ln for ln in lines if ln.startswith("@10.0.0.2:45645"))
    assert "alive" in host and "0.25 ms" in host and "2 workers" in host
    dec1 = next(ln for ln in lines if ln.strip().startswith("decode-1"))
    assert dec1.split()[:4] == ["decode-1", "dead", "502", "4"]
    host3 = next(ln for ln in lines if ln.startswith("@10.0.0.3:45645"))
    assert "suspect" in host3 and "1.5 s" in host3 and " - " in host3  # no RTT yet


def test_statuses_are_coloured() -> None:
    assert {st: status_text(st).style for st in Status} == {
        A: "bold green", S: "bold yellow", D: "bold red", L: "blue", U: "bold magenta"}
    c = capture(color=True)
    print_status(synthetic_view(), c)
    raw = c.file.getvalue()  # type: ignore[attr-defined]
    assert "\x1b[1;31mdead" in raw and "\x1b[1;32malive" in raw and "\x1b[1;33msuspect" in raw


def test_empty_board_and_no_agent() -> None:
    c = capture()
    print_status(View(0.0, board="b"), c)
    out = c.export_text()
    assert "no worker has registered" in out
    assert "remote hosts: none followed" in out
    assert "none has run on this board" in out


def test_live_view_frame_has_every_part() -> None:
    v = synthetic_view()
    log = EventLog()
    log.update(View(v.t - 1, board="shmhb-x"))
    log.update(v)
    c = capture(width=150, height=60)
    c.print(monitor_renderable(v, log.recent, 4.0, 60, 150))
    out = c.export_text()
    assert out.startswith("shmhb monitor")
    head = out.splitlines()[0]
    assert "board shmhb-x" in head and "4 alive 4 suspect 4 dead 4 left" in head and "hosts: 2" in head
    for needle in ("rank-15", "@10.0.0.2:45645", "decode-1", "prefill-0", "0.25 ms",
                   "pinger", "holder", "pid 4242", "lateness", "0.4 ms", "bad frames", "auth",
                   "replay", "deaths seen", "90/88", "events", "host_added", "host_suspect"):
        assert needle in out, needle
    assert " magic " not in out  # zero counters are not listed one by one
    assert len(out.splitlines()) == 60  # full screen, no more


def test_live_view_shows_the_newest_events_when_they_overflow() -> None:
    v = synthetic_view()
    log = EventLog(keep=1000)
    log.update(View(v.t - 1, board="shmhb-x"))
    for k in range(40):
        log.update(View(v.t + k, (SlotStatus("flap", 1, 1, [A, S][k % 2], 0.0, ()),), v.agent,
                        board="shmhb-x"))
    c = capture(width=120, height=30)
    c.print(monitor_renderable(log.last, log.recent, 4.0, 30, 120))  # type: ignore[arg-type]
    out = c.export_text()
    shown = [ln for ln in out.splitlines() if "flap" in ln and ("hung" in ln or "recovered" in ln)]
    assert shown and len(shown) < 40
    last = log.recent[-1]
    assert last.kind.value == "hung"  # k = 39: suspect
    assert last.time_str(date=False) in shown[-1] and "hung" in shown[-1]


def test_a_narrow_terminal_stacks_the_pinger_box_below() -> None:
    v = synthetic_view()
    c = capture(width=80, height=70)
    c.print(monitor_renderable(v, [], 4.0, 70, 80))
    out = c.export_text()
    lines = out.splitlines()
    assert len(lines) == 70 and max(len(ln) for ln in lines) <= 80
    top = next(i for i, ln in enumerate(lines) if "pinger" in ln and ln.startswith("\u256d"))
    assert top > next(i for i, ln in enumerate(lines) if ln.startswith("rank-15"))
    assert "no events yet" in out


def test_local_table_truncates_nothing_it_needs() -> None:
    v = View(0.0, (SlotStatus("k" * 63, 1, 1, A, 0.0, ("h" * 50 + ":1",)),), board="b")
    c = capture(width=200)
    c.print(local_table(v), soft_wrap=True)
    assert "k" * 63 in c.export_text()


# -- real boards -------------------------------------------------------------------------------


def _status(name: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shmhb", "status", "--board", name, *extra],
                          capture_output=True, text=True, timeout=60,
                          env=child_env())


def test_status_command_exit_code_and_remote_hosts(board: shmhb.Board, procs: Procs,
                                                   local_agent: Agent) -> None:
    for k in range(3):
        procs.worker(board.name, f"rank-{k}", endpoints=f"127.0.0.1:{30000 + k}")
    FakePinger(board).host(0, "10.9.0.2:45645", A, 0.31,
                           [("decode-0", 77, 5, A, ["10.9.0.2:31000"])])
    out = _status(board.name)
    assert out.returncode == 0, out.stdout + out.stderr
    for needle in ("rank-0", "rank-2", "127.0.0.1:30001", "@10.9.0.2:45645", "0.31 ms",
                   "decode-0", f"agent pid {os.getpid()} alive"):
        assert needle in out.stdout, needle
    assert "\x1b[" not in out.stdout  # no colour codes into a pipe
    doc = json.loads(_status(board.name, "--json").stdout)
    assert set(doc) >= {"board", "slots", "pinger", "peers"}
    assert set(doc["slots"][0]) == {"key", "pid", "incarnation", "status", "age_s", "endpoints"}
    assert doc["peers"][0]["address"] == "10.9.0.2:45645"
    assert set(doc["peers"][0]) == {"address", "status", "rtt_ms", "age_s", "auth_failing",
                                    "auth_failures", "rows_capped", "slots"}
    procs.procs[1].kill()
    wait_until(lambda: (s := board.slot("rank-1")) and s.status is D)
    out = _status(board.name)
    assert out.returncode == 1
    assert next(ln for ln in out.stdout.splitlines() if ln.startswith("rank-1")).split()[1] == "dead"
    assert _status(board.name, "--json").returncode == 1


@pytest.mark.system
def test_status_command_on_a_missing_board() -> None:
    out = _status(f"shmhb-test-missing-{uuid.uuid4().hex[:8]}")
    assert out.returncode == 2 and "no board" in out.stderr


@pytest.mark.system
def test_monitor_command_wants_a_terminal(board: shmhb.Board) -> None:
    out = subprocess.run([sys.executable, "-m", "shmhb", "monitor", "--board", board.name],
                         capture_output=True, text=True, timeout=60,
                         env=child_env())
    assert out.returncode == 2 and "needs a terminal" in out.stderr and not out.stdout


@pytest.mark.system  # it starts processes (tests/tiers.py)
def test_monitor_interrupted_by_ctrl_c_exits_130(board: shmhb.Board) -> None:
    # on a pseudo-terminal, as an operator runs it; Ctrl-C is SIGINT to its process
    master, slave = os.openpty()
    try:
        p = subprocess.Popen([sys.executable, "-m", "shmhb", "monitor", "--board", board.name],
                             stdin=slave, stdout=slave, stderr=slave, env=child_env(),
                             start_new_session=True)
        os.close(slave)
        slave = -1
        seen = bytearray()
        deadline = time.monotonic() + 60
        while b"board" not in seen and p.poll() is None and time.monotonic() < deadline:
            if select.select([master], [], [], 1.0)[0]:
                try:
                    seen += os.read(master, 65536)  # drawn: its handler is set up by now
                except OSError:
                    break
        assert b"board" in seen, seen[-2000:]
        p.send_signal(signal.SIGINT)
        wait_until(lambda: p.poll() is not None, timeout_s=30, what="monitor exits")
        assert p.returncode == 130
    finally:
        if slave >= 0:
            os.close(slave)
        os.close(master)
        if p.poll() is None:
            p.kill()
            p.wait()


def test_run_monitor_paces_its_frames(board: shmhb.Board, procs: Procs, local_agent: Agent) -> None:
    procs.worker(board.name, "w")
    c = capture()
    t0 = time.monotonic()
    assert run_monitor(board, refresh_hz=20, console=c, max_frames=4) == 0
    assert time.monotonic() - t0 >= 0.14  # 4 frames at 20 Hz: 3 periods between them


def test_view_reads_remote_rows_in_natural_order(board: shmhb.Board, local_agent: Agent) -> None:
    FakePinger(board).host(0, "10.9.0.2:45645", A, 0.5,
                           [(f"d-{k}", 70 + k, 1 + k, A, [f"10.9.0.2:{31000 + k}"]) for k in (10, 2, 1)])
    v = read_view(board)
    assert [s.key for s in v.peers[0].slots] == ["d-1", "d-2", "d-10"]
    assert v.agent_held and v.agent.status is A and v.board == board.name


# -- a real terminal ------------------------------------------------------------------------------


def _proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_monitor_in_a_real_terminal(board: shmhb.Board, procs: Procs, local_agent: Agent) -> None:
    workers = [procs.worker(board.name, f"rank-{k}") for k in range(4)]
    sock = f"shmhb-test-{uuid.uuid4().hex[:8]}"
    tmux = ["tmux", "-L", sock]
    cmd = (f"env PYTHONPATH={ROOT} TERM=xterm-256color {sys.executable} -m shmhb monitor "
           f"--board {board.name} --refresh-hz 10")

    def pane() -> str:
        r = subprocess.run(tmux + ["capture-pane", "-p", "-t", "mon"], capture_output=True,
                           text=True, timeout=30)
        return r.stdout

    def monitor_pid() -> int:
        def cmdline(pid: int) -> str:
            with open(f"/proc/{pid}/cmdline") as f:
                return f.read()

        pids = [p for p in pids_with_cmdline(f"monitor --board {board.name}")
                if "tmux" not in cmdline(p)]
        assert len(pids) == 1, pids
        return pids[0]

    try:
        subprocess.run(tmux + ["-f", "/dev/null", "new-session", "-d", "-s", "mon", "-x", "130",
                               "-y", "40", cmd], check=True, timeout=30)
        # the first frame may predate tmux sizing the window: wait for the full layout
        wait_until(lambda: all(s in pane() for s in ("shmhb monitor", "rank-3", "pinger",
                                                      "events", "registered")),
                   timeout_s=30, poll_s=0.05, what="the live view on screen")
        workers[2].kill()
        wait_until(lambda: any(ln.startswith("rank-2 ") and " dead " in ln
                               for ln in pane().splitlines()),
                   poll_s=0.05, what="rank-2 dead in the table")
        wait_until(lambda: "died" in pane() and "rank-2 pid" in pane(), poll_s=0.05,
                   what="the died event")
        screen = pane()
        assert screen.count("shmhb monitor") == 1  # redrawn in place, not scrolled
        pid = monitor_pid()
        c0, t0 = _proc_cpu_s(pid), time.monotonic()
        wait_until(lambda: time.monotonic() - t0 > 2.0, poll_s=0.1)
        share = (_proc_cpu_s(pid) - c0) / (time.monotonic() - t0)
        assert share < 0.5, f"monitor used {share:.0%} of a core at 10 Hz"
        subprocess.run(tmux + ["send-keys", "-t", "mon", "C-c"], check=True, timeout=30)
        wait_until(lambda: subprocess.run(tmux + ["has-session", "-t", "mon"],
                                          capture_output=True, timeout=30).returncode != 0,
                   timeout_s=20, poll_s=0.05, what="the monitor to exit on Ctrl-C")
    finally:
        subprocess.run(tmux + ["kill-server"], capture_output=True, timeout=30)


# -- small terminals ---------------------------------------------------------------------------


def _real_incarnations(v: View) -> View:
    """The synthetic view with 16-digit incarnations, as boards make them."""
    return View(v.t, tuple(s._replace(incarnation=1796053474000001 + s.incarnation) for s in v.slots),
                v.agent, v.peers, v.board, v.agent_held, v.stats, v.lateness_ms)


@pytest.mark.parametrize("width,height", [(80, 24), (100, 30)])
def test_small_terminal_shows_unhealthy_first_and_counts_the_rest(width: int, height: int) -> None:
    v = _real_incarnations(synthetic_view())
    log = EventLog()
    log.update(View(v.t - 1, board="shmhb-x"))
    log.update(v)
    c = capture(width=width, height=height)
    c.print(monitor_renderable(v, log.recent, 4.0, height, width))
    lines = c.export_text().splitlines()
    assert len(lines) == height and max(len(ln) for ln in lines) <= width
    rows = [ln.split()[:2] for ln in lines if ln.startswith("rank-")]
    shown = [st for _, st in rows]
    # every row shown before the first healthy one is unhealthy, dead before suspect
    assert shown and shown[0] == "dead"
    assert shown == sorted(shown, key=["dead", "suspect", "alive", "left"].index) or \
        all(st in ("dead", "suspect") for st in shown)
    more = [ln for ln in lines if ln.startswith("+") and "more local" in ln]
    assert len(more) == 1
    hidden = int(more[0].split()[0][1:])
    assert hidden + len(rows) == 16  # nothing vanishes uncounted
    # the remote dead worker is shown, under its host
    i = next(k for k, ln in enumerate(lines) if ln.strip().startswith("decode-1"))
    assert " dead " in lines[i] and lines[i - 1].startswith("@10.0.0.2:45645")
    # the pinger panel is folded, not gone; the remote age column says what it is
    assert any("pinger" in ln and ln.startswith("\u256d") for ln in lines)
    assert any("deaths seen 7" in ln for ln in lines) and any("SEEN" in ln for ln in lines)
    assert any(ln.startswith("\u256d\u2500 events") for ln in lines)


def test_a_too_narrow_table_names_the_columns_it_hides() -> None:
    v = _real_incarnations(synthetic_view())
    c = capture(width=60, height=40)
    c.print(monitor_renderable(v, [], 4.0, 40, 60))
    out = c.export_text()
    assert "(INC hidden: too narrow)" in out
    assert "1796053474" not in out and "10.0.0.1:30002" in out


def test_at_80_columns_the_hidden_columns_note_and_at_start_stay_in_view() -> None:
    v = _real_incarnations(synthetic_view())
    log = EventLog()
    log.update(v)  # the first read: every event is marked "at start"
    for width, height in ((80, 24), (60, 40)):
        c = capture(width=width, height=height)
        c.print(monitor_renderable(v, log.recent, 4.0, height, width))
        lines = c.export_text().splitlines()
        title = next(ln for ln in lines if ln.startswith("remote hosts")).rstrip()
        if "hidden" in title or width == 60:
            assert title.endswith("hidden: too narrow)"), title
        events = [ln for ln in lines if ln.startswith("\u2502 ") and "@10.0.0.3" in ln]
        assert events and all(ln[2:].startswith("at start") for ln in events), events


def test_a_table_that_fits_the_screen_is_not_squeezed_by_the_pinger_box() -> None:
    # four endpoints per rank: the local table needs ~100 columns, more than beside the
    # pinger box at 130, fewer than 130: the box goes below and every column shows
    v = synthetic_view()
    eps = tuple(f"10.0.0.1:{p}" for p in (30000, 30100, 30200, 30300))
    v = dataclasses.replace(v, slots=tuple(s._replace(endpoints=eps) for s in v.slots))
    c = capture(width=130, height=45)
    c.print(monitor_renderable(v, [], 4.0, 45, 130))
    out = c.export_text()
    assert "hidden: too narrow" not in out, out
    head = next(ln for ln in out.splitlines() if ln.startswith("KEY"))
    assert "INC" in head and "PID" in head


_MANY = child("many")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_monitor_at_80x24_shows_dead_rows_first_and_more_line(board: shmhb.Board, procs: Procs,
                                                               local_agent: Agent) -> None:
    """A real monitor in an 80x24 tmux pane: 12 healthy workers and two that get killed;
    the victims' keys sort last, so only unhealthy-first puts them on screen."""
    procs.program(_MANY, board.name, "12")
    victims = [procs.worker(board.name, f"zz-victim-{k}") for k in range(2)]
    sock = f"shmhb-test-{uuid.uuid4().hex[:8]}"
    tmux = ["tmux", "-L", sock]
    cmd = (f"env PYTHONPATH={ROOT} TERM=xterm-256color {sys.executable} -m shmhb monitor "
           f"--board {board.name} --refresh-hz 10")

    def pane() -> list[str]:
        r = subprocess.run(tmux + ["capture-pane", "-p", "-t", "mon"], capture_output=True,
                           text=True, timeout=30)
        return r.stdout.splitlines()

    try:
        subprocess.run(tmux + ["-f", "/dev/null", "new-session", "-d", "-s", "mon", "-x", "80",
                               "-y", "24", cmd], check=True, timeout=30)
        wait_until(lambda: any("more local" in ln for ln in pane()), timeout_s=30, poll_s=0.05,
                   what="the +N more line")
        assert not any(ln.startswith("zz-victim") for ln in pane())  # healthy, sorted last: hidden
        for v in victims:
            v.kill()

        def victims_dead_on_top() -> bool:
            rows = [ln for ln in pane() if ln.startswith(("rank-", "zz-victim"))]
            return len(rows) >= 2 and all(r.startswith("zz-victim") and " dead " in r for r in rows[:2])

        wait_until(victims_dead_on_top, timeout_s=20, poll_s=0.05, what="both victims dead, on top")
        screen = pane()
        more = next(ln for ln in screen if "more local" in ln)
        shown = sum(1 for ln in screen if ln.startswith(("rank-", "zz-victim")))
        assert int(more.split()[0].lstrip("+")) + shown == 14, screen
        assert any(ln.startswith("\u256d\u2500 pinger") for ln in screen), screen
        assert any(ln.startswith("\u256d\u2500 events") for ln in screen), screen
        assert max(len(ln) for ln in screen) <= 80
    finally:
        subprocess.run(tmux + ["kill-server"], capture_output=True, timeout=30)


def test_a_remote_workers_age_cell_is_its_own_beat_where_known() -> None:
    from shmhb.cli.monitor import REMOTE_COLUMNS, remote_beat

    hung = SlotStatus("r0", 1, 2, Status.DEAD, 0.1, ("b:1",), beat_age_s=12.5)
    assert remote_beat(hung) == "12.5 s"  # its own beat, not its host's last report (0.1 s)
    assert remote_beat(hung._replace(beat_age_s=None)) == "-"  # a v1 host told no beat
    assert remote_beat(SlotStatus("r1", 1, 2, Status.ALIVE, 0.1, ("b:2",))) == "fresh"
    assert [c for c, _ in REMOTE_COLUMNS].index("AGE") < [c for c, _ in REMOTE_COLUMNS].index("SEEN")
    assert hung.to_json()["beat_age_s"] == 12.5 and "beat_age_s" not in hung._replace(beat_age_s=None).to_json()
