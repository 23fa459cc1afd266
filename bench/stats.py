"""Shared helpers for the benchmarks: interleaved sampling, robust summaries, a table
printer, and a description of the machine the numbers came from.

Figures are per-call medians and 99th percentiles *across samples*, each sample being a
batch of calls timed with ``time.perf_counter_ns``: a batch smooths the clock's own
resolution and cost, many samples expose the spread that machine noise adds.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import timeit
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from time import perf_counter_ns


@dataclass
class Variant:
    """One thing to time: ``stmt`` run ``batch`` times per sample.

    ``setup`` runs once per sample, outside the timed loop and in the same local scope,
    so it can bind the objects ``stmt`` uses to fast local names (as ``timeit`` does).
    """

    name: str
    stmt: str
    namespace: Mapping[str, object]
    batch: int = 1000
    setup: str = "pass"
    _timer: timeit.Timer | None = field(default=None, repr=False)

    def sample_ns(self) -> float:
        """Run one batch; the mean time of one call in it, in ns.  (``timeit`` turns the
        garbage collector off while it times, so a collection does not land in a batch.)"""
        if self._timer is None:
            self._timer = timeit.Timer(self.stmt, self.setup, perf_counter_ns,
                                       globals=dict(self.namespace))
        return self._timer.timeit(self.batch) / self.batch


def interleaved(variants: Sequence[Variant], samples: int, warmup: int = 3) -> dict[str, list[float]]:
    """Per-call ns of every sample of every variant, taken in turn (A, B, C, B, C, A, ...:
    the order rotates each round) so that drifts in machine load, frequency or cache
    state hit every variant alike instead of whichever happened to run during them."""
    for v in variants:
        for _ in range(warmup):
            v.sample_ns()
    out: dict[str, list[float]] = {v.name: [] for v in variants}
    k = len(variants)
    for r in range(samples):
        for j in range(k):
            v = variants[(r + j) % k]
            out[v.name].append(v.sample_ns())
    return out


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def percentile(xs: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100): always a value that was observed."""
    s = sorted(xs)
    k = max(0, min(len(s) - 1, int(-(-q * len(s) // 100)) - 1))
    return s[k]


def p99(xs: Sequence[float]) -> float:
    return percentile(xs, 99)


@dataclass(frozen=True)
class Summary:
    """Median and p99 of per-call figures, and how many calls they came from."""

    median: float
    p99: float
    ops: int

    @classmethod
    def of(cls, per_call: Sequence[float], ops: int) -> Summary:
        return cls(median(per_call), p99(per_call), ops)


def ratio(a: float, b: float) -> str:
    """``a`` as a multiple of ``b``, e.g. ``2.31x``."""
    return f"{a / b:.2f}x" if b > 0 else "-"


def fmt(value: float, unit: str) -> str:
    """A figure with its unit and a sensible number of digits."""
    if value >= 100:
        return f"{value:.0f} {unit}"
    if value >= 10:
        return f"{value:.1f} {unit}"
    return f"{value:.2f} {unit}"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], *, markdown: bool = True) -> str:
    """Rows as a GitHub-markdown table (default) or as plain aligned columns."""
    widths = [max(len(str(r[i])) for r in (headers, *rows)) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        padded = [str(c).ljust(w) for c, w in zip(cells, widths)]
        return ("| " + " | ".join(padded) + " |") if markdown else "  ".join(padded).rstrip()

    sep = ("|" + "|".join("-" * (w + 2) for w in widths) + "|") if markdown else \
        "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for ln in f:
                if ln.startswith(("model name", "Model", "CPU part")):
                    return ln.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "?"


def loadavg() -> float:
    """The 1-minute load average (0.0 where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def machine_info() -> list[tuple[str, str]]:
    """What the numbers depend on: CPU, cores usable by us, kernel, versions, load."""
    import numpy
    import shmhb
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return [
        ("cpu", f"{_cpu_model()} ({platform.machine()}), {cores} usable cores"),
        ("kernel", platform.release()),
        ("python", sys.version.split()[0] + f" ({platform.python_implementation()})"),
        ("versions", f"shmhb {shmhb.__version__}, numpy {numpy.__version__}, "
                     f"posix_ipc {_version('posix_ipc')}, pyzmq {_version('pyzmq')}"),
        ("load average", " ".join(f"{x:.2f}" for x in os.getloadavg())),
    ]


def noise_note(load_before: float, load_after: float) -> str | None:
    """A warning when other work competed for the CPUs.  The benchmark itself keeps about
    one core busy, so a load above that before it starts, or above the core count after,
    means somebody else was running too."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if load_before > 1.0 or load_after > cores:
        return (f"NOTE: 1-min load average {load_before:.1f} before and {load_after:.1f} after "
                f"the run on {cores} cores: other work competed for the CPU, so p99s (the "
                "kill-to-DEAD ones most) include scheduling delays that are not shmhb's.")
    return None
