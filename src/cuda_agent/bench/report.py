"""`cuda-agent report RESULTS`: a Markdown report and an HTML page of a benchmark run.

The metrics table is laid out like the paper's Table 1 (rows: levels and overall;
columns: pass rate, faster than eager, faster than torch.compile, geometric-mean speedup
vs each), followed by the all-tasks geometric means, a fast_p curve, a histogram of
speedups vs torch.compile, counts of statuses and flags, and a per-task table.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any

from cuda_agent.bench.metrics import FAST_P, by_level
from cuda_agent.bench.records import BenchRecord, ResultsFile, latest


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _table1(m: dict[str, dict[str, Any]]) -> list[list[str]]:
    rows = [["Level", "Tasks", "Pass rate", "Faster than eager", "Faster than compile",
             "Geomean vs eager", "Geomean vs compile", "Geomean vs compile (all tasks)"]]
    for lvl, d in m.items():
        if not d.get("tasks"):
            continue
        rows.append([lvl, str(d["tasks"]), _pct(d.get("pass_rate")), _pct(d.get("faster_than_eager")),
                     _pct(d.get("faster_than_compile")), _x(d.get("geomean_vs_eager")),
                     _x(d.get("geomean_vs_compile")), _x(d.get("geomean_vs_compile_all"))])
    return rows


def _md_table(rows: list[list[str]]) -> str:
    head, *body = rows
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines)


def _html_table(rows: list[list[str]], raw_cols: tuple[int, ...] = ()) -> str:
    head, *body = rows
    out = ["<table><thead><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr></thead><tbody>"]
    for r in body:
        out.append("<tr>" + "".join(f"<td>{c if i in raw_cols else html.escape(c)}</td>" for i, c in enumerate(r))
                   + "</tr>")
    out.append("</tbody></table>")
    return "\n".join(out)


def _plots(records: list[BenchRecord], m: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for base, style in (("eager", "-o"), ("compile", "-s")):
        fp = m["overall"].get(f"fast_p_vs_{base}") or {}
        ax.plot(list(FAST_P), [fp.get(str(p), 0) or 0 for p in FAST_P], style, label=f"vs {base}")
    ax.set_xlabel("speedup threshold p")
    ax.set_ylabel("fast_p (share of tasks correct and faster than p)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "fast_p.png", dpi=120)
    plt.close(fig)
    made.append("fast_p.png")

    sp = [r.speedup_vs_compile for r in records if r.correct and r.speedup_vs_compile]
    fig, ax = plt.subplots(figsize=(6, 4))
    if sp:
        lo, hi = min(sp), max(sp)
        bins = [10 ** (math.log10(lo) + i * (math.log10(hi) - math.log10(lo) + 1e-9) / 20) for i in range(21)] \
            if hi > lo else 10
        ax.hist(sp, bins=bins, color="#4477aa")
        ax.set_xscale("log")
        ax.axvline(1.0, color="k", lw=1)
    ax.set_xlabel("speedup vs torch.compile (correct solutions)")
    ax.set_ylabel("tasks")
    fig.tight_layout()
    fig.savefig(out / "speedups.png", dpi=120)
    plt.close(fig)
    made.append("speedups.png")
    return made


def _task_rows(records: list[BenchRecord], out: Path, for_html: bool) -> list[list[str]]:
    rows = [["Level", "Task", "Status", "Reward", "vs eager", "vs compile", "Flags", "Trajectory"]]
    for r in sorted(records, key=lambda r: (r.level, r.task_name)):
        link = "-"
        if r.trajectory:
            try:
                rel = Path(r.trajectory).resolve().relative_to(out.resolve())
            except ValueError:
                rel = Path(r.trajectory)
            link = f'<a href="{html.escape(str(rel))}">trajectory</a>' if for_html else f"[trajectory]({rel})"
        status = r.status + (f" ({r.rule})" if r.rule else "")
        rows.append([r.level, r.task_name, status, f"{r.reward:g}", _x(r.speedup_vs_eager), _x(r.speedup_vs_compile),
                     ", ".join(r.flags) or "-", link])
    return rows


def write_report(results: Path, out: Path | None = None, threshold: float = 0.05) -> tuple[Path, Path]:
    """Write report.md, report.html, metrics.json and the plots next to RESULTS (or in `out`)."""
    path = results / "results.jsonl" if results.is_dir() else results
    if not path.is_file():
        raise ValueError(f"{results}: no results.jsonl there")
    records = list(latest(ResultsFile(path).read()).values())
    if not records:
        raise ValueError(f"{path} holds no records")
    out = out or path.parent
    out.mkdir(parents=True, exist_ok=True)
    m = by_level(records, threshold)
    (out / "metrics.json").write_text(json.dumps(m, indent=1))
    plots = _plots(records, m, out)
    o = m["overall"]
    fast = " ".join(f"fast_{p}={_pct(o['fast_p_vs_compile'].get(str(p)))}" for p in (1.0, 1.5, 2.0))
    extra = (f"Threshold: more than {100 * threshold:g}% faster. Without it: faster than eager "
             f"{_pct(o.get('faster_than_eager_no_threshold'))}, than torch.compile "
             f"{_pct(o.get('faster_than_compile_no_threshold'))}. Over all {o['tasks']} tasks with failures as 1.0x: "
             f"geomean {_x(o.get('geomean_vs_eager_all'))} vs eager, {_x(o.get('geomean_vs_compile_all'))} vs "
             f"torch.compile. Over correct solutions: mean {_x(o.get('mean_vs_compile'))}, median "
             f"{_x(o.get('median_vs_compile'))} vs torch.compile. KernelBench fast_p vs torch.compile: {fast}.")
    counts = (f"Statuses: {', '.join(f'{k} {v}' for k, v in o['statuses'].items())}. "
              f"Rewards: {', '.join(f'{k}: {v}' for k, v in o['rewards'].items())}. "
              f"Flags: {', '.join(f'{k} {v}' for k, v in o['flags'].items()) or 'none'}.")
    md = ["# Benchmark report", "", _md_table(_table1(m)), "", extra, "", counts, ""]
    md += [f"![{p}]({p})" for p in plots]
    md += ["", "## Tasks", "", _md_table(_task_rows(records, out, False)), ""]
    md_path = out / "report.md"
    md_path.write_text("\n".join(md))
    page = ["<!doctype html><html><head><meta charset='utf-8'><title>cuda-agent benchmark report</title>",
            "<style>body{font-family:sans-serif;margin:2em;max-width:75em}table{border-collapse:collapse;margin:1em 0}"
            "td,th{border:1px solid #ccc;padding:.3em .6em;text-align:right}td:nth-child(2),th:nth-child(2)"
            "{text-align:left}img{max-width:48%}</style></head><body>",
            "<h1>Benchmark report</h1>", _html_table(_table1(m)), f"<p>{html.escape(extra)}</p>",
            f"<p>{html.escape(counts)}</p>", "".join(f"<img src='{p}' alt='{p}'>" for p in plots),
            "<h2>Tasks</h2>", _html_table(_task_rows(records, out, True), raw_cols=(7,)), "</body></html>"]
    html_path = out / "report.html"
    html_path.write_text("\n".join(page))
    return md_path, html_path
