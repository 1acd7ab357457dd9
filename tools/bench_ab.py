"""Two checkouts of fastreduce, side by side: a bench suite run on each, interleaved, and each
figure's median over the rounds with its ratio (B over A).

    python tools/bench_ab.py --a /tmp/old --b . --suite optim --rounds 3 -- --ranks 2

Each run is ``python -m fastreduce bench SUITE --json ARGS`` with ``PYTHONPATH`` set to the
checkout (its ranks inherit it), in the order A B, B A, A B, ... so that neither side always
runs second on a warmer machine. The figures compared are the suite's times and stalls
(``FIGURES``); the held-out losses of the chaos suite are compared too (the same seeds, so
they should be equal). Writes every run's JSON and a summary into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

FIGURES = {
    "optim": r"/methods/[^/]+/(median_ms|speedup_vs_ddp)$",
    "step": r"/(median_ms|speedup_vs_ddp)$",
    "faults": r"/contenders/[^/]+/(median_step_s|loss_stall_s|join_stall_s|membership_loss_stall_s|membership_join_stall_s)$",
    "chaos": r"/(chaos|failure_free)/(median_step_s|max_stall_s|heldout)$|/per_loss\[\d+\]/stall_s$",
}


def leaves(x: Any, path: str = "") -> dict[str, float]:
    """Every number in ``x`` by its path (``/a/b[0]/c``)."""
    out: dict[str, float] = {}
    if isinstance(x, dict):
        for k, v in x.items():
            out.update(leaves(v, f"{path}/{k}"))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            out.update(leaves(v, f"{path}[{i}]"))
    elif isinstance(x, (int, float)) and not isinstance(x, bool):
        out[path] = float(x)
    return out


def run(checkout: Path, suite: str, args: list[str], out: Path, timeout: float) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "fastreduce", "bench", suite, "--json", "--out", str(out), *args],
                          cwd=checkout, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{checkout}: bench {suite} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    (out / "result.json").write_text(proc.stdout)
    print(f"  {checkout} {suite}: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    return json.loads(proc.stdout)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", type=Path, required=True, help="the checkout to compare against (the old one)")
    p.add_argument("--b", type=Path, required=True, help="the checkout compared (the new one)")
    p.add_argument("--suite", required=True, choices=sorted(FIGURES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("bench-results/ab"))
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds one run may take")
    p.add_argument("--reuse", action="store_true", help="read the runs already in --out instead of running them")
    p.add_argument("args", nargs="*", help="the suite's own options (after --)")
    ns = p.parse_args(argv)
    runs: dict[str, list[dict[str, float]]] = {"a": [], "b": []}
    for r in range(ns.rounds):
        for side in ("a", "b") if r % 2 == 0 else ("b", "a"):
            out = ns.out / ns.suite / f"{side}{r}"
            out.mkdir(parents=True, exist_ok=True)
            saved = out / "result.json"
            got = leaves(json.loads(saved.read_text()) if ns.reuse else
                         run(getattr(ns, side).resolve(), ns.suite, ns.args, out, ns.timeout))
            runs[side].append({k: v for k, v in got.items() if re.search(FIGURES[ns.suite], k)})
    keys = sorted(set.intersection(*(set(x) for x in runs["a"] + runs["b"])))
    rows = []
    for k in keys:
        a = statistics.median(x[k] for x in runs["a"])
        b = statistics.median(x[k] for x in runs["b"])
        rows.append({"figure": k, "a": a, "b": b, "ratio": b / a if a else float("nan")})
    summary = {"suite": ns.suite, "args": ns.args, "rounds": ns.rounds, "a": str(ns.a), "b": str(ns.b), "rows": rows}
    (ns.out / ns.suite / "summary.json").write_text(json.dumps(summary, indent=1))
    width = max((len(r["figure"]) for r in rows), default=10)
    print(f"{'figure':<{width}}  {'A':>10}  {'B':>10}  B/A")
    for r in rows:
        print(f"{r['figure']:<{width}}  {r['a']:>10.4g}  {r['b']:>10.4g}  {r['ratio']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
