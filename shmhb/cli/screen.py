"""Layout for the live view: fitting rows and panels into a terminal of any size.

Pure functions of rich ``Text`` lines and sizes, and ``Columns``, the light table that
the monitor's views and ``shmhb gc``'s listing are laid out in; nothing here reads the
board.  The rules
(``shmhb monitor`` on a small terminal):

- nothing is cut silently: a line too wide ends in an ellipsis, rows that do not fit are
  counted on a ``+N more`` line, hidden columns are named;
- rows are chosen by priority (unhealthy first), shown in their order;
- a panel that has no room beside the tables folds into a few lines below them instead
  of disappearing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from rich.console import Console, ConsoleOptions, RenderResult
from rich.segment import Segment
from rich.text import Text

from ..board.records import shown
from ..status import Status


# Separators carry no_wrap: Text.join copies the separator's settings, and a wrapping
# Text costs a word-split of every line on every frame.
NEWLINE = Text("\n", no_wrap=True, overflow="ellipsis")

STATUS_STYLE: dict[Status, str] = {
    Status.ALIVE: "bold green",
    Status.SUSPECT: "bold yellow",
    Status.DEAD: "bold red",
    Status.LEFT: "blue",
    Status.UNKNOWN: "bold magenta",
}


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


def fit(line: Text, width: int) -> Text:
    """``line`` cut (with an ellipsis) or padded to exactly ``width`` cells."""
    out = line.copy()
    out.truncate(width, overflow="ellipsis", pad=True)
    return out


def box(title: str, lines: Sequence[Text], width: int, height: int) -> list[Text]:
    """``lines`` in a rounded box of ``width`` x ``height`` cells.  When they do not fit,
    the last ones are kept (for events: the newest) and the top border says how many
    earlier ones are not shown."""
    inner = max(1, width - 4)
    room = max(0, height - 2)
    hidden = max(0, len(lines) - room)
    label = title + (f" (+{hidden} earlier)" if hidden else "")
    top = Text("\u256d\u2500 ", style="dim")
    top.append(label, style="bold")
    top.append(" " + "\u2500" * max(0, width - len(label) - 5) + "\u256e", style="dim")
    out = [fit(top, width)]
    shown = list(lines[-room:]) if room else []
    shown += [Text()] * (room - len(shown))
    for ln in shown:
        row = Text("\u2502 ", style="dim")
        row.append_text(fit(ln, inner))
        row.append(" \u2502", style="dim")
        out.append(row)
    out.append(Text("\u2570" + "\u2500" * max(0, width - 2) + "\u256f", style="dim"))
    return out


def fold(chips: Sequence[Text], width: int, sep: str = "  ") -> list[Text]:
    """Short ``chips`` ("holder pid 42 alive", "late loops 0", ...) flowed into as few
    lines of ``width`` cells as they need; a chip wider than a line gets a line of its
    own (and an ellipsis from ``fit`` if it is drawn narrower)."""
    out: list[Text] = []
    cur = Text()
    for c in chips:
        if cur.cell_len and cur.cell_len + len(sep) + c.cell_len > width:
            out.append(cur)
            cur = Text()
        if cur.cell_len:
            cur.append(sep)
        cur.append_text(c)
    if cur.cell_len:
        out.append(cur)
    return out


@dataclass
class Row:
    """One table row: its cells, how urgently it must be seen (0 first; ``CALM`` for
    healthy rows) and, for a remote worker, the row it belongs under."""

    cells: list[Text]
    level: int
    parent: int | None = None  # index of the row this one needs shown above it


@dataclass
class Section:
    """A table to fit: fixed lines (title, header, rule) drawn always, then rows."""

    rows: list[Row] = field(default_factory=list)
    fixed_lines: int = 3


def choose(sections: Sequence[Section], budget: int) -> list[list[int]]:
    """Which rows of each section to show within ``budget`` lines (fixed lines count,
    and so does one ``+N more`` line per section that hides rows).

    The most urgent level first across every section, taking one row of each section
    in turn so no table starves the other; then the next level.  A row whose parent is
    not shown brings the parent along (or is skipped when both do not fit).  Returns
    the chosen row indices of each section, in the rows' own order."""
    fixed = sum(s.fixed_lines for s in sections)
    total = sum(len(s.rows) for s in sections)
    if fixed + total <= budget:
        return [list(range(len(s.rows))) for s in sections]
    room = budget - fixed - sum(1 for s in sections if s.rows)  # the "+N more" lines
    order = []  # (level, turn within the level, section, row)
    for k, s in enumerate(sections):
        turn: dict[int, int] = {}
        for i, r in enumerate(s.rows):
            order.append((r.level, turn.get(r.level, 0), k, i))
            turn[r.level] = turn.get(r.level, 0) + 1
    chosen: list[set[int]] = [set() for _ in sections]
    for _, _, k, i in sorted(order):
        if i in chosen[k]:
            continue
        parent = sections[k].rows[i].parent
        need = [i] if parent is None or parent in chosen[k] else [parent, i]
        if len(need) <= room:
            chosen[k].update(need)
            room -= len(need)
    return [sorted(c) for c in chosen]


