"""What an operator sees: the ``shmhb status`` table and the ``shmhb monitor`` live view.

Everything here renders ``View``s (``shmhb.view``) with rich; nothing here reads the
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

from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
from rich.live import Live
from rich.segment import Segment
from rich.text import Text

from .board import Board
from .events import Event, EventLog
from .status import PeerStatus, SlotStatus, Status
from .view import View, read_view

log = logging.getLogger(__name__)

# Separators carry no_wrap: Text.join copies the separator's settings, and a wrapping
# Text costs a word-split of every line on every frame.
_NEWLINE = Text("\n", no_wrap=True, overflow="ellipsis")
_BLANK_LINE = Text("\n\n", no_wrap=True, overflow="ellipsis")

STATUS_STYLE: dict[Status, str] = {
    Status.ALIVE: "bold green",
    Status.SUSPECT: "bold yellow",
    Status.DEAD: "bold red",
    Status.LEFT: "blue",
    Status.UNKNOWN: "bold magenta",
}


# -- small pieces -------------------------------------------------------------------------


def fmt_age(age_s: float | None) -> str:
    """An age for people: ``12 ms``, ``3.4 s``, ``2m05s``, ``1h02m``; ``-`` for none."""
    if age_s is None:
        return "-"
    if age_s < 1:
        return f"{age_s * 1000:.0f} ms"
    if age_s < 60:
        return f"{age_s:.1f} s"
    m, s = divmod(int(age_s), 60)
    if m < 60:
        return f"{m}m{s:02d}s"
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m"


def fmt_rtt(rtt_ms: float | None) -> str:
    return "-" if rtt_ms is None else f"{rtt_ms:.2f} ms"


def status_text(st: Status) -> Text:
    return Text(st.value, style=STATUS_STYLE[st])


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
    t.append_text(status_text(a.status))
    t.append(f"  term {a.term}  beat {fmt_age(a.age_s)} ago")
    if a.status is Status.SUSPECT:
        t.append("  stalled: role still held" if view.agent_held
                 else "  holder gone: waiting for a standby", style=STATUS_STYLE[Status.SUSPECT])
    elif a.status is Status.LEFT:
        t.append("  released the role" + ("; a new holder is taking over" if view.agent_held else ""))
    if a.status is Status.ALIVE:
        t.append(f"  loop lateness {view.lateness_ms:.1f} ms")
    return t


# -- tables -------------------------------------------------------------------------------


class Columns:
    """A light table: fixed columns laid out into one ``Text``.

    rich's ``Table`` measures and wraps every cell on every render (tens of ms for a
    full screen); the monitor redraws several times a second, so its tables are plain
    padded text with styled spans, a few times cheaper and looking alike.
    """

    def __init__(self, title: str | None, columns: Sequence[tuple[str, str]]) -> None:
        self.title = title
        self.heads = [h for h, _ in columns]
        self.right = [j == "right" for _, j in columns]
        self.rows: list[list[Text]] = []

    def add_row(self, *cells: str | Text) -> None:
        self.rows.append([c if isinstance(c, Text) else Text(c) for c in cells])

    def lines(self) -> list[Text]:
        """Title, header, rule and rows, one ``Text`` per line."""
        n = len(self.heads)
        widths = [len(h) for h in self.heads]
        for r in self.rows:
            for k, c in enumerate(r):
                widths[k] = max(widths[k], c.cell_len)
        out = [Text(self.title, style="bold")] if self.title else []
        head = []
        for k, h in enumerate(self.heads):
            head.append(h.rjust(widths[k]) if self.right[k] else (h if k == n - 1 else h.ljust(widths[k])))
        out.append(Text("   ".join(head), style="bold"))
        out.append(Text("\u2500" * (sum(widths) + 3 * (n - 1)), style="dim"))
        for r in self.rows:
            line = Text()
            for k, c in enumerate(r):
                pad = " " * (widths[k] - c.cell_len)
                if self.right[k]:
                    line.append(pad)
                line.append_text(c)
                if k < n - 1:
                    line.append(("" if self.right[k] else pad) + "   ")
            out.append(line)
        return out

    def render(self) -> Text:
        return _NEWLINE.join(self.lines())


def local_lines(view: View) -> list[Text]:
    """The local slots: key, status (coloured), pid, incarnation, age, endpoints."""
    title = f"local workers on board {view.board or '?'}"
    if not view.slots:
        return [Text(title, style="bold"), Text("no worker has registered", style="dim")]
    t = Columns(title, [("KEY", "left"), ("STATUS", "left"), ("PID", "right"),
                        ("INC", "right"), ("AGE", "right"), ("ENDPOINTS", "left")])
    for s in view.slots:
        t.add_row(s.key, status_text(s.status), str(s.pid), str(s.incarnation),
                  fmt_age(s.age_s), ", ".join(s.endpoints))
    return t.lines()


def local_table(view: View) -> Text:
    return _NEWLINE.join(local_lines(view))


def _workers(n: int) -> str:
    return f"{n} worker" + ("" if n == 1 else "s")


def remote_table(peers: Sequence[PeerStatus]) -> Text:
    return _NEWLINE.join(remote_lines(peers))


def remote_lines(peers: Sequence[PeerStatus]) -> list[Text]:
    """The remote hosts this host's pinger follows, each followed by its workers."""
    if not peers:
        return [Text("remote hosts: none followed", style="dim")]
    t = Columns("remote hosts", [
        ("HOST / KEY", "left"), ("STATUS", "left"), ("PID", "right"), ("INC", "right"),
        ("AGE", "right"), ("RTT", "right"), ("ENDPOINTS", "left")])
    for p in peers:
        t.add_row(Text(f"@{p.address}", style="bold"), status_text(p.status), "", "",
                  fmt_age(p.age_s), fmt_rtt(p.rtt_ms), Text(_workers(len(p.slots)), style="dim"))
        for s in p.slots:
            t.add_row(f"  {s.key}", status_text(s.status), str(s.pid), str(s.incarnation),
                      fmt_age(s.age_s), "", ", ".join(s.endpoints))
    return t.lines()


