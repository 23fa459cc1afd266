"""What an operator sees: the ``shmhb status`` table and the ``shmhb monitor`` live view.

Everything here renders ``View``s (``shmhb.cli.view``) with rich; nothing here reads the
board except ``run_monitor``, which reads it once per frame, lock-free.  The live view
redraws in place on the terminal's alternate screen (rich.live), so it never flickers,
and it renders at a fixed rate however fast the board changes: its cost does not grow
with the workers' beat rate.  Frames are composed line by line from styled ``Text``
(no rich Table or Layout, which measure and wrap every cell on every frame): about 5 ms
of CPU per frame for 16 workers, ~2-3% of a core at the default 4 Hz.
"""

from __future__ import annotations

import datetime as _dt
import logging
import threading
import time
from collections.abc import Iterable, Sequence

from rich.console import Console, RenderableType
from rich.live import Live
from rich.text import Text

from ..board.handle import Board
from .events import Event, EventLog
from .pipes import PipeConsole
from ..board.records import shown
from ..status import PeerStatus, SlotStatus, Status
from .screen import (
    NEWLINE,
    STATUS_STYLE,
    Columns,
    Lines,
    Row,
    Section,
    box,
    choose,
    fit,
    fmt_age,
    fmt_rtt,
    fold,
    status_text,
)
from .view import View, read_view

log = logging.getLogger(__name__)

_BLANK_LINE = Text("\n\n", no_wrap=True, overflow="ellipsis")  # no_wrap: see screen.NEWLINE

def _counts(slots: Iterable[SlotStatus]) -> Text:
    n: dict[Status, int] = {}
    for s in slots:
        n[s.status] = n.get(s.status, 0) + 1
    t = Text()
    for st in Status:
        if n.get(st):
            if t:
                t.append(" ")
            t.append(f"{n[st]} {st.value}", style=STATUS_STYLE[st])
    return t or Text("none", style="dim")


def agent_line(view: View) -> Text:
    """One line on the host agent: who holds the role and whether it is running."""
    a = view.agent
    t = Text("agent ", no_wrap=True, overflow="ellipsis")
    if a.status is Status.UNKNOWN:
        t.append("none has run on this board", style=STATUS_STYLE[Status.UNKNOWN])
        t.append(": deaths are not detected and remote verdicts read unknown")
        return t
    t.append(f"pid {a.pid or '-'} ")
    if a.status is Status.ALIVE and not view.agent_held:
        # its last beat is still fresh, but no process holds the role any more
        t.append("gone", style=STATUS_STYLE[Status.DEAD])
        t.append(f"  term {a.term}  beat {fmt_age(a.age_s)} ago  holder gone: waiting for a standby")
        return t
    t.append_text(status_text(a.status))
    holder = view.holder()
    if holder is not None:
        t.append("  daemon" if holder == "daemon" else "  embedded in a worker")
    t.append(f"  term {a.term}  beat {fmt_age(a.age_s)} ago")
    if a.status is Status.SUSPECT:
        t.append("  stalled: role still held" if view.agent_held
                 else "  holder gone: waiting for a standby", style=STATUS_STYLE[Status.SUSPECT])
    elif a.status is Status.LEFT:
        t.append("  released the role" + ("; a new holder is taking over" if view.agent_held else ""))
    if a.status is Status.ALIVE:
        t.append(f"  loop lateness {view.lateness_ms:.1f} ms")
    return t


def network_line(view: View) -> Text:
    """One line on the agent's network half: listening where, or why it is degraded."""
    n = view.network
    t = Text("network ", no_wrap=True, overflow="ellipsis")
    style = "bold red" if not n.working else "green" if n.state == "listening" else "dim"
    t.append(n.state, style=style)
    if n.listen:
        t.append(f" on {n.listen}")
    if n.state not in ("not configured", "unknown"):
        t.append(f"  auth {n.auth}")
    if n.reason:
        t.append(f"  {n.reason}", style="red")
    if n.skipped_hosts:
        t.append(f"  {n.skipped_hosts} host(s) skipped")
    if n.error:
        t.append(f"  {n.error}")
    return t


# Unhealthy first in the live view: what an operator must see when rows do not fit.
URGENCY: dict[Status, int] = {Status.DEAD: 0, Status.SUSPECT: 1, Status.UNKNOWN: 2}
_CALM = len(URGENCY)
LOCAL_COLUMNS = [("KEY", "left"), ("STATUS", "left"), ("PID", "right"), ("INC", "right"),
                 ("AGE", "right"), ("ENDPOINTS", "left")]
