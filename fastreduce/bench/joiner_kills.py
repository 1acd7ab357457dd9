"""``fastreduce bench chaos --joiner-runs N``: a replacement killed at each point of its joining.

Per mode :class:`fastreduce.Membership` runs (:data:`.chaos.MODES`), transport and kill point
(:data:`.chaos.JOINER_POINTS`), ``N`` jobs of the chaos suite's members (:func:`.chaos.member`:
the seeded MLP, AdamW, 0.02 s between steps): 4 members; the last one dies mid-step at step
:data:`KILL_STEP`; once the survivors have committed 3 more steps, a replacement (started with
the others, its imports done) is told to join, and dies at the point: ``admitted`` (as the
members admit it, before it enters the epoch formed for it), ``healing`` (as its healing
begins, the member sending it the state in the transfer) or ``first-step`` (after its first
backward, the members at their first step with it); once it is gone and 3 more steps are
committed, a second replacement joins for good, and the job trains to :data:`STEPS` steps.

Per job: the **joiner's stall** (from the first replacement's signal to the second's: the
longest time between two committed steps of a survivor, less the median step: what the join
and the loss cost training, both in one step where the replacement died as it was admitted),
the first loss's stall beside it (a loss like any other), whether every live member (the
three survivors and the second replacement) reached the last step with no error (none left
out of an epoch), and whether their parameters were bit-identical at every committed step
(DiLoCo: at its syncs; gossip: its rank 0's, and every member's exact mean at the end) and at
the end. Per cell: the worst over its jobs. Targets: the worst stall at most 2 s on Gloo and
0.5 s on shared memory; every live member at the last step, bit-identical, in every job.
"""

from __future__ import annotations

import csv
import time
import traceback
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from .chaos import JOINER_POINTS, ChaosConfig, _digests, failed, records_of, start_members
from .common import machine_info
from .faults import TIMEOUT_S, Shared, _env, _median_step, _wait

__all__ = ["KILL_STEP", "STEPS", "format_text", "run_joiner_kills", "write_outputs"]

STEPS = 60
"""Committed steps of each job (a multiple of DiLoCo's ``sync_every``, 10)."""
KILL_STEP = 8
"""The step the last first member dies at (mid-step): the replacement's predecessor."""
AFTER = 3
"""Steps the survivors commit after a loss before the next replacement is told to join."""
TARGET_S = {"process_group": 2.0, "shm": 0.5}


def _config(cfg: ChaosConfig) -> ChaosConfig:
    """The members' settings: the chaos suite's, at :data:`STEPS` steps and 0.02 s between steps."""
    return replace(cfg, steps=STEPS, kinds=("mid-step",), join_after=AFTER, pace_s=0.02, joiner_runs=0)


def run_job(cfg: ChaosConfig, mode: str, transport: str, point: str, out: Path) -> dict[str, Any]:
    """One job: its processes' records and when each replacement was told to join."""
    from ..launch import rank_context
    from ..membership import serve

    ctx = rank_context("fastreduce.bench.chaos")
    n, last = cfg.members + 2, cfg.members - 1
    shared = [Shared.make(ctx, 1 << 30, n), Shared.make(ctx, 1 << 30, n)]  # the launcher tells each to join
    kills = {last: {"kind": "mid-step", "step": KILL_STEP}, cfg.members: {"kind": point, "step": 0}}
    env = _env(FASTREDUCE_HEARTBEAT_S=str(cfg.heartbeat_s), FASTREDUCE_TRANSPORT=transport)
    server = serve(0, "127.0.0.1")
    procs = start_members(ctx, n, cfg, mode, server.port, out, env, kills, shared)
    told: list[float] = []
    try:
        _tell(procs, shared, [last, cfg.members], told, out, set(kills), time.time() + TIMEOUT_S)
    finally:
        _wait(procs, time.time())
    return {"records": records_of(out, n), "told": told, "codes": [p.exitcode for p in procs]}


