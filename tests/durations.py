"""Where the suite's time goes: a report of the durations that ``make test-durations`` records.

With ``FASTREDUCE_DURATIONS=PATH`` set, ``tests/conftest.py`` appends one JSON line per
test phase (setup, call, teardown) to PATH: the test's node id, its seconds, its outcome
and the pass (``default``, or the transport of a ``FASTREDUCE_TRANSPORT`` rerun). This
script reads one or more such files and prints, per pass and file, the number of cases
and the seconds spent in fixtures (setup and teardown: where the module fixtures start
their rank groups) and in the tests' own calls; then the time per kind of cost, and the
slowest tests::

    python tests/durations.py .durations/default.jsonl .durations/process_group.jsonl
    python tests/durations.py --compare BEFORE.jsonl -- AFTER.jsonl   # per file, before and after

Under xdist the seconds are each test's own, summed over both workers: the wall time of
the run is printed by ``make test-durations`` itself.

The kinds are read from the node ids (the table ``KINDS``, first match wins): every test
that starts processes is one kind or another, and what is left runs in the pytest process.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

KINDS: list[tuple[str, str]] = [
    ("the stress run (2,000 random steps)", r"test_stress\.py"),
    ("network namespaces (slow links, partitions, two hosts)", r"test_partition\.py|test_multihost\.py"),
    ("bench smoke runs (fastreduce bench --quick)", r"test_bench\.py"),
    ("torch.compile (inductor / aot_eager compiles)", r"test_compile\.py|compile"),
    ("torchrun launches (examples, trainers, elastic restarts)",
     r"test_readme\.py|test_transformers\.py|test_lightning\.py|test_elastic\.py::test_killed|torchrun"),
    ("killed ranks and timeouts waited out", r"test_faults\.py|test_errors\.py::test_.*(timeout|lost|hang)"),
    ("subprocess CLI runs (fastreduce info, imports)", r"test_info\.py|test_imports\.py|test_backends\.py|test_compat\.py"),
    ("rank groups: spawn, group init and training steps",
     r"test_(fused|overlap|zero|decentralized|local|join|numerics|nonfinite|error_feedback|errors|elastic|shm|"
     r"comm|transports|optimum_habana)\.py"),
    ("in the pytest process only", r"."),
]


def load(paths: list[str]) -> list[dict]:
    rows = []
    for p in paths:
        for line in Path(p).read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                row["node"] = row["node"].split("@", 1)[0]  # xdist's loadgroup suffix
                rows.append(row)
    return rows


def kind_of(node: str) -> str:
    return next(name for name, pattern in KINDS if re.search(pattern, node))


def per_file(rows: list[dict]) -> dict[tuple[str, str], list[float]]:
    """(pass, file) -> [cases, fixture seconds, call seconds]."""
    out: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for r in rows:
        rec = out[(r["pass"], r["node"].split("::", 1)[0])]
        if r["when"] == "call" or (r["when"] == "setup" and r["outcome"] == "skipped"):
            rec[0] += 1
        rec[2 if r["when"] == "call" else 1] += r["seconds"]
    return out


def report(rows: list[dict], top: int) -> None:
    files = per_file(rows)
    print(f"{'pass':14s} {'file':36s} {'cases':>6s} {'fixtures s':>11s} {'calls s':>9s} {'total s':>9s}")
    for (pss, f), (n, fix, call) in sorted(files.items(), key=lambda kv: -(kv[1][1] + kv[1][2])):
        print(f"{pss:14s} {f:36s} {n:6d} {fix:11.1f} {call:9.1f} {fix + call:9.1f}")
    total = sum(v[1] + v[2] for v in files.values())
    print(f"{'':14s} {'all':36s} {sum(v[0] for v in files.values()):6d} {'':11s} {'':9s} {total:9.1f}\n")
    kinds: dict[str, float] = defaultdict(float)
    for r in rows:
        kinds[kind_of(r["node"])] += r["seconds"]
    print("where the time goes (seconds summed over tests, share of the total):")
    for name, s in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"  {s:8.1f}  {100 * s / max(total, 1e-9):5.1f}%  {name}")
    tests: dict[tuple[str, str], float] = defaultdict(float)
    for r in rows:
        tests[(r["pass"], r["node"])] += r["seconds"]
    print(f"\nthe {top} slowest tests (setup included: a module fixture's spawn counts for its first test):")
    for (pss, node), s in sorted(tests.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {s:7.1f}  {pss:14s} {node}")


def compare(before: list[dict], after: list[dict]) -> None:
    b, a = per_file(before), per_file(after)
    print("| pass | file | cases before | cases after | s before | s after |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for key in sorted(set(b) | set(a), key=lambda k: -(sum(b.get(k, [0, 0, 0])[1:]))):
        nb, *sb = b.get(key, [0, 0.0, 0.0])
        na, *sa = a.get(key, [0, 0.0, 0.0])
        print(f"| {key[0]} | {key[1].removeprefix('tests/')} | {nb} | {na} | {sum(sb):.0f} | {sum(sa):.0f} |")
    tb = sum(sum(v[1:]) for v in b.values())
    ta = sum(sum(v[1:]) for v in a.values())
    print(f"| | all | {sum(v[0] for v in b.values())} | {sum(v[0] for v in a.values())} | {tb:.0f} | {ta:.0f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="JSON-lines files written under FASTREDUCE_DURATIONS")
    ap.add_argument("--compare", nargs="+", metavar="BEFORE", help="per-file table: these files before, FILES after")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    if args.compare:
        compare(load(args.compare), load(args.files))
    else:
        report(load(args.files), args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