# SEEN: since the host's last report (ack or push) covered the row, for hosts and workers.
# AGE: a remote worker's own time since its last beat where its host's reports tell it
# (SlotStatus.beat_age_s: a worker reported stale); "fresh" for one reported alive (it beat
# within its host's suspect-after as of SEEN ago); "-" where nothing tells it.
REMOTE_COLUMNS = [("HOST / KEY", "left"), ("STATUS", "left"), ("PID", "right"), ("INC", "right"),
                  ("AGE", "right"), ("SEEN", "right"), ("RTT", "right"), ("ENDPOINTS", "left")]
DROPPABLE = ("INC", "PID", "RTT")  # what goes first on a narrow screen
REMOTE_TITLE = "remote hosts (AGE: the worker's own last beat; SEEN: since the host's last report)"


def _local_cells(s: SlotStatus) -> list[Text]:
    return [Text(shown(s.key)), status_text(s.status), Text(str(s.pid)), Text(str(s.incarnation)),
            Text(fmt_age(s.age_s)), Text(shown(", ".join(s.endpoints)))]


def _host_cells(p: PeerStatus) -> list[Text]:
    st = status_text(p.status)
    if p.auth_failing:  # its silence is no sign of death: the secrets differ
        st.append(" (auth fails)", style="bold red")
    return [Text(f"@{shown(p.address)}", style="bold"), st, Text(""), Text(""), Text(""),
            Text(fmt_age(p.age_s)), Text(fmt_rtt(p.rtt_ms)), Text(_workers(len(p.slots)), style="dim")]


def remote_beat(s: SlotStatus) -> str:
    """A remote worker's AGE cell: its own beat age where known (see REMOTE_COLUMNS)."""
    if s.beat_age_s is not None:
        return fmt_age(s.beat_age_s)
    return "fresh" if s.status is Status.ALIVE else "-"


def _remote_cells(s: SlotStatus) -> list[Text]:
    return [Text(f"  {shown(s.key)}"), status_text(s.status), Text(str(s.pid)),
            Text(str(s.incarnation)), Text(remote_beat(s)), Text(fmt_age(s.age_s)), Text(""),
            Text(shown(", ".join(s.endpoints)))]


def local_lines(view: View) -> list[Text]:
    """The local slots: key, status (coloured), pid, incarnation, age, endpoints."""
    title = f"local workers on board {view.board or '?'}"
    if not view.slots:
        return [Text(title, style="bold"), Text("no worker has registered", style="dim")]
    t = Columns(title, LOCAL_COLUMNS)
    for s in view.slots:
        t.add_row(*_local_cells(s))
    return t.lines()


def local_table(view: View) -> Text:
    return NEWLINE.join(local_lines(view))


def _workers(n: int) -> str:
    return f"{n} worker" + ("" if n == 1 else "s")


def remote_table(peers: Sequence[PeerStatus]) -> Text:
    return NEWLINE.join(remote_lines(peers))


def remote_lines(peers: Sequence[PeerStatus]) -> list[Text]:
    """The remote hosts this host's pinger follows, each followed by its workers."""
    if not peers:
        return [Text("remote hosts: none followed", style="dim")]
    t = Columns(REMOTE_TITLE, REMOTE_COLUMNS)
    for p in peers:
        t.add_row(*_host_cells(p))
        for s in p.slots:
            t.add_row(*_remote_cells(s))
    return t.lines()


def status_renderable(view: View) -> RenderableType:
    """What ``shmhb status`` prints: the agent line, local slots, remote hosts."""
    head = Text("\n").join([agent_line(view), network_line(view)])
    return _BLANK_LINE.join([head, local_table(view), remote_table(view.peers)])


def print_status(view: View, console: Console | None = None) -> None:
    """Print the status table; to a pipe or file, lines are never cut or wrapped."""
    console = console or PipeConsole()
    console.print(status_renderable(view), soft_wrap=not console.is_terminal)


# -- the live view -------------------------------------------------------------------------


def _urgency(st: Status) -> int:
    return URGENCY.get(st, _CALM)


def local_section(view: View) -> tuple[Section, list[Status]]:
    """The local rows, unhealthy first (dead, suspect, unknown), the rest in key order."""
    slots = sorted(view.slots, key=lambda s: _urgency(s.status))  # stable: keeps key order
    rows = [Row(_local_cells(s), _urgency(s.status)) for s in slots]
    return Section(rows), [s.status for s in slots]


def remote_section(peers: Sequence[PeerStatus]) -> tuple[Section, list[Status]]:
    """Hosts with anything unhealthy first, each followed by its workers (unhealthy
    first); a worker row needs its host row above it."""
    rows: list[Row] = []
    sts: list[Status] = []
    for p in sorted(peers, key=lambda p: min([_urgency(p.status), *(_urgency(s.status) for s in p.slots)])):
        h = len(rows)
        rows.append(Row(_host_cells(p), _urgency(p.status)))
        sts.append(p.status)
        for s in sorted(p.slots, key=lambda s: _urgency(s.status)):
            rows.append(Row(_remote_cells(s), _urgency(s.status), parent=h))
            sts.append(s.status)
    return Section(rows), sts