def _tell(procs: list[Any], shared: list[Shared], dying: list[int], told: list[float], out: Path,
          victims: set[int], deadline: float) -> None:
    """Tell replacement k to join once ``dying[k]`` has exited and :data:`AFTER` more steps are
    committed; until every process ended, or one that is no victim ended with an error."""
    since = None
    while time.time() < deadline and any(p.is_alive() for p in procs):
        k = len(told)
        if k < len(dying) and procs[dying[k]].exitcode is not None:
            since = shared[0].progress.value if since is None else since
            if shared[0].progress.value >= since + AFTER:
                shared[k].go.set()
                told.append(time.time())
                since = None
        if failed(procs, out, victims):
            deadline = min(deadline, time.time() + 5)
        time.sleep(0.02)


def _stall(records: list[dict[str, Any]], start: float, end: float, median: float) -> float | None:
    """The longest time between two committed steps of ``records`` ending in ``[start, end]``,
    less the median step."""
    gaps = []
    for r in records:
        ends = [t1 for _, t1, ok, _ in r["iters"] if ok]
        gaps += [b - a for a, b in zip(ends, ends[1:]) if start <= b <= end]
    return max(gaps) - median if gaps else None


def figures(cfg: ChaosConfig, job: dict[str, Any], mode: str) -> dict[str, Any]:
    """One job's figures (see the module doc)."""
    records, told = job["records"], job["told"]
    missing = [i for i in (*range(cfg.members - 1), cfg.members + 1) if records.get(i) is None]
    if missing or len(told) < 2:
        return {"error": f"processes {missing} left no record, or a replacement was never told to join "
                         f"(told: {len(told)}; exit codes {job['codes']})"}
    live = {i: r for i, r in records.items() if r is not None and not r["killed"]}
    errors = {i: r["error"].strip().splitlines()[-1] for i, r in live.items() if r["error"]}
    survivors = [live[i] for i in range(cfg.members - 1) if i in live]
    median = _median_step(list(live.values()))
    reached = not errors and all(r["final_step"] == cfg.steps for r in live.values()) and len(live) == cfg.members
    digests = _digests(live, [{"replacement": cfg.members + 1}], per_step=mode != "gossip")
    return {"reached": reached, "identical": bool(digests["equal"]), "errors": errors,
            "joiner_stall_s": _stall(survivors, told[0], told[1], median),
            "loss_stall_s": _stall(survivors, 0.0, told[0], median),
            "losses": sorted({r["counters"].get("losses", -1) for r in survivors}), "median_step_s": median}


def run_joiner_kills(cfg: ChaosConfig) -> dict[str, Any]:
    """Every mode, transport and kill point, ``cfg.joiner_runs`` jobs each; the report."""
    import tempfile

    t0, runs = time.perf_counter(), cfg.joiner_runs
    member_cfg = _config(cfg)
    report: dict[str, Any] = {"scenario": "joiner_kills", "config": {**asdict(member_cfg), "runs": runs},
                              "machine": machine_info(), "cells": []}
    for mode in cfg.modes:
        for transport in cfg.transports:
            for point in JOINER_POINTS:
                jobs = []
                for _ in range(runs):
                    with tempfile.TemporaryDirectory(prefix=f"fastreduce-joiner-{mode}-{transport}-") as tmp:
                        try:
                            jobs.append(figures(member_cfg, run_job(member_cfg, mode, transport, point, Path(tmp)),
                                                mode))
                        except Exception:  # noqa: BLE001 - one job's failure is a row of the report
                            jobs.append({"error": traceback.format_exc()[-2000:]})
                report["cells"].append(_cell(mode, transport, point, jobs))
    report["targets"] = judge(report)
    report["config"]["wall_seconds"] = round(time.perf_counter() - t0, 1)
    return report


