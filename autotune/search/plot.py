"""throughput.png: how much faster each configuration ran, its confirmation pairs, and every run in order."""

from __future__ import annotations

import io
import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.files import write_file
from autotune.search.live import changed_text
from autotune.search.outcome import SearchOutcome
from autotune.search.study import ROLE_BASELINE, ROLE_CONFIRM, ROLE_PERTURBED, ROLE_SEARCH
from autotune.search.trial import Outcome, TrialResult


def _items(config: Mapping[str, Any]) -> tuple:
    """A configuration as a key that ``dict()`` turns back into it."""
    return tuple(sorted(config.items()))


@dataclass(frozen=True)
class PlotRow:
    """One configuration in throughput.png: its search speedups, its confirmation pairs, and how it ended."""

    label: str  # the knobs it changes
    status: str  # "ok", "diverged" (losses outside the gate) or how it failed
    search: tuple[float, ...]  # speedup of each of its search runs (over the baseline runs just before and after)
    pairs: tuple[float, ...] = ()  # its A/B confirmation ratios
    accepted: bool = False  # the confirmation held
    winner: bool = False

    @property
    def value(self) -> float | None:
        """Its best estimate: the median of its pairs when confirmed in some, else its best search run."""
        if self.pairs:
            return statistics.median(self.pairs)
        return max(self.search) if self.search else None


@dataclass(frozen=True)
class PlotData:
    """What throughput.png shows: each configuration's speedup (top), and every run's steps/s in order (bottom)."""

    points: dict[str, list[tuple[int, float]]]  # group -> (trial number, y), the runs in order
    ylabel: str
    level: float | None  # the baseline median on that axis
    level_label: str
    rows: tuple[PlotRow, ...] = ()  # best first; those that failed last
    limits: tuple[float, float] = (0.5, 2.0)  # the speedup axis; points outside it are drawn at its edge
    hidden: int = 0  # configurations left out of a long list (the slowest)


MAX_ROWS = 16
STATUS_COLOR = {"ok": "tab:blue", "diverged": "tab:orange", "unverified": "tab:orange"}  # else red: it failed
SLOWEST_SHOWN = 0.25  # slower configurations sit at the axis' left edge, so they do not squash the rest


def plot_data(o: SearchOutcome) -> PlotData:
    """Speedups per configuration, and steps/s per run on one machine; on several, each run's steps/s over its own
    machine's baseline median, since steps/s of different machines do not compare."""
    several = len(o.machines) > 1
    base: dict[str, float] = {}
    for m in o.machines:
        runs = [r.throughput for r in o.results if r.role == ROLE_BASELINE and r.throughput and r.machine == m]
        if runs:
            base[m] = statistics.median(runs)
    points: dict[str, list[tuple[int, float]]] = {"baseline": [], "ok": [], "diverged": [], "failed": []}
    for r in o.results:
        if r.role == ROLE_PERTURBED:
            continue  # another thread count: its speed compares with nothing
        y = r.throughput or 0.0
        if several:
            if r.machine not in base:
                continue  # no baseline of its own machine to compare it with
            y /= base[r.machine]
        if r.role == ROLE_BASELINE or (r.role == ROLE_CONFIRM and r.attrs.get("arm") == "baseline"):
            g = "baseline"
        elif r.status is Outcome.OK:
            g = "ok"
        elif r.status in (Outcome.DIVERGED, Outcome.UNVERIFIED):
            g = "diverged"
        else:
            g = "failed"
        points[g].append((r.number, y))
    rows, hidden, limits = _rows(o)
    if several:
        return PlotData(points, "steps/s over the same machine's baseline median", 1.0 if base else None,
                        "baseline median (each machine's own)", rows, limits, hidden)
    level = base.get(o.machine)
    return PlotData(points, "steps/s (median step time)", level, "baseline median", rows, limits, hidden)