def columns_that_fit(widths: Sequence[int], sep: int, width: int,
                     droppable: Sequence[int]) -> list[int]:
    """The column indices kept when a table of ``widths`` (cells each, ``sep`` between)
    must fit ``width``: columns in ``droppable`` go, in that order, until it fits."""
    keep = list(range(len(widths)))
    for d in droppable:
        if sum(widths[k] for k in keep) + sep * (len(keep) - 1) <= width:
            break
        keep.remove(d)
    return keep


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


class Columns:
    """A light table: fixed columns laid out into one ``Text`` per line.

    rich's ``Table`` measures and wraps every cell on every render (tens of ms for a
    full screen); the monitor redraws several times a second, so its tables are plain
    padded text with styled spans, a few times cheaper and looking alike.  Given a
    width, the columns named in ``droppable`` go (in that order) until the table fits,
    and the title names them: nothing disappears without a word.
    """

    def __init__(self, title: str | None, columns: Sequence[tuple[str, str]],
                 droppable: Sequence[str] = ()) -> None:
        self.title = title
        self.heads = [h for h, _ in columns]
        self.right = [j == "right" for _, j in columns]
        self.droppable = [self.heads.index(h) for h in droppable if h in self.heads]
        self.rows: list[list[Text]] = []

    def add_row(self, *cells: str | Text) -> None:
        self.rows.append([c if isinstance(c, Text) else Text(shown(c)) for c in cells])

    def _widths(self) -> list[int]:
        widths = [len(h) for h in self.heads]
        for r in self.rows:
            for k, c in enumerate(r):
                widths[k] = max(widths[k], c.cell_len)
        return widths

    def natural_width(self) -> int:
        """The cells a line of this table takes with every column shown."""
        widths = self._widths()
        return sum(widths) + 3 * (len(widths) - 1)

    def lines(self, width: int | None = None, rule: bool = True) -> list[Text]:
        """Title, header, rule and rows, one ``Text`` per line; within ``width`` cells
        if given (columns dropped as above; a last column still too wide is cut with
        an ellipsis by whoever fits the line to the screen)."""
        widths = self._widths()
        keep = list(range(len(widths)))
        if width is not None:
            keep = columns_that_fit(widths, 3, width, self.droppable)
        title = self.title
        hidden = [self.heads[k] for k in range(len(widths)) if k not in keep]
        if hidden:
            note = f"({', '.join(hidden)} hidden: too narrow)"
            if title and width is not None and len(title) + 2 + len(note) > width:
                # the note is what must show: the title gives way (cut with an ellipsis)
                room = width - 2 - len(note)
                title = (title[:room - 1] + "\u2026") if room > 1 else ""
            title = f"{title or ''}  {note}".strip()
        out = [Text(title, style="bold")] if title else []
        last = keep[-1]
        head = []
        for k in keep:
            h = self.heads[k]
            head.append(h.rjust(widths[k]) if self.right[k] else (h if k == last else h.ljust(widths[k])))
        out.append(Text("   ".join(head), style="bold"))
        if rule:
            out.append(Text("\u2500" * (sum(widths[k] for k in keep) + 3 * (len(keep) - 1)), style="dim"))
        for r in self.rows:
            line = Text()
            for k in keep:
                c = r[k]
                pad = " " * (widths[k] - c.cell_len)
                if self.right[k]:
                    line.append(pad)
                line.append_text(c)
                if k != last:
                    line.append(("" if self.right[k] else pad) + "   ")
            out.append(line)
        return out

    def render(self) -> Text:
        return NEWLINE.join(self.lines())