def _more(hidden: Sequence[Status], what: str) -> Text:
    n: dict[Status, int] = {}
    for st in hidden:
        n[st] = n.get(st, 0) + 1
    t = Text(f"+{len(hidden)} more {what}: ", style="bold")
    t.append(", ".join(f"{c} {st.value}" for st, c in sorted(n.items(), key=lambda kv: _urgency(kv[0]))))
    t.append("  (`shmhb status` lists all)", style="dim")
    return t


def worker_lines(view: View, width: int, budget: int, rule: bool = True) -> list[Text]:
    """The local and remote tables in at most ``budget`` lines of ``width`` cells:
    unhealthy rows are chosen first, rows that do not fit are counted on a ``+N more``
    line, columns that do not fit are named in the title."""
    loc, loc_st = local_section(view)
    rem, rem_st = remote_section(view.peers)
    fixed = 2 + (1 if rule else 0)
    loc.fixed_lines = fixed if view.slots else 2
    rem.fixed_lines = (fixed if view.peers else 1) + 1  # + the blank line between the tables
    picked = choose([loc, rem], budget)
    out: list[Text] = []
    if not view.slots:
        out += local_lines(view)
    else:
        t = Columns(f"local workers on board {view.board or '?'}", LOCAL_COLUMNS, DROPPABLE)
        for i in picked[0]:
            t.add_row(*loc.rows[i].cells)
        out += t.lines(width, rule)
        hidden = [loc_st[i] for i in range(len(loc.rows)) if i not in set(picked[0])]
        if hidden:
            out.append(_more(hidden, "local"))
    out.append(Text())
    if not view.peers:
        out += remote_lines(view.peers)
    else:
        t = Columns(REMOTE_TITLE, REMOTE_COLUMNS, DROPPABLE)
        for i in picked[1]:
            t.add_row(*rem.rows[i].cells)
        out += t.lines(width, rule)
        hidden = [rem_st[i] for i in range(len(rem.rows)) if i not in set(picked[1])]
        if hidden:
            out.append(_more(hidden, "remote rows"))
    return out


def tables_width(view: View) -> int:
    """The cells the local and remote tables take with every column shown."""
    need = 0
    for columns, section in ((LOCAL_COLUMNS, local_section(view)[0]),
                             (REMOTE_COLUMNS, remote_section(view.peers)[0])):
        t = Columns(None, columns)
        for r in section.rows:
            t.add_row(*r.cells)
        need = max(need, t.natural_width())
    return need


def _pinger_rows(view: View) -> list[tuple[str, str | Text]]:
    a = view.agent
    st = view.stats
    rows: list[tuple[str, str | Text]] = []
    holder = Text(f"pid {a.pid or '-'} ")
    holder.append_text(status_text(a.status))
    rows.append(("holder", holder))
    rows.append(("term", str(a.term)))
    rows.append(("role held", "yes" if view.agent_held else Text("no", style="bold red")))
    rows.append(("last beat", f"{fmt_age(a.age_s)} ago" if a.age_s is not None else "-"))
    rows.append(("network", network_line(view)[len("network "):]))
    rows.append(("lateness", f"{view.lateness_ms:.1f} ms"))
    rows.append(("late loops", str(st.get("loop_late", 0))))
    rows.append(("deaths seen", str(st.get("deaths_seen", 0))))
    rows.append(("pings/acks", f"{st.get('pings_sent', 0)}/{st.get('acks_received', 0)}"))
    rows.append(("answered", str(st.get("pings_answered", 0))))
    rows.append(("pushes", f"{st.get('pushes_sent', 0)} out/{st.get('pushes_received', 0)} in"))
    bad = view.bad_frames()
    total = sum(bad.values())
    rows.append(("bad frames", Text(str(total), style="bold red" if total else "")))
    rows.extend((f"  {reason}", Text(str(n), style="red")) for reason, n in bad.items() if n)
    return rows


def pinger_lines(view: View) -> list[Text]:
    """The agent role and the pinger's counters: holder, lateness, bad frames."""
    rows = _pinger_rows(view)
    w = max(len(k) for k, _ in rows)
    out = []
    for k, v in rows:
        line = Text(k.ljust(w) + " ", style="dim")
        line.append_text(v if isinstance(v, Text) else Text(v))
        out.append(line)
    return out


def pinger_chips(view: View) -> list[Text]:
    """The same counters as short "name value" pieces, to fold into a few lines."""
    out = []
    for k, v in _pinger_rows(view):
        chip = Text(k.strip() + " ", style="dim")
        chip.append_text(v if isinstance(v, Text) else Text(v))
        out.append(chip)
    return out


