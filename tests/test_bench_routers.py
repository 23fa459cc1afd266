"""bench.routers' own section of bench/RESULTS.md: written in place, kept by the suite,
and its phase accounting (pure; the routers themselves run in tests/routers)."""

from __future__ import annotations

from pathlib import Path


from bench.routers import BEGIN, END, keep_section, phase, write_section
from tests.routers.stack import Result


S = 1_000_000_000


def test_the_section_replaces_only_itself_and_survives_a_suite_rewrite(tmp_path: Path) -> None:
    p = tmp_path / "RESULTS.md"
    p.write_text("# results\n\n## 1. one\nrows\n")
    write_section(f"{BEGIN}\n## Routers\nA\n{END}\n", p)
    write_section(f"{BEGIN}\n## Routers\nB\n{END}\n", p)
    text = p.read_text()
    assert text.startswith("# results\n\n## 1. one\nrows\n") and text.count(BEGIN) == 1
    assert "\nB\n" in text and "\nA\n" not in text
    new = keep_section(text, "# results\n\n## 1. one\nnew rows\n")
    assert "new rows" in new and "\nB\n" in new and new.count(END) == 1
    assert keep_section("no section", "x") == "x"


def test_a_phase_counts_what_was_in_flight_and_what_came_after() -> None:
    t0, t1 = 10 * S, 16 * S
    rs = [Result(9 * S, 9 * S + 10, 200),           # before, fine
          Result(t0 - 5_000_000, t0 + 1, 500),       # in flight at the fault
          Result(t0 + S // 10, t0 + S // 10, 0),     # after
          Result(t0 + S // 2, t0 + S // 2, 500),     # the last failure, 500 ms after
          Result(t0 + 2 * S, t0 + 2 * S, 200),
          Result(t1 - S // 10, t1 + 3 * S, 0)]       # still open at the next fault: not ours
    got = phase(rs, t0, t1)
    assert (got["inflight"], got["after"], got["stop_ms"]) == (1, 2, 500.0)
    assert phase(rs, t0, t1, last=True)["stop_ms"] is None  # failing into the last second
