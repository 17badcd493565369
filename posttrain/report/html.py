"""`report.html`: one self-contained page per run (plots inlined as base64 PNGs, also written beside it
under plots/), with headline numbers, sample completions by step and the run's config."""

from __future__ import annotations

import base64
import datetime as dt
import html
import math
import os
from pathlib import Path
from typing import Any

from posttrain.errors import PosttrainError
from posttrain.report.load import RunData, load_run
from posttrain.report.plots import Panel, Series, collect_series, is_eval_key, render_plots
from posttrain.writable import check_writable_dir, os_error_line

REPORT_FILE = "report.html"
PLOTS_DIR = "plots"
SAMPLE_PROMPTS = 6  # prompts followed across steps
SAMPLE_STEPS = 4  # at most this many steps side by side: the first, the last and evenly in between
MAX_TEXT = 600  # characters of a prompt or completion shown

CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px auto; max-width: 1200px;
       padding: 0 16px; color: #222; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 28px; border-bottom: 1px solid #ddd; }
.meta { color: #666; } .note { color: #8a5a00; }
table { border-collapse: collapse; margin: 8px 0; } th, td { border: 1px solid #ddd; padding: 4px 8px; vertical-align: top; }
th { background: #f5f5f5; text-align: left; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.plots { display: grid; grid-template-columns: repeat(auto-fill, minmax(520px, 1fr)); gap: 12px; }
.plots figure { margin: 0; } .plots img { width: 100%; border: 1px solid #eee; }
pre { background: #f7f7f7; padding: 10px; overflow-x: auto; font-size: 12px; }
td.text { white-space: pre-wrap; max-width: 420px; font-size: 12px; }
"""


def _fmt(value: float | int | None) -> str:
    if value is None:
        return "–"
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "nan"
    if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
        return f"{value:.3e}"
    return f"{value:.4g}"


def _finite(data: Series) -> list[tuple[int, float]]:
    return [(s, v) for s, v in zip(*data) if not math.isnan(v)]


def headline_rows(drawn: list[tuple[Panel | None, Path, list[str]]], series: dict[str, Series]) -> list[dict[str, Any]]:
    """first / last / best (with its step) of every key drawn; best only where the panel says which end is."""
    rows = []
    for panel, _, keys in drawn:
        if panel is None:  # the step-time panel: its total only; the phases are in the plot
            keys = [k for k in keys if k == "time/step_s"]
        for key in keys:
            points = _finite(series[key])
            if not points:
                continue
            row = {"key": key, "first": points[0][1], "last": points[-1][1], "n": len(points), "best": None}
            if panel is not None and panel.better and key not in panel.twin:
                pick = min if panel.better == "min" else max
                step, value = pick(points, key=lambda p: p[1])
                row["best"] = (value, step)
            rows.append(row)
    return rows


def _text(value: Any) -> str:
    """A prompt or completion as text: a string, or the last message of a chat."""
    if isinstance(value, list) and value and isinstance(value[-1], dict):
        value = value[-1].get("content", "")
    text = value if isinstance(value, str) else str(value)
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT] + " …"


def pick_steps(steps: list[int], limit: int = SAMPLE_STEPS) -> list[int]:
    """At most `limit` steps: the first, the last and evenly spaced ones between."""
    if len(steps) <= limit:
        return steps
    picks = {steps[round(i * (len(steps) - 1) / (limit - 1))] for i in range(limit)}
    return sorted(picks)


def _samples_html(samples: dict[int, list[dict[str, Any]]]) -> str:
    steps = sorted(samples)
    parts = ["<table><tr><th>step</th><th>samples</th><th>mean reward</th></tr>"]
    for step in steps:
        rewards = [r["reward"] for r in samples[step] if isinstance(r.get("reward"), (int, float))]
        mean = sum(rewards) / len(rewards) if rewards else None
        parts.append(
            f"<tr><td class=num>{step}</td><td class=num>{len(samples[step])}</td><td class=num>{_fmt(mean)}</td></tr>"
        )
    parts.append("</table>")
    shown = pick_steps(steps)
    # The held-out prompts are the same at every evaluation: follow the first few across steps.
    by_prompt = {step: {_text(r.get("prompt", "")): r for r in samples[step]} for step in shown}
    prompts = [_text(r.get("prompt", "")) for r in samples[shown[0]][:SAMPLE_PROMPTS]]
    header = "".join(f"<th>step {s}</th>" for s in shown)
    parts.append(f"<table><tr><th>prompt</th><th>answer</th>{header}</tr>")
    for prompt in prompts:
        first = by_prompt[shown[0]][prompt]
        cells = []
        for step in shown:
            row = by_prompt[step].get(prompt)
            if row is None:
                cells.append("<td>–</td>")
                continue
            reward = row.get("reward")
            badge = f"<b>reward {_fmt(reward)}</b>\n" if isinstance(reward, (int, float)) else ""
            cells.append(f"<td class=text>{badge}{html.escape(_text(row.get('completion', '')))}</td>")
        answer = html.escape(_text(first.get("answer", "")))
        parts.append(f"<tr><td class=text>{html.escape(prompt)}</td><td class=text>{answer}</td>{''.join(cells)}</tr>")
    parts.append("</table>")
    return "\n".join(parts)


def _string_metrics(records: list[dict[str, Any]]) -> list[tuple[str, int, str]]:
    """Text-valued metrics (e.g. reward/error), each distinct value once: (key, first step, value)."""
    seen, out = set(), []
    for record in records:
        for key, value in record.items():
            if isinstance(value, str) and (key, value) not in seen:
                seen.add((key, value))
                out.append((key, record["step"], value))
    return out


def _summary_line(data: RunData, series: dict[str, Series]) -> str:
    records = data.records
    if not records:
        return "no metrics records yet"
    steps = [r["step"] for r in records]
    parts = [f"{len(records)} records, steps {min(steps)}–{max(steps)}"]
    times = [r["time"] for r in records if isinstance(r.get("time"), (int, float))]
    if len(times) >= 2:
        parts.append(f"{(max(times) - min(times)) / 60:.1f} min between the first and last record")
        parts.append("last record " + dt.datetime.fromtimestamp(max(times)).strftime("%Y-%m-%d %H:%M:%S"))
    for key in ("eval/accuracy", "eval_loss"):
        points = _finite(series[key]) if key in series else []
        if len(points) >= 2:
            parts.append(f"{key} {_fmt(points[0][1])} → {_fmt(points[-1][1])}")
    return " · ".join(parts)


def build_html(data: RunData, drawn: list[tuple[Panel | None, Path, list[str]]], series: dict[str, Series]) -> str:
    title = html.escape(data.name)
    out = [
        f"<!doctype html><html><head><meta charset=utf-8><title>{title} · posttrain report</title>",
        f"<style>{CSS}</style></head><body>",
        f"<h1>{title}</h1>",
        f"<p class=meta>{html.escape(str(data.run_dir.resolve()))}<br>{html.escape(_summary_line(data, series))}"
        f"<br>generated {dt.datetime.now().strftime('%Y-%m-%d %H:%M:%S')} by posttrain report</p>",
    ]
    for note in data.notes:
        out.append(f"<p class=note>{html.escape(note)}</p>")
    rows = headline_rows(drawn, series)
    if rows:
        out.append(
            "<h2>Headline numbers</h2><table><tr><th>metric</th><th>first</th><th>last</th><th>best</th>"
            "<th>points</th></tr>"
        )
        for row in rows:
            best = f"{_fmt(row['best'][0])} (step {row['best'][1]})" if row["best"] else "–"
            kind = " (eval)" if is_eval_key(row["key"]) else ""
            out.append(
                f"<tr><td>{html.escape(row['key'])}{kind}</td><td class=num>{_fmt(row['first'])}</td>"
                f"<td class=num>{_fmt(row['last'])}</td><td class=num>{best}</td>"
                f"<td class=num>{row['n']}</td></tr>"
            )
        out.append("</table>")
    if drawn:
        out.append(
            "<h2>Curves</h2><p class=meta>Training curves: raw (faint) and an exponential moving average; "
            "evaluation metrics: dashed with markers.</p><div class=plots>"
        )
        for panel, path, _ in drawn:
            encoded = base64.b64encode(path.read_bytes()).decode("ascii")
            alt = html.escape(panel.title if panel else "Step time")
            out.append(f'<figure><img alt="{alt}" src="data:image/png;base64,{encoded}"></figure>')
        out.append("</div>")
    if data.samples:
        out.append("<h2>Sample completions by step</h2>" + _samples_html(data.samples))
    strings = _string_metrics(data.records)
    if strings:
        out.append("<h2>Messages</h2><table><tr><th>metric</th><th>first step</th><th>value</th></tr>")
        out.extend(
            f"<tr><td>{html.escape(k)}</td><td class=num>{s}</td><td class=text>{html.escape(v)}</td></tr>"
            for k, s, v in strings[:50]
        )
        out.append("</table>")
    if data.config_text is not None:
        out.append(
            f"<h2>Config</h2><details open><summary>config.yaml</summary><pre>{html.escape(data.config_text)}"
            "</pre></details>"
        )
    for name, text in data.summaries.items():
        out.append(f"<details><summary>{html.escape(name)}</summary><pre>{html.escape(text)}</pre></details>")
    out.append("</body></html>")
    return "\n".join(out)


def render_report(run_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Write `report.html` and `plots/*.png` into `out_dir` (default: the run directory); returns the
    HTML's path. PosttrainError (naming the file, and the line) for a missing or malformed metrics file."""
    data = load_run(run_dir)
    target = Path(out_dir) if out_dir is not None else data.run_dir
    check_writable_dir(target, doing="cannot write the report")  # a read-only run needs --out elsewhere
    try:
        target.mkdir(parents=True, exist_ok=True)
        series = collect_series(data.records)
        drawn = render_plots(series, target / PLOTS_DIR)
        page = build_html(data, drawn, series)
        path = target / REPORT_FILE
        partial = path.with_name(f".{REPORT_FILE}.partial")
        partial.write_text(page, encoding="utf-8")
        os.replace(partial, path)  # a reader never sees half a page
    except OSError as exc:  # the disk filled up, or the directory changed under us
        raise PosttrainError(os_error_line(target, exc, "cannot write the report")) from None
    return path