def _rows(o: SearchOutcome) -> tuple[tuple[PlotRow, ...], int, tuple[float, float]]:
    """One row per configuration the search tried, best first, and the speedup axis' limits."""
    defaults = o.space.baseline()

    def changed(config: Mapping[str, Any]) -> set:
        return {(k, v) for k, v in config.items() if defaults.get(k, v) != v}

    runs: dict[tuple, list[TrialResult]] = {}
    for r in o.results:
        if r.role == ROLE_SEARCH and changed(r.config):
            runs.setdefault(_items(r.config), []).append(r)
    speed = {key: [o.speedups[r.number] for r in rs if r.number in o.speedups] for key, rs in runs.items()}
    # a candidate is confirmed as its canonical configuration (knobs that bake to the same code left out, such as
    # persistent workers without workers): the search run it stands for is the one it is a part of, whose
    # speedup it was picked with
    confirmed: dict[tuple, Any] = {}
    for c in o.confirmations:
        want = changed(c.config)
        fits = [k for k in runs if want <= changed(dict(k)) and k not in confirmed]
        if not fits:
            confirmed[_items(c.config)] = c
            continue
        near = lambda k: (abs(max(speed[k], default=0.0) - (c.search_speedup or 0.0)), len(changed(dict(k))))  # noqa: E731
        confirmed[min(fits, key=near)] = c
    win = o.winner
    rows = []
    for key in [*runs, *(k for k in confirmed if k not in runs)]:
        rs, c = runs.get(key, []), confirmed.get(key)
        ok = [r for r in rs if r.status is Outcome.OK]
        differ = (Outcome.DIVERGED, Outcome.UNVERIFIED)
        status = "ok" if ok or not rs else str(next((r.status for r in rs if r.status in differ), rs[-1].status))
        search = tuple(o.speedups[r.number] for r in (ok or rs) if r.number in o.speedups)
        if not rs and c is not None and c.search_speedup:
            search = (c.search_speedup,)
        rows.append(
            PlotRow(
                changed_text(c.config if c else dict(key), defaults),
                status,
                search,
                tuple(c.ratios) if c else (),
                bool(c and c.accepted),
                c is not None and win is not None and _items(c.config) == _items(win.config),
            )
        )
    # the winner first, then those that trained the same by speedup, then those whose losses differ, then failures
    rank = {"ok": 0, "diverged": 1, "unverified": 1}
    rows.sort(key=lambda row: (not row.winner, rank.get(row.status, 2), -(row.value or 0.0)))
    # a long list leaves out its slowest configurations that trained the same; those that diverged or failed stay
    slowest = [row for row in reversed(rows) if row.status == "ok" and not row.winner][: max(0, len(rows) - MAX_ROWS)]
    shown, hidden = [row for row in rows if row not in slowest], len(slowest)
    # the axis spans the speedups of the configurations that trained the same, 1.0 and the winner's pairs; runs
    # beyond Tukey's fences (in log scale) or that diverged are drawn at its edge with their value, so that one
    # wild run on a busy machine does not squash the rest
    core = sorted(math.log(x) for row in shown if row.status == "ok" for x in (*row.search, *row.pairs) if x > 0)
    keep = [0.0, *(math.log(x) for row in shown if row.winner for x in row.pairs if x > 0)]
    if core:
        q1, q3 = _quantile(core, 0.25), _quantile(core, 0.75)
        fence = 1.5 * (q3 - q1)
        core = [x for x in core if q1 - fence <= x <= q3 + fence]
    lo = max(min(core + keep), min(keep) + math.log(SLOWEST_SHOWN))
    hi = max(core + keep)
    pad = max(hi - lo, math.log(1.5)) * 0.06
    return tuple(shown), hidden, (math.exp(lo - pad), math.exp(hi + pad))


def _quantile(xs: list[float], q: float) -> float:
    """The ``q`` quantile of sorted ``xs``, interpolated."""
    at = q * (len(xs) - 1)
    i = int(at)
    return xs[i] + (xs[min(i + 1, len(xs) - 1)] - xs[i]) * (at - i)


def _ticks(lo: float, hi: float) -> list[float]:
    """Speedup ticks a person reads at a glance (0.5x, 1x, 1.5x, 2x ...) within [lo, hi]."""
    nice = [0.1, 0.2, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 5.0, 7.0, 10.0, 15.0, 20.0, 30.0, 50.0, 100.0]
    inside = [t for t in nice if lo <= t <= hi]
    if len(inside) > 9:  # a wide range: every other one, keeping 1x
        inside = [t for i, t in enumerate(inside) if i % 2 == inside.index(1.0) % 2]
    return inside