def event_text(e: Event) -> Text:
    # An event read off the board at the monitor's start happened at some time before:
    # said where the time goes, not at the end of the line, which a narrow screen cuts.
    when = e.time_str(date=False)
    t = Text(("at start".ljust(len(when)) if e.initial else when) + " ", style="dim")
    t.append(f"{e.kind.value:<14}", style=STATUS_STYLE[e.severity])
    t.append(" " + e.body())
    return t


def _header(view: View, refresh_hz: float, width: int = 200) -> Text:
    t = Text()
    t.append("shmhb monitor", style="bold reverse")
    now = _dt.datetime.fromtimestamp(view.t).strftime("%H:%M:%S")
    t.append(f"  board {view.board}  {now}  local: ")
    t.append_text(_counts(view.slots))
    t.append(f"  hosts: {len(view.peers)}  ")
    tail = f"{refresh_hz:g} Hz  Ctrl-C quits"
    if t.cell_len + len(tail) <= width:  # the counts matter more than the hint
        t.append(tail, style="dim")
    return t


EVENTS_MIN_ROWS = 6
EVENTS_MIN_ROWS_SMALL = 3
SMALL_HEIGHT = 30  # below: no rules under table headers, fewer event rows
PINGER_WIDTH = 34
WIDE = 120  # from here the pinger box stands beside the tables; narrower, it folds below


def monitor_renderable(view: View, events: Iterable[Event], refresh_hz: float = 4.0,
                       height: int = 40, width: int = 120) -> Lines:
    """The whole live screen for one frame, exactly ``height`` lines of ``width`` cells.

    Composed line by line (header and agent line; the tables with, on a wide screen,
    the pinger box beside them, or else the pinger's counters folded into a box below
    them; the events box, newest last) instead of with rich's Layout: the monitor
    redraws several times a second and this costs a fraction of it.  The tables get
    the lines they need up to what the other parts leave (see ``worker_lines``).
    """
    small = height < SMALL_HEIGHT
    right_w = PINGER_WIDTH if width >= WIDE else 0
    need = tables_width(view)
    if right_w and width - right_w - 1 < need <= width:
        right_w = 0  # beside the tables the pinger box would hide columns: below it hides none
    left_w = width - right_w - (1 if right_w else 0)
    below: list[Text] = []
    if not right_w:
        folded = fold(pinger_chips(view), width - 4)
        below = box("pinger", folded, width, len(folded) + 2)
    ev_rows = EVENTS_MIN_ROWS_SMALL if small else EVENTS_MIN_ROWS
    budget = max(1, height - 2 - len(below) - (ev_rows + 2))
    left = worker_lines(view, left_w, budget, rule=not small)
    pinger = pinger_lines(view)
    body_h = max(len(left), len(pinger) + 2 if right_w else 0)
    body_h = max(1, min(body_h, budget))
    right = box("pinger", pinger, right_w, body_h) if right_w else []
    lines = [fit(_header(view, refresh_hz, width), width), fit(agent_line(view), width)]
    for i in range(body_h):
        row = fit(left[i] if i < len(left) else Text(), left_w)
        if right_w:
            row.append(" ")
            row.append_text(right[i] if i < len(right) else Text(" " * right_w))
        lines.append(row)
    lines += below
    ev = [event_text(e) for e in events]
    if not ev:
        ev = [Text("no events yet", style="dim")]
    lines += box("events", ev, width, max(2, height - len(lines)))
    return Lines(lines[:height])


def run_monitor(board: Board, *, refresh_hz: float = 4.0, console: Console | None = None,
                stop: threading.Event | None = None, max_frames: int | None = None) -> int:
    """Run the live view on ``board`` until ``stop`` is set, Ctrl-C, or ``max_frames``.

    One lock-free read of the board per frame; frames are paced on the monotonic clock
    (a slow frame delays the next one, it never queues a burst).
    """
    console = console or PipeConsole()
    stop = stop or threading.Event()
    period = 1.0 / refresh_hz
    evlog = EventLog()
    frames = 0
    # Ctrl-C (KeyboardInterrupt) goes through: Live restores the terminal on the way out,
    # and main() answers it with 130 as for every command
    with Live(console=console, screen=True, auto_refresh=False, redirect_stderr=False) as live:
        next_t = time.monotonic()
        while not stop.is_set():
            view = read_view(board)
            evlog.update(view)
            size = console.size
            live.update(monitor_renderable(view, evlog.recent, refresh_hz, size.height,
                                           size.width), refresh=True)
            frames += 1
            if max_frames is not None and frames >= max_frames:
                break
            next_t += period
            wait = next_t - time.monotonic()
            if wait < 0:
                next_t = time.monotonic()
                wait = 0
            stop.wait(wait)
    return 0