def status_renderable(view: View) -> RenderableType:
    """What ``shmhb status`` prints: the agent line, local slots, remote hosts."""
    return _BLANK_LINE.join([agent_line(view), local_table(view), remote_table(view.peers)])


def print_status(view: View, console: Console | None = None) -> None:
    """Print the status table; to a pipe or file, lines are never cut or wrapped."""
    console = console or Console()
    console.print(status_renderable(view), soft_wrap=not console.is_terminal)


# -- the live view -------------------------------------------------------------------------


def pinger_lines(view: View) -> list[Text]:
    """The agent role and the pinger's counters: holder, lateness, bad frames."""
    a = view.agent
    st = view.stats
    rows: list[tuple[str, str | Text]] = []
    holder = Text(f"pid {a.pid or '-'} ")
    holder.append_text(status_text(a.status))
    rows.append(("holder", holder))
    rows.append(("term", str(a.term)))
    rows.append(("role held", "yes" if view.agent_held else Text("no", style="bold red")))
    rows.append(("last beat", f"{fmt_age(a.age_s)} ago" if a.age_s is not None else "-"))
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
    w = max(len(k) for k, _ in rows)
    out = []
    for k, v in rows:
        line = Text(k.ljust(w) + " ", style="dim")
        line.append_text(v if isinstance(v, Text) else Text(v))
        out.append(line)
    return out


def event_text(e: Event) -> Text:
    t = Text(e.time_str(date=False) + " ", style="dim")
    t.append(f"{e.kind.value:<14}", style=STATUS_STYLE[e.severity])
    t.append(" " + e.body())
    return t


def _header(view: View, refresh_hz: float) -> Text:
    t = Text()
    t.append("shmhb monitor", style="bold reverse")
    now = _dt.datetime.fromtimestamp(view.t).strftime("%H:%M:%S")
    t.append(f"  board {view.board}  {now}  local: ")
    t.append_text(_counts(view.slots))
    t.append(f"  hosts: {len(view.peers)}  ")
    t.append(f"{refresh_hz:g} Hz  Ctrl-C quits", style="dim")
    return t


