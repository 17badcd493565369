"""The report's figures: one PNG per panel, for whichever of its metrics the run logged.

Panels are data (`PANELS`): a title, a y label and the metric keys (exact, or fnmatch patterns) drawn
on it. Noisy training curves are drawn raw and faint with an exponential moving average on top;
evaluation metrics (`eval/...`, `eval_...`), logged at a few steps only, are drawn as marked points.
The step-time panel stacks the RL phases (`time/<phase>_s`) per step, the unexplained rest as "other".

Matplotlib is driven through `Figure` objects with the Agg canvas: no pyplot global state, no display.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator

Series = tuple[list[int], list[float]]  # (steps, values)

FIGSIZE = (7.2, 3.4)
DPI = 110
RAW_ALPHA = 0.28
SMOOTH_MIN_POINTS = 12  # fewer points than this: draw them as they are
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2")
# Names runs logged before every trainer used one metrics schema (SFT, DPO, RM and distill wrote the step
# time and throughput under their own names); read as today's names, so old metrics.jsonl files still plot.
LEGACY_NAMES = {"step_time": "time/step_s", "tokens_per_s": "tokens/train_per_s"}
# time/<phase>_s keys that are not phases of one step (totals, or separate work)
NOT_PHASES = ("time/step_s", "time/step_cpu_s", "time/eval_s")
PHASE_ORDER = ("rollout", "reward", "ref_pass", "old_pass", "advantage", "update")


@dataclass(frozen=True)
class Panel:
    name: str  # file stem of the PNG
    title: str
    ylabel: str
    keys: tuple[str, ...]  # exact keys or fnmatch patterns, in legend order
    better: str | None = None  # "min" / "max": which end is best, for the headline table
    bands: tuple[tuple[str, str], ...] = ()  # (mean key, std key): a +-1 std band around the mean
    twin: tuple[str, ...] = ()  # keys on a second y axis (e.g. the learning rate beside the grad norm)


PANELS: tuple[Panel, ...] = (
    Panel("loss", "Loss", "loss", ("loss", "loss/policy", "loss/value", "eval_loss"), better="min"),
    Panel(
        "reward",
        "Reward",
        "reward",
        ("reward/mean", "reward/task/mean", "reward/*/mean", "eval/reward_mean"),
        better="max",
        bands=(("reward/mean", "reward/std"),),
    ),
    Panel(
        "accuracy",
        "Accuracy",
        "fraction correct",
        ("eval/accuracy", "rewards/accuracies", "eval_rewards_accuracies"),
        better="max",
    ),
    Panel(
        "preference",
        "Implicit rewards",
        "reward",
        ("rewards/chosen", "rewards/rejected", "rewards/margins", "eval_rewards_margins"),
    ),
    Panel("kl", "KL divergence", "KL (nats / token)", ("kl", "approx_kl", "kl/in_reward_mean"), better="min"),
    Panel("entropy", "Policy entropy", "nats / token", ("entropy",)),
    Panel(
        "response_length",
        "Response length",
        "tokens",
        ("response_len/mean", "response_len/max", "eval/response_len_mean"),
    ),
    Panel(
        "clipping",
        "Clipped fractions",
        "fraction",
        ("clip_frac/low", "clip_frac/high", "response_len/clipped_frac", "value/clip_frac"),
    ),
    Panel("optimization", "Gradient norm and learning rate", "gradient norm", ("grad_norm",), twin=("lr",)),
    Panel("throughput", "Throughput", "tokens / s", ("tokens/train_per_s", "tokens/rollout_per_s")),
    Panel("memory", "Peak memory", "GiB", ("memory/*",)),
)


def is_eval_key(key: str) -> bool:
    return key.startswith(("eval/", "eval_"))


def collect_series(records: list[dict]) -> dict[str, Series]:
    """Numeric metrics by key (`LEGACY_NAMES` renamed), each as (steps, values) in file order (NaN kept: it
    draws as a gap)."""
    out: dict[str, Series] = {}
    for record in records:
        step = record["step"]
        for key, value in record.items():
            if key in ("step", "time") or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            steps, values = out.setdefault(LEGACY_NAMES.get(key, key), ([], []))
            steps.append(step)
            values.append(float(value))
    return out


def resolve_keys(patterns: tuple[str, ...], series: dict[str, Series]) -> list[str]:
    """The logged keys matching `patterns`, in pattern order, each once. A key found by a wildcard whose
    series repeats one already chosen (reward/<fn>/mean with a single reward function) is left out;
    keys named exactly are always drawn, even when equal (clip_frac/low and /high both 0)."""
    chosen: list[str] = []
    for pattern in patterns:
        if not any(c in pattern for c in "*?["):
            if pattern in series and pattern not in chosen:
                chosen.append(pattern)
            continue
        for key in sorted(fnmatch.filter(series, pattern)):
            if key not in chosen and not any(_same(series[key], series[c]) for c in chosen):
                chosen.append(key)
    return chosen


def _same(a: Series, b: Series) -> bool:
    return a[0] == b[0] and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a[1], b[1]))


def ema(values: list[float], span: int) -> list[float]:
    """Exponential moving average, debiased at the start (as TensorBoard's), NaNs skipped."""
    alpha = 2.0 / (span + 1)
    out, mean, weight = [], 0.0, 0.0
    for v in values:
        if not math.isnan(v):
            mean = (1 - alpha) * mean + alpha * v
            weight = (1 - alpha) * weight + alpha
        out.append(mean / weight if weight else math.nan)
    return out


def smoothing_span(n: int) -> int:
    """About a twentieth of the run, at least 3 points."""
    return max(3, n // 20)


def _new_figure() -> tuple[Figure, object]:
    fig = Figure(figsize=FIGSIZE, dpi=DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.grid(True, alpha=0.3, linewidth=0.6)
    ax.spines[["top", "right"]].set_visible(False)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    return fig, ax


def _draw(ax: object, key: str, data: Series, color: str) -> None:
    steps, values = data
    if is_eval_key(key) or len(values) < SMOOTH_MIN_POINTS:
        marker = "o" if is_eval_key(key) or len(values) <= 40 else None
        style = "--" if is_eval_key(key) else "-"
        ax.plot(steps, values, style, marker=marker, markersize=4, color=color, label=key, linewidth=1.4)
        return
    ax.plot(steps, values, color=color, alpha=RAW_ALPHA, linewidth=0.8)
    ax.plot(steps, ema(values, smoothing_span(len(values))), color=color, linewidth=1.8, label=f"{key} (EMA)")


def plot_panel(panel: Panel, series: dict[str, Series], path: Path) -> list[str] | None:
    """Draw `panel` into `path` (PNG); returns the keys drawn, or None when the run logged none of them."""
    keys = resolve_keys(panel.keys, series)
    twin = resolve_keys(panel.twin, series)
    if not keys:
        return None
    fig, ax = _new_figure()
    for i, key in enumerate(keys):
        _draw(ax, key, series[key], COLORS[i % len(COLORS)])
    for mean_key, std_key in panel.bands:
        if mean_key in keys and std_key in series and series[std_key][0] == series[mean_key][0]:
            steps, mean = series[mean_key]
            std = series[std_key][1]
            if len(mean) >= SMOOTH_MIN_POINTS:  # a band around the smoothed curve, itself smoothed
                span = smoothing_span(len(mean))
                mean, std = ema(mean, span), ema(std, span)
            color = COLORS[keys.index(mean_key) % len(COLORS)]
            ax.fill_between(
                steps,
                [m - s for m, s in zip(mean, std)],
                [m + s for m, s in zip(mean, std)],
                color=color,
                alpha=0.1,
                linewidth=0,
                label=f"± {std_key}",
            )
    ax.set_title(panel.title, fontsize=11)
    ax.set_ylabel(panel.ylabel)
    handles, labels = ax.get_legend_handles_labels()
    if twin:
        ax2 = ax.twinx()
        ax2.spines[["top"]].set_visible(False)
        for i, key in enumerate(twin, start=len(keys)):
            steps, values = series[key]
            ax2.plot(steps, values, ":", color=COLORS[i % len(COLORS)], linewidth=1.4, label=key)
        ax2.set_ylabel(", ".join(twin))
        ax2.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.3g}"))  # 3e-05, not an offset label
        more_h, more_l = ax2.get_legend_handles_labels()
        handles, labels = handles + more_h, labels + more_l
    ax.legend(handles, labels, fontsize=8, frameon=False, loc="best")
    steps = {s for key in keys for s in series[key][0]}
    if len(steps) == 1:  # a lone evaluation: a step axis around it, not +-0.05
        ax.set_xlim(min(steps) - 1, min(steps) + 1)
    _save(fig, path)
    return keys + twin


def plot_step_time(series: dict[str, Series], path: Path) -> list[str] | None:
    """Seconds per step: the RL phases stacked, the rest of the measured total as "other"; or the total alone."""
    phases = [k for k in series if k.startswith("time/") and k.endswith("_s") and k not in NOT_PHASES]
    phases.sort(key=lambda k: (PHASE_ORDER.index(_phase(k)) if _phase(k) in PHASE_ORDER else len(PHASE_ORDER), k))
    total_key = "time/step_s" if "time/step_s" in series else None
    if not phases:
        if total_key is None:
            return None
        fig, ax = _new_figure()
        _draw(ax, total_key, series[total_key], COLORS[0])
        ax.set_title("Step time", fontsize=11)
        ax.set_ylabel("seconds")
        ax.legend(fontsize=8, frameon=False)
        _save(fig, path)
        return [total_key]
    steps = sorted(set().union(*(series[k][0] for k in phases)))
    table = {k: dict(zip(*series[k])) for k in phases}
    stacks = [[table[k].get(s, 0.0) for s in steps] for k in phases]
    labels = [_phase(k) for k in phases]
    if total_key is not None:
        totals = dict(zip(*series[total_key]))
        stacks.append([max(totals.get(s, 0.0) - sum(col), 0.0) for s, col in zip(steps, zip(*stacks))])
        labels.append("other")
    fig, ax = _new_figure()
    colors = [COLORS[i % len(COLORS)] for i in range(len(stacks))]
    if len(steps) <= 60:  # few steps: one bar each
        bottom = [0.0] * len(steps)
        for values, label, color in zip(stacks, labels, colors):
            ax.bar(steps, values, bottom=bottom, label=label, color=color, width=0.8, alpha=0.85)
            bottom = [b + v for b, v in zip(bottom, values)]
    else:
        ax.stackplot(steps, stacks, labels=labels, colors=colors, alpha=0.85)
    ax.set_title("Step time by phase", fontsize=11)
    ax.set_ylabel("seconds")
    ax.legend(fontsize=8, frameon=False, loc="upper left", ncol=min(4, len(labels)))
    ax.set_ylim(top=ax.get_ylim()[1] * 1.18)  # room for the legend above the bars
    _save(fig, path)
    return phases + ([total_key] if total_key else [])


def _phase(key: str) -> str:
    return key.removeprefix("time/").removesuffix("_s")


def _save(fig: Figure, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, format="png")


def render_plots(series: dict[str, Series], out_dir: Path) -> list[tuple[Panel | None, Path, list[str]]]:
    """Every panel the run has data for, as PNGs in `out_dir`: [(panel, png path, keys drawn)].
    The step-time panel has no Panel (None)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    drawn = []
    for panel in PANELS:
        path = out_dir / f"{panel.name}.png"
        keys = plot_panel(panel, series, path)
        if keys:
            drawn.append((panel, path, keys))
    path = out_dir / "step_time.png"
    keys = plot_step_time(series, path)
    if keys:
        drawn.append((None, path, keys))
    return drawn