def _draw_rows(ax, rows: tuple[PlotRow, ...], ys: list[float], heights: list[float], limits: tuple[float, float]) -> None:
    """The upper panel: each configuration's search runs and A/B pairs on the speedup axis, the winner shaded."""
    from matplotlib.transforms import blended_transform_factory

    lo, hi = limits
    right = blended_transform_factory(ax.transAxes, ax.transData)

    def clip(x: float) -> tuple[float, bool]:
        return min(max(x, lo), hi), not lo <= x <= hi

    for y, h, row in zip(ys, heights, rows):
        if row.winner:
            ax.axhspan(y - h / 2, y + h / 2, color="tab:green", alpha=0.12, zorder=0)
        color = STATUS_COLOR.get(row.status, "tab:red")
        for x in row.search:
            cx, out = clip(x)
            marker = ("<" if x < lo else ">") if out else "o"
            ax.scatter([cx], [y], s=46, marker=marker, facecolors=color if row.status == "ok" else "none",
                       edgecolors=color, zorder=3, clip_on=False)
            if out:
                ax.annotate(f"{x:.2g}x", (cx, y), xytext=(6 if x < lo else -6, 5), textcoords="offset points",
                            ha="left" if x < lo else "right", fontsize=7, color=color)
        if row.pairs:
            pair_color = "tab:green" if row.accepted else "0.45"
            xs = [clip(x)[0] for x in row.pairs]
            ax.plot([min(xs), max(xs)], [y + 0.45, y + 0.45], color=pair_color, linewidth=1, zorder=2)
            ax.scatter(xs, [y + 0.45] * len(xs), s=40, marker="|", color=pair_color, zorder=3, clip_on=False)
            med = clip(statistics.median(row.pairs))[0]
            ax.scatter([med], [y + 0.45], s=120 if row.winner else 50, marker="*" if row.winner else "D",
                       color=pair_color, edgecolors="black" if row.winner else pair_color, linewidths=0.5, zorder=4,
                       clip_on=False)
        ax.text(1.03, y, _row_note(row), transform=right, va="center", fontsize=8, color="black" if row.status == "ok" else color,
                fontweight="bold" if row.winner else "normal")


def _row_note(row: PlotRow) -> str:
    """What the plot says beside a configuration's row."""
    if row.winner:
        return f"winner: {row.value:.2f}x, faster in {sum(x > 1 for x in row.pairs)} of {len(row.pairs)} pairs"
    if row.pairs:
        wins = f"faster in {sum(x > 1 for x in row.pairs)} of {len(row.pairs)}"
        return f"{row.value:.2f}x in A/B pairs ({wins}): {'confirmed' if row.accepted else 'not confirmed'}"
    if row.status == "ok":
        return f"{row.value:.2f}x (one search run, not confirmed)" if row.value else "no speedup measured"
    if row.status == "diverged":
        return "losses differ: rejected"
    if row.status == "unverified":
        return "losses cannot be compared: not taken"
    return f"failed: {row.status}"


def _legend(rows: tuple[PlotRow, ...]) -> list:
    """The legend of the configurations' panel: what is drawn, in the colours it is drawn in."""
    from matplotlib.lines import Line2D

    legend = [Line2D([], [], marker="o", linestyle="", color="tab:blue",
                     label="search run (vs the baseline runs around it): not confirmed by itself")]
    if any(row.pairs and row.accepted for row in rows):
        legend.append(Line2D([], [], marker="*", linestyle="-", color="tab:green", markeredgecolor="black",
                             label="A/B pairs that confirmed it (\u2605 median)"))
    if any(row.pairs and not row.accepted for row in rows):
        legend.append(Line2D([], [], marker="D", linestyle="-", color="0.45",
                             label="A/B pairs that did not confirm it (\u2666 median)"))
    if any(row.status in ("diverged", "unverified") for row in rows):
        legend.append(Line2D([], [], marker="o", linestyle="", markerfacecolor="none", color="tab:orange",
                             label="losses differ, or cannot be compared"))
    if any(row.status not in STATUS_COLOR for row in rows):
        legend.append(Line2D([], [], marker="o", linestyle="", markerfacecolor="none", color="tab:red",
                             label="failed (crash, timeout, out of memory...)"))
    return legend