def _fit(line: Text, width: int) -> Text:
    """``line`` cut or padded to exactly ``width`` cells."""
    out = line.copy()
    out.truncate(width, overflow="ellipsis", pad=True)
    return out


def _box(title: str, lines: Sequence[Text], width: int, height: int) -> list[Text]:
    """``lines`` in a rounded box of ``width`` x ``height`` cells (the last lines kept
    when they do not fit: for events, the newest)."""
    inner = max(1, width - 4)
    room = max(0, height - 2)
    top = Text("\u256d\u2500 ", style="dim")
    top.append(title, style="bold")
    top.append(" " + "\u2500" * max(0, width - len(title) - 5) + "\u256e", style="dim")
    out = [_fit(top, width)]
    shown = list(lines[-room:]) if room else []
    shown += [Text()] * (room - len(shown))
    for ln in shown:
        row = Text("\u2502 ", style="dim")
        row.append_text(_fit(ln, inner))
        row.append(" \u2502", style="dim")
        out.append(row)
    out.append(Text("\u2570" + "\u2500" * max(0, width - 2) + "\u256f", style="dim"))
    return out


EVENTS_MIN_ROWS = 6
PINGER_WIDTH = 34


def monitor_renderable(view: View, events: Iterable[Event], refresh_hz: float = 4.0,
                       height: int = 40, width: int = 120) -> Lines:
    """The whole live screen for one frame, exactly ``height`` lines of ``width`` cells.

    Composed line by line (left: local and remote tables; right: the pinger box;
    below: the events box, newest last) instead of with rich's Layout: the monitor
    redraws several times a second and this costs a fraction of it.  The workers' area
    gets the rows it needs, up to the screen less the header and a few event lines.
    """
    right_w = PINGER_WIDTH if width >= 90 else 0  # narrower: the pinger box goes below
    left_w = width - right_w - (1 if right_w else 0)
    left = local_lines(view) + [Text()] + remote_lines(view.peers)
    pinger = pinger_lines(view)
    if not right_w:
        left += [Text()] + _box("pinger", pinger, width, len(pinger) + 2)
    body_h = max(len(left), len(pinger) + 2 if right_w else 0)
    body_h = max(1, min(body_h, height - 2 - EVENTS_MIN_ROWS))
    right = _box("pinger", pinger, right_w, body_h) if right_w else []
    lines = [_fit(_header(view, refresh_hz), width), _fit(agent_line(view), width)]
    for i in range(body_h):
        row = _fit(left[i] if i < len(left) else Text(), left_w)
        if right_w:
            row.append(" ")
            row.append_text(right[i] if i < len(right) else Text(" " * right_w))
        lines.append(row)
    ev = [event_text(e) for e in events]
    if not ev:
        ev = [Text("no events yet", style="dim")]
    lines += _box("events", ev, width, max(2, height - len(lines)))
    return Lines(lines[:height])


class Lines:
    """Ready-made lines, rendered as they are: no wrapping, no measuring (each line was
    fitted to the screen width already)."""

    def __init__(self, lines: Sequence[Text]) -> None:
        self.lines = lines

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        nl = Segment.line()
        for ln in self.lines:
            yield from ln.render(console)
            yield nl


def run_monitor(board: Board, *, refresh_hz: float = 4.0, console: Console | None = None,
                stop: threading.Event | None = None, max_frames: int | None = None) -> int:
    """Run the live view on ``board`` until ``stop`` is set, Ctrl-C, or ``max_frames``.

    One lock-free read of the board per frame; frames are paced on the monotonic clock
    (a slow frame delays the next one, it never queues a burst).
    """
    console = console or Console()
    stop = stop or threading.Event()
    period = 1.0 / refresh_hz
    evlog = EventLog()
    frames = 0
    with Live(console=console, screen=True, auto_refresh=False, redirect_stderr=False) as live:
        try:
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
        except KeyboardInterrupt:
            log.debug("monitor interrupted after %d frames", frames)
    return 0
