"""What the bench suites hand back: target verdicts, text lines, the CSV and the chart.

The chart needs matplotlib, an optional extra (``pip install 'fastreduce[plot]'``);
without it :func:`write_chart` draws nothing and says so in one line.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from ..plan_cli import pyplot  # (the library's: `fastreduce plan --sweep` draws too)

__all__ = ["CSV_FIELDS", "judge_ratios", "pyplot", "target_lines", "write_chart", "write_csv"]

CSV_FIELDS = ("model", "method", "median_ms", "p10_ms", "p90_ms", "mb_wire", "speedup_vs_ddp")

_CHECKS: dict[str, Callable[[float, float], bool]] = {"<=": float.__le__, ">=": float.__ge__}


def judge_ratios(specs: Iterable[tuple[str, str, str, str, float]], median: Callable[[str], float],
                 where: str = "") -> dict[str, dict[str, Any]]:
    """Verdict of each ``(name, numerator, denominator, op, limit)`` on the medians' ratio."""
    targets = {}
    for name, num, den, op, limit in specs:
        value = median(num) / median(den)
        targets[name] = {"value": value, "limit": limit, "op": op, "pass": _CHECKS[op](value, limit),
                         "what": f"{where}{num} / {den}"}
    return targets


def target_lines(targets: dict[str, dict[str, Any]], width: int = 22) -> list[str]:
    """One ``PASS``/``FAIL`` line per target (names padded to ``width``, or wider); ``SKIP``
    and why where it was not judged (``pass`` None: a method in it was not timed)."""
    width = max([width] + [len(name) + 2 for name in targets])
    lines = []
    for name, t in targets.items():
        if t["pass"] is None:
            lines.append(f"  SKIP  {name:<{width}}{t['what']}")
            continue
        value = f"{t['value']:.3f}" if isinstance(t["value"], float) else str(t["value"])
        lines.append(f"  {'PASS' if t['pass'] else 'FAIL'}  {name:<{width}}{t['what']} = {value} "
                     f"({t['op']} {t['limit']})")
    return lines


def write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    """One row per (model, method) with the :data:`CSV_FIELDS` columns."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for row in rows:
            w.writerow({k: (f"{v:.4f}" if isinstance(v, float) else v) for k, v in row.items()})


def write_chart(path: Path, rows: Sequence[dict[str, Any]], title: str,
                reference: str | None = None) -> str | None:
    """Bar chart of median step time, p10-p90 error bars, one group of bars per model.

    ``reference`` names a method drawn hatched and grey (a floor, not a contender).

    Returns ``None`` when written, else a one-line note saying why not.
    """
    plt = pyplot()
    if plt is None:
        return "chart skipped: matplotlib is not installed (pip install 'fastreduce[plot]')"
    models = list(dict.fromkeys(r["model"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    by_key = {(r["model"], r["method"]): r for r in rows}
    n = len(methods)
    width = 0.8 / n
    fig, ax = plt.subplots(figsize=(max(8.0, 1.2 + 0.55 * n * len(models)), 5.0))
    cmap = plt.get_cmap("tab20")
    palette = [cmap(i) for i in range(20) if i not in (14, 15)]  # tab20 without its greys (the reference's)
    for j, method in enumerate(methods):
        xs, med, lo, hi, speed = [], [], [], [], []
        for i, model in enumerate(models):
            r = by_key.get((model, method))
            if r is None:
                continue
            xs.append(i - 0.4 + width * (j + 0.5))
            med.append(r["median_ms"])
            lo.append(r["median_ms"] - r["p10_ms"])
            hi.append(r["p90_ms"] - r["median_ms"])
            speed.append(r.get("speedup_vs_ddp"))
        ref = method == reference
        bars = ax.bar(xs, med, width * 0.92, yerr=[lo, hi], capsize=2,
                      label=f"{method} (reference)" if ref else method,
                      color="0.85" if ref else palette[j % len(palette)], hatch="//" if ref else None,
                      edgecolor="0.5" if ref else None, error_kw={"elinewidth": 0.8, "ecolor": "0.2"})
        for bar, s, h in zip(bars, speed, hi):
            if s is not None and math.isfinite(s):
                ax.annotate(f"{s:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height() + h),
                            xytext=(0, 2), textcoords="offset points", ha="center", va="bottom",
                            fontsize=6.5, rotation=90)
    ax.set_xticks(range(len(models)))
    ax.set_xticklabels(models)
    ax.set_ylabel("step time, ms (median; bars p10-p90)")
    ax.set_title(title, fontsize=9)
    ax.margins(y=0.15)
    ax.legend(fontsize=7, ncol=2, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="y", alpha=0.3)
    fig.text(0.01, 0.01, "label above a bar: speed-up against ddp_fp32 (higher is better)", fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return None