def _draw_runs(runs_ax, o: SearchOutcome, data: PlotData) -> None:
    """The lower panel: every run's speed in order, the baseline's level, where the confirmation began."""
    from matplotlib.transforms import blended_transform_factory

    styles = {"baseline": ("0.5", "s"), "ok": ("tab:blue", "o"), "diverged": ("tab:orange", "D"), "failed": ("tab:red", "x")}
    names = {"baseline": "baseline", "ok": "trained the same", "diverged": "losses differ or unverified",
             "failed": "failed"}
    # the runs that trained the same set the height; a faster run whose losses differ is drawn at the top edge
    top = max((y for g in ("baseline", "ok") for _, y in data.points[g]), default=0.0) * 1.15 or None
    for label, pts in data.points.items():
        if pts:
            color, marker = styles[label]
            ys_ = [min(y, top) if top else y for _, y in pts]
            runs_ax.scatter([x for x, _ in pts], ys_, c=color, marker=marker, s=16, label=names[label], zorder=3,
                            clip_on=False)
            for (x, y) in pts:
                if top and y > top:
                    runs_ax.annotate(f"{y:.3g}", (x, top), xytext=(4, -10), textcoords="offset points", fontsize=7,
                                     color=color)
    if top:
        runs_ax.set_ylim(0, top)
    if data.level is not None:
        runs_ax.axhline(data.level, color="0.5", linestyle="--", linewidth=1, label=data.level_label)
    confirm = [r.number for r in o.results if r.role == ROLE_CONFIRM]
    if confirm:
        runs_ax.axvline(min(confirm) - 0.5, color="black", linestyle=":", linewidth=1)
        runs_ax.text(min(confirm) - 0.3, 0.97, "confirmation (A/B pairs)", fontsize=7, va="top",
                     transform=blended_transform_factory(runs_ax.transData, runs_ax.transAxes))
    runs_ax.set_xlabel("run, in order (the baseline's own spread shows how noisy the machine was)")
    runs_ax.set_ylabel(data.ylabel, fontsize=8)
    runs_ax.grid(True, alpha=0.3)
    runs_ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=7, frameon=False)


def write_plot(o: SearchOutcome, path: Path) -> tuple[Path | None, str | None]:
    """throughput.png: how much faster each configuration ran, with its confirmation pairs and the winner marked;
    below, every run's steps/s in order; (None, why) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None, "matplotlib is not installed (pip install matplotlib)"
    import textwrap

    data = plot_data(o)
    rows = data.rows
    labels = [textwrap.fill(row.label, 50) for row in rows]
    # rows as tall as their labels: a row's centre on the y axis, in units of one label line
    heights = [0.7 + label.count("\n") + 1 for label in labels]
    ys = [sum(heights[:i]) + h / 2 for i, h in enumerate(heights)]
    top_h = 1.6 + 0.14 * sum(heights)
    fig, (ax, runs_ax) = plt.subplots(
        2, 1, figsize=(11, top_h + 2.8), dpi=100, gridspec_kw={"height_ratios": [top_h, 2.0]}, layout="constrained"
    )
    lo, hi = data.limits
    ax.set_xscale("log")
    ax.set_xlim(lo, hi)
    ticks = _ticks(lo, hi)
    ax.set_xticks(ticks, [f"{t:g}x" + ("\n(baseline)" if t == 1.0 else "") for t in ticks])
    ax.minorticks_off()
    ax.axvline(1.0, color="0.35", linestyle="--", linewidth=1, zorder=1)
    _draw_rows(ax, rows, ys, heights, (lo, hi))
    ax.set_yticks(ys, labels, fontsize=8)
    for tick, row in zip(ax.get_yticklabels(), rows):
        if row.winner:
            tick.set_fontweight("bold")
            tick.set_color("darkgreen")
    ax.set_ylim(sum(heights) or 1.0, 0.0)
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_xlabel("speedup over the baseline (steps/s ratio; log scale)")
    if not rows:
        ax.text(0.5, 0.5, "no configuration besides the baseline ran", transform=ax.transAxes, ha="center")
    legend = _legend(rows)
    ax.legend(handles=legend, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, fontsize=8, frameon=False)
    machines = f", {len(o.machines)} machines" if len(o.machines) > 1 else ""
    if o.winner:
        headline = f"{o.winner.speedup:.2f}x faster: {o.winner.reason}"
    else:
        headline = "the baseline stays: no configuration was confirmed faster"
    more = f" ({data.hidden} slower configurations not shown)" if data.hidden else ""
    fig.suptitle(f"autotune search: {o.project.entry.display} on {o.device}{machines}\n{headline}{more}", fontsize=10)

    _draw_runs(runs_ax, o, data)
    image = io.BytesIO()
    fig.savefig(image, format="png")
    plt.close(fig)
    write_file(path, image.getvalue())
    return path, None