def _cell(mode: str, transport: str, point: str, jobs: list[dict[str, Any]]) -> dict[str, Any]:
    ran = [j for j in jobs if "error" not in j]
    stalls = [j["joiner_stall_s"] for j in ran if j["joiner_stall_s"] is not None]
    return {"mode": mode, "transport": transport, "point": point, "runs": len(jobs), "failed": len(jobs) - len(ran),
            "worst_stall_s": max(stalls, default=None), "stalls_s": [round(s, 3) for s in stalls],
            "loss_stall_s": max((j["loss_stall_s"] for j in ran if j["loss_stall_s"] is not None), default=None),
            "reached": all(j["reached"] for j in ran) and len(ran) == len(jobs),
            "identical": all(j["identical"] for j in ran) and len(ran) == len(jobs),
            "errors": [j["error"] for j in jobs if "error" in j] + [e for j in ran for e in j["errors"].values()]}


def judge(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per cell: the worst stall within its transport's target; every job's live members at the
    last step, bit-identical."""
    targets = {}
    for c in report["cells"]:
        key = f"{c['mode']}/{c['transport']}/{c['point']}"
        worst = c["worst_stall_s"]
        limit = TARGET_S.get(c["transport"], 2.0)
        targets[f"{key} stall"] = {"value": "none" if worst is None else worst, "limit": limit, "op": "<=",
                                   "pass": worst is not None and worst <= limit,
                                   "what": "the worst stall at the joiner's loss (s)"}
        targets[f"{key} members"] = {"value": int(not (c["reached"] and c["identical"])), "limit": 0, "op": "<=",
                                     "pass": c["reached"] and c["identical"],
                                     "what": "jobs where a live member missed the last step or differed (0: none)"}
    return targets


def format_text(report: dict[str, Any]) -> str:
    c = report["config"]
    lines = [f"joiner kills: {c['members']} members, MLP of {c['params_m']:g}M params, {c['steps']} committed steps, "
             f"the last member killed mid-step at step {KILL_STEP}, its replacement killed as it joins, a second "
             f"replacement joining for good; {c['runs']} job(s) per cell", "",
             f"{'mode':<11}{'transport':<14}{'point':<12}{'runs':>5}{'worst stall':>12}{'a loss':>8}"
             f"{'all at the end':>16}{'identical':>10}"]
    for cell in report["cells"]:
        worst = "-" if cell["worst_stall_s"] is None else f"{cell['worst_stall_s']:.2f}"
        loss = "-" if cell["loss_stall_s"] is None else f"{cell['loss_stall_s']:.2f}"
        lines.append(f"{cell['mode']:<11}{cell['transport']:<14}{cell['point']:<12}{cell['runs']:>5}{worst:>12}"
                     f"{loss:>8}{'yes' if cell['reached'] else 'NO':>16}{'yes' if cell['identical'] else 'NO':>10}")
        for err in cell["errors"][:3]:
            lines.append(f"    {err.strip().splitlines()[-1] if err.strip() else err}")
    lines += ["", "(worst stall: the longest time between two committed steps of a survivor from the first "
              "replacement's signal to join to the second's, less the median step: its join and its loss; "
              "a loss: the same at the first member's loss, for comparison; all at the end: every live member "
              "reached the last step with no error, in every job; identical: their parameters equal at every "
              "committed step and at the end)"]
    if report["targets"]:
        from .report import target_lines
        lines += ["", "targets (report only):", *target_lines(report["targets"], width=40)]
    return "\n".join(lines)


FIELDS = ("mode", "transport", "point", "runs", "failed", "worst_stall_s", "loss_stall_s", "reached", "identical",
          "stalls_s")


def write_outputs(report: dict[str, Any], out: Path) -> dict[str, Any]:
    """``joiner_kills.csv``: a row per mode, transport and kill point."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "joiner_kills.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        for cell in report["cells"]:
            w.writerow({**cell, "stalls_s": " ".join(map(str, cell["stalls_s"]))})
    return {"joiner_kills_csv": str(path)}
