"""The suite's four plots (bench/plots/*.png), from a run's records.

Each carries the run (command, date, machine, load) at its foot; legends sit outside
the axes; measured data are solid lines or filled markers, modelled ones dashed lines
or hollow markers (the legend says which).  Nothing is drawn where matplotlib is not
installed (``pip install shmhb[bench]``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from . import stats
from .scenarios import msgs_model, msgs_model_mutual

if TYPE_CHECKING:
    from .suite import Results



def draw(out_dir: Path, stamp: str, r: Results) -> list[str]:
    """Write the four figures into ``out_dir``; their file names (none without
    matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    made = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout(rect=(0, 0.06, 1, 1))
        fig.text(0.01, 0.005, stamp, fontsize=6.5, color="#555", ha="left", va="bottom")
        fig.savefig(out_dir / name, dpi=110, bbox_inches="tight")
        plt.close(fig)
        made.append(name)

    q1_cost(plt, save, r)
    q2_step_loop(plt, save, r)
    q3_detection(plt, save, r)
    q4_scale(plt, save, r)
    return made


Save = Callable[..., None]


def _legend_outside(ax: Any) -> None:
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0,
              frameon=False)


def q1_cost(plt: Any, save: Save, r: Results) -> None:
    """Per-call cost, log scale (all measured)."""
    fig, ax = plt.subplots(figsize=(9, 4.8))
    names = list(r.q1.got)
    med = [stats.median(r.q1.got[k]) for k in names]
    p99s = [stats.p99(r.q1.got[k]) for k in names]
    y = np.arange(len(names))
    colors = ["#999" if n.startswith("floor") else "#2a7" if n.startswith("shmhb") else "#c55"
              for n in names]
    ax.barh(y, med, color=colors, label="median (measured)")
    ax.scatter(p99s, y, marker="|", color="k", s=200, label="p99 (measured)")
    ax.set_yticks(y, names, fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("ns per call, log scale")
    ax.set_title("Q1: one heartbeat / one liveness read (green shmhb, red alternatives, grey floor)")
    _legend_outside(ax)
    save(fig, "q1_cost.png")


def q2_step_loop(plt: Any, save: Save, r: Results) -> None:
    """The step loop's block means (measured)."""
    fig, ax = plt.subplots(figsize=(7, 4.4))
    ks = list(r.q2.step_ms)
    ax.boxplot([r.q2.step_ms[k] for k in ks])
    ax.set_xticks(range(1, len(ks) + 1), ks)
    ax.set_ylabel("ms per step (block means, measured)")
    ax.set_ylim(bottom=0)  # a difference between the boxes is read as an effect: from zero
    ax.set_title("Q2: numpy step loop with and without heartbeats")
    save(fig, "q2_step_loop.png")


def _detection_series(r: Results) -> list[tuple[str, list[float]]]:
    """The measured detection times (ms) of Q3, labelled."""
    measured = [("shmhb local kill (pidfd)", r.kills.values_ms),
                (f"shmhb local hang (SIGSTOP), dead-after {r.hang.dead_after_s:g} s", r.hang.dead_ms),
                (f"shmhb remote host kill, peer dead-after {r.host.policy.peer_dead_after_s:g} s",
                 r.host.dead_ms)]
    if r.push is not None:
        measured.insert(1, ("shmhb remote worker kill (push)", r.push.push.values))
        measured.insert(2, ("shmhb remote worker kill (pings only, 1 s)", r.push.pings.values))
    return measured


def q3_detection(plt: Any, save: Save, r: Results) -> None:
    """Detection CDFs, log scale (all measured)."""
    fig, ax = plt.subplots(figsize=(13, 5.5))
    measured = _detection_series(r)
    palette = iter(plt.get_cmap("tab20").colors)

    def cdf(v: list[float]) -> tuple[Any, Any]:
        srt = np.sort(v)  # from 0 at the first value, so a single sample still draws
        return np.r_[srt[0], srt], np.r_[0.0, np.arange(1, len(srt) + 1) / len(srt)]

    for label, v in measured:
        if v:
            ax.step(*cdf(v), where="post", lw=2.0, color=next(palette),
                    label=f"{label} (measured, n={len(v)})")
    ax.set_xscale("log")
    ax.set_xlabel("ms from the death to the verdict, log scale")
    ax.set_ylabel("fraction of deaths seen")
    ax.set_title("Q3: detection time (measured here; today's stacks: bench/STUDY.md)")
    _legend_outside(ax)
    save(fig, "q3_detection.png")


def _messages(a1: Any, r: Results) -> None:
    """Messages vs hosts: model lines, measured points."""
    hs = [2, 4, 8, 16, 32, 64, 128, 256]
    a1.plot(hs, [msgs_model_mutual(h) for h in hs], "--", color="#2a7",
            label="shmhb: one pinger per host, ping budget, mutual pairs (model)")
    a1.plot(hs, [msgs_model(h) for h in hs], ":", color="#2a7",
            label="shmhb, no mutual pairs (model)")
    title = "Q4: messages (model)"
    shape = r.shape
    if shape is not None and shape.sh_msgs:
        # Measured on loopback, where every pinger's pings leave from 127.0.0.1 and so
        # count as no host's evidence: no pair is mutual, and the dot belongs to the
        # dotted no-mutual-pairs model, drawn in its style
        a1.plot([shape.H], [shape.sh_msgs], "o", color="#2a7", ms=8, mfc="#2a7", mec="k",
                label=f"shmhb, {shape.H} x {shape.R} (measured on loopback: no pair is mutual, "
                      "compare the dotted line)")
        title = "Q4: messages (dashed: model; dots: measured)"
    a1.set_xscale("log", base=2)
    a1.set_yscale("log")
    a1.set_xlabel("hosts (16 ranks each)")
    a1.set_ylabel("messages/s, whole cluster")
    a1.set_title(title)
    a1.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), frameon=False)


def q4_scale(plt: Any, save: Save, r: Results) -> None:
    """Messages vs hosts (model lines, measured points); memory vs slots (computed)."""
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.4))
    _messages(a1, r)
    mem = r.mem
    a2.plot([m[0] for m in mem], [m[1] / 1024 for m in mem], "o--", mfc="none",
            label="default capacity (computed)")
    a2.plot([m[0] for m in mem], [m[2] / 1024 for m in mem], "s--", mfc="none",
            label="local slots only (computed)")
    a2.set_xscale("log", base=2)
    a2.set_yscale("log")
    a2.set_xlabel("local slots")
    a2.set_ylabel("board size, KiB")
    a2.set_title("Q4: board memory (shmhb.board.layout.Sizes)")
    a2.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), frameon=False)
    save(fig, "q4_scale.png")
