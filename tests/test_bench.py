"""``python -m bench --smoke``: the benchmark suite runs end to end, writes its tables
(and plots where matplotlib is installed) and leaves no board behind.

Its figures are not checked: timing targets belong to the benchmarks, not to tests.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shmhb.testing.loopback import child_env

from .conftest import ROOT


@pytest.mark.system
def test_bench_smoke_run_completes_and_writes_every_table(tmp_path: Path) -> None:
    out = tmp_path / "RESULTS.md"
    plots = tmp_path / "plots"
    p = subprocess.Popen([sys.executable, "-m", "bench", "--smoke", "--out", str(out), "--plots", str(plots)],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=child_env())
    try:
        stdout, stderr = p.communicate(timeout=240)
    finally:
        if p.poll() is None:
            p.kill()  # SIGKILL: its children die with it (PR_SET_PDEATHSIG)
            p.communicate()
    assert p.returncode == 0, stdout[-3000:] + stderr[-3000:]
    text = out.read_text()
    for heading in ("## 1. One heartbeat", "## 2. Overhead", "## 3. Detection time",
                    "## 4. Cost that grows", "## 5. False verdicts", "## Targets"):
        assert heading in text, heading
    assert "bench/STUDY.md" in text.split("## 1.")[0]  # said where the alternatives' figures are
    assert "Smoke run" in text
    for row in ("| shmhb ", "| local kill (SIGKILL)", "| local workers"):
        assert row in text, row
    assert "the design study's figures, in bench/STUDY.md" in text  # not measured by the run
    if importlib.util.find_spec("matplotlib") is not None:
        made = sorted(p.name for p in plots.iterdir())
        assert made == ["q1_cost.png", "q2_step_loop.png", "q3_detection.png", "q4_scale.png"]
        assert all((plots / m).stat().st_size > 10_000 for m in made)
    left = [n for n in os.listdir("/dev/shm") if n.startswith(f"shmhb-bench-{p.pid}-")]
    assert not left, left


def test_the_readme_benchmark_table_is_generated_from_the_results_file() -> None:
    from bench import headline

    readme = (Path(ROOT) / "README.md").read_text()
    results = (Path(ROOT) / "bench" / "RESULTS.md").read_text()
    assert headline.update(readme, results) == readme, \
        "README.md's benchmark table differs from bench/RESULTS.md: run `python -m bench.headline`"
    block = readme.split(headline.BEGIN)[1].split(headline.END)[0]
    # the figures are the results file's: every figure of the table's shmhb column occurs
    # there (read off the block, not written here: a new run changes them all)
    import re
    rows = [r.split("|") for r in block.splitlines() if r.startswith("| ") and "---" not in r]
    figs = [f for r in rows[1:] if len(r) > 2
            for f in re.findall(r"-?[\d][\d,.]* ?(?:ns|µs|ms|s|%|/s|x)\b", r[2])]
    assert len(figs) >= 10, figs
    for fig in figs:
        assert fig in results, fig


def test_the_headline_refuses_a_short_run(tmp_path: Path) -> None:
    import pytest

    from bench import headline

    results = (Path(ROOT) / "bench" / "RESULTS.md").read_text()
    quick = results.replace("`python -m bench`, run", "`python -m bench --quick`, run", 1)
    with pytest.raises(headline.ResultsFormatError, match="not a full one"):
        headline.render(quick)


def test_quick_runs_write_beside_the_committed_results() -> None:
    from bench import suite

    out, plots = suite.default_paths(quick=True)
    full_out, full_plots = suite.default_paths(quick=False)
    assert (full_out, full_plots) == (Path(ROOT) / "bench" / "RESULTS.md", Path(ROOT) / "bench" / "plots")
    assert out.parent == plots.parent == Path(ROOT) / "bench" / "quick"
    assert "bench/quick/" in (Path(ROOT) / ".gitignore").read_text().split()


def test_the_headline_quotes_todays_stacks_from_the_design_study() -> None:
    """The figures the suite does not measure come from bench/STUDY.md, with the command
    and commit that made them; a study without them is refused, not quoted as blank."""
    from bench import headline

    study = headline.STUDY.read_text()
    assert "`python -m bench.anchors` at commit " in study
    results = (Path(ROOT) / "bench" / "RESULTS.md").read_text()
    sglang = next(ln for ln in study.splitlines() if "SGLang heartbeat checker (GET" in ln)
    median = sglang.split("|")[2].strip()
    assert f"SGLang's `/health` checker {median}" in headline.render(results, study)
    with pytest.raises(headline.ResultsFormatError, match="Today's stacks"):
        headline.render(results, study.replace("## Today's stacks", "## Other"))


def test_every_bench_module_imports_without_the_optional_stacks() -> None:
    """A module moved under a benchmark's feet fails here, not when someone next runs it:
    every bench module imports with the test extras alone (vLLM and the routers are
    imported where they are used)."""
    import importlib
    import pkgutil

    import bench
    failed = {}
    for m in pkgutil.iter_modules(bench.__path__):
        if m.name != "__main__":
            try:
                importlib.import_module(f"bench.{m.name}")
            except ImportError as e:
                failed[m.name] = repr(e)
    assert failed == {}
