"""``fastreduce bench chaos --freeze S``: a member stopped whole, then back (:mod:`.chaos`).

One first member that no kill takes (and not the straggler: :func:`freeze_plan`) is stopped
whole by the launcher (``SIGSTOP`` to its process, every thread with it, its heartbeat's
too: as ``kill -STOP``, a host that hangs or a paused VM do) at whatever it is doing once the
members have committed a step drawn from ``seed`` in the first half of the run (where it
comes within 3 steps of no kill, join, straggler window or etcd leader's kill, if there is
such a place), and sent ``SIGCONT`` ``S`` seconds later, or earlier where the others reach
:func:`thaw_by` committed steps first (so that it comes back before the job ends: a fast
mode trains 100 steps a second here). The others find it silent and form an epoch without
it (a loss: one step discarded, or none); with ``--spares`` one more warm spare is started,
which that loss takes in. Thawed, it finds itself left out and joins the job again in the
same process (``Membership``'s rejoin: the ``commit()`` of the step it was in returns
``False``, ``counters.rejoins`` counts it, the members' state is sent it), and trains on to
the end with them (with a spare in its place, the world grows by one).

Its figures (:func:`freeze_figures`): the step it was stopped in and the seconds, the
others' stall at its loss (as at a kill's: from the end of their last committed step before
it to the end of the first after it, less one median step), the step and epoch it rejoined
at, the seconds from its thaw to its first commit back in the job (:func:`back_in`), and the
members' stall at its rejoin (the excess over the median of their steps in those seconds);
its parameters right after the rejoin are checked against the members' at that step
(gossip: rank 0's as it entered that epoch), as a replacement's heal is.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import signal
import threading
import time
from typing import Any, Callable

from .common import last_free

__all__ = ["FREEZE_MIN_S", "REJOIN_GRACE_S", "Freeze", "Freezer", "back_in", "but_frozen", "check_freeze",
           "freeze_checks", "freeze_figures", "freeze_line", "freeze_plan", "freeze_spare", "is_frozen_step",
           "mark_freeze_loss", "note_freeze", "thaw_by", "without_stop"]

FREEZE_MIN_S = 2.0
"""The shortest stop: the others must find the member silent (3 heartbeats of 0.25 s, a
stopped process on this host called lost at the next read) and form their epoch before it thaws."""


def check_freeze(cfg: Any, victims: set[int], straggler: int | None) -> None:
    """``ChaosConfig.freeze``'s errors (``victims``: the first members the kills take;
    ``straggler``: the straggler's index), each a ``ValueError``."""
    if not (cfg.freeze == 0 or (math.isfinite(cfg.freeze) and cfg.freeze >= FREEZE_MIN_S)):
        raise ValueError(f"freeze must be 0 (none) or at least {FREEZE_MIN_S:g} s (the others must find the member "
                         f"silent before it thaws), got {cfg.freeze:g}")
    if cfg.freeze and cfg.joiner_runs:
        raise ValueError("freeze is the chaos run's; --joiner-runs runs another scenario")
    if cfg.freeze and last_free(cfg.members, victims | {straggler}) is None:
        raise ValueError(f"no first member of {cfg.members} is left to freeze (the kills and the straggler take "
                         "them all): more members (--members), or fewer kinds")


def freeze_spare(cfg: Any, kills: list[dict[str, Any]], straggler: dict[str, Any] | None) -> int | None:
    """The process index of the spare started for the freeze's loss (``--spares``), or ``None``."""
    if not (cfg.freeze and cfg.spares):
        return None
    return cfg.members + len(kills) + (straggler is not None and straggler["spare"] is not None)


def freeze_plan(cfg: Any, kills: list[dict[str, Any]], straggler: dict[str, Any] | None,
                coordinator_step: int | None) -> dict[str, Any] | None:
    """The freeze (``None`` without ``--freeze``): the process ``index`` stopped once the
    members have committed ``step``, for ``seconds`` (or to :func:`thaw_by`); ``spare``: the
    process index of the spare started for it (or ``None``)."""
    taken = {k["victim"] for k in kills} | ({straggler["index"]} if straggler else set())
    index = last_free(cfg.members, taken) if cfg.freeze else None
    if index is None:
        return None
    busy = [(k["step"] - 3, k["step"] + 5) for k in kills]
    if not cfg.spares:
        busy += [(k["step"] + cfg.join_after - 3, k["step"] + cfg.join_after + 5) for k in kills]
    if straggler:
        busy.append((straggler["from"] - 3, straggler["to"] + 3))
    if coordinator_step is not None:
        busy.append((coordinator_step - 3, coordinator_step + 20))
    starts = range(cfg._start(), max(cfg._start() + 1, cfg.steps // 2))
    calm = [s for s in starts if not any(lo <= s <= hi for lo, hi in busy)]
    step = random.Random(f"chaos-freeze-{cfg.seed}").choice(calm or list(starts))
    return {"index": index, "step": step, "seconds": cfg.freeze, "spare": freeze_spare(cfg, kills, straggler)}


def thaw_by(steps: int) -> int:
    """The committed steps by which the frozen member is thawed at the latest: room left for
    its rejoin (the members' next poll, the state sent) and some steps with it."""
    return steps - max(min(30, steps // 3), steps // 5)


class Freezer(threading.Thread):
    """The launcher's thread that stops process ``pid`` (``SIGSTOP``) once ``progress`` (the
    committed steps, a shared value the members raise) reaches the plan's step, and lets it
    go on (``SIGCONT``) after the plan's seconds, or once ``progress`` reaches ``last``, or at
    :meth:`stop`; :attr:`result`: when and at which step."""

    def __init__(self, pid: int, plan: dict[str, Any], progress: Any, last: int):
        super().__init__(name="chaos-freeze", daemon=True)
        self.pid, self.plan, self.progress, self.last = pid, plan, progress, last
        self.done = threading.Event()
        self.result: dict[str, Any] | None = None

    def run(self) -> None:
        while self.progress.value < self.plan["step"]:
            if self.done.wait(0.005):
                return
        at, step = time.time(), self.progress.value
        try:
            os.kill(self.pid, signal.SIGSTOP)
        except ProcessLookupError:
            self.result = {"error": "the process had ended before its freeze"}
            return
        try:
            while time.time() < at + self.plan["seconds"] and self.progress.value < self.last:
                if self.done.wait(0.01):
                    break
        finally:
            thawed = time.time()  # (before the signal: a step it ends once going on ends after this)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)
        self.result = {"at": at, "thawed": thawed, "step": step}

    def stop(self) -> dict[str, Any] | None:
        self.done.set()
        self.join(10)
        return self.result


class Freeze:
    """The frozen member's side, in its own loop: :meth:`after` after each ``commit()``,
    which notes its rejoin in its record."""

    def __init__(self, events: dict[str, Any] | None, index: int):
        plan = (events or {}).get("freeze")
        self.plan = plan if plan and plan["index"] == index else None

    def after(self, m: Any, record: Any, digest: Callable[[], str]) -> None:
        """Once its commit found it left out and it joined again: the step and epoch it is in
        and its parameters then (``digest()``: the members' after that step; as ``entered``
        too, gossip's heal check). Not one that took its ticket to rejoin and found the job
        over (``m.left``): it never rejoined."""
        if self.plan is None or record.rejoined_step >= 0 or not m.counters.rejoins or m.left:
            return
        record.rejoined_step, record.rejoined_epoch = m.step, m.epoch.number
        record.digests[str(m.step)] = record.entered[str(m.epoch.number)] = digest()


def note_freeze(records: dict[int, dict[str, Any] | None], plan: dict[str, Any], result: dict[str, Any] | None) -> None:
    """The launcher's :class:`Freezer` result into the frozen member's record: ``frozen_s``
    (stop, thaw), ``frozen_index`` (its step it was stopped in), ``frozen_at`` (the committed
    steps when that step began) and ``left_out_at`` (those of its first step discarded from
    there: that one, or, stopped once that step's collectives were done, the next)."""
    r = records.get(plan["index"])
    if r is None or not result or "at" not in result:
        return
    r["frozen_s"] = [result["at"], result["thawed"]]
    # (no step of a stopped process ends while it is stopped: the one it was in ends after its thaw)
    k = next((k for k, (_, t1, _, _) in enumerate(r["iters"]) if t1 >= result["thawed"]), None)
    if k is not None:
        out = next((j for j in range(k, len(r["iters"])) if not r["iters"][j][2]), k)
        r.update(frozen_index=k, frozen_at=r["at"][k][0], left_out_index=out, left_out_at=r["at"][out][0])


def back_in(r: dict[str, Any]) -> float | None:
    """When the frozen member (record ``r``, :func:`note_freeze`'s) committed its first step
    back in the job: the end of its first committed step after the one it was left out in
    (DiLoCo's inner steps after its thaw commit alone until its sync finds it left out), or
    ``None`` where it did not rejoin."""
    if r.get("rejoined_step", -1) < 0 or r.get("left_out_index") is None:
        return None
    return next((t1 for _, t1, ok, _ in r["iters"][r["left_out_index"] + 1:] if ok), None)


def but_frozen(final: dict[int, dict[str, Any]], plan: dict[str, Any] | None) -> dict[int, dict[str, Any]]:
    """The final members but the frozen one: the stall another event cost (the etcd leader's
    kill, an eviction: the longest gap between two commits around it) is the others'; the
    frozen member's gap runs from its stop to its first commit back (a leader killed while it
    was stopped read as a stall of the stop's seconds, 4.0 s at ``--freeze 4``)."""
    return {i: r for i, r in final.items() if plan is None or i != plan["index"]}


def without_stop(r: dict[str, Any]) -> dict[str, Any]:
    """Record ``r`` without the step it was stopped in (a member's stall at another's join is
    its steps' excess over the median: not the seconds it was stopped)."""
    if r.get("frozen_index") is None:
        return r
    k = r["frozen_index"]
    return {**r, "iters": r["iters"][:k] + r["iters"][k + 1:]}


def is_frozen_step(r: dict[str, Any], event: dict[str, Any]) -> bool:
    """Whether a loss event of record ``r`` (:func:`note_freeze`'s) is its own freeze (its step
    discarded as it was left out), not a loss it saw."""
    return r.get("left_out_at", -1) >= 0 and event["at_step"] == r["left_out_at"]


def mark_freeze_loss(losses: list[dict[str, Any]], records: dict[int, dict[str, Any]], plan: dict[str, Any],
                     median: float) -> None:
    """Mark (``freeze``) which of the losses the others saw (:func:`.chaos._losses`') is the
    freeze's: the first whose failed step began at most two median steps before the frozen
    member's last step ended before it was stopped (whether the stop came inside a step or
    between two). The others were in the step after that one; the kills are 3 steps or more
    from it; a local-update mode sees it at its next sync."""
    r = records.get(plan["index"]) or {}
    k = r.get("frozen_index")
    at = None if k is None else (r["iters"][k - 1][1] if k else r["iters"][k][0]) - 2 * median
    mine = next((e for e in sorted(losses, key=lambda e: e["at_s"]) if at is not None and e["at_s"] >= at), None)
    for e in losses:
        e["freeze"] = e is mine


REJOIN_GRACE_S = {"builtin": 1.0, "etcd": 3.0}
"""Per coordinator, how long before the job's end a thawed member may come back and find it
over instead (no rejoin asked of it): a rejoin is admitted at the members' next vote, 0.06-0.5
s after the thaw on the built-in coordinator here and 0.6-3.0 s on etcd (a vote about once a
second, each request a quorum write)."""


def freeze_figures(plan: dict[str, Any], records: dict[int, dict[str, Any]], final: dict[int, dict[str, Any]],
                   first: float, median: float, losses: list[dict[str, Any]] = (),
                   grace_s: float = 0.0) -> dict[str, Any]:
    """What the freeze cost (the module doc): ``None`` values where it did not happen;
    ``losses``: the run's (:func:`.chaos._losses`), the freeze's marked (:func:`mark_freeze_loss`);
    ``kills_after``: how many of the others were still forming after its thaw (its ticket
    then taken: with spares it may fill that loss's room, or make the world one above its
    size before it, so that no spare is taken there); ``found_over``: thawed, it found the job
    over (``m.left``) and the others ended under ``grace_s`` after its thaw (``thaw_to_end_s``),
    too soon for a rejoin (:data:`REJOIN_GRACE_S`)."""
    from .faults import _join_stall

    r = records.get(plan["index"]) or {}
    mine = next((e for e in losses if e.get("freeze")), None)
    frozen = r.get("frozen_s") or None
    out: dict[str, Any] = {**{k: plan[k] for k in ("index", "step", "seconds", "spare")},
                           "frozen_at": r.get("frozen_at", -1) if frozen else None,
                           "frozen_s": [round(t - first, 4) for t in frozen] if frozen else None,
                           "rejoins": r.get("counters", {}).get("rejoins", 0), "rejoined_step": None,
                           "rejoined_epoch": None, "rejoin_s": None, "members_stall_s": None,
                           "loss_stall_s": None, "final_step": r.get("final_step"), "kills_after": 0,
                           "thaw_to_end_s": None, "found_over": False}
    if not frozen:
        return out
    others = but_frozen(final, plan)
    end = max((o["iters"][-1][1] for o in others.values() if o["iters"]), default=frozen[1])
    out["thaw_to_end_s"] = end - frozen[1]
    out["found_over"] = r.get("left_at", -1) >= 0 and r.get("rejoined_step", -1) < 0 and end - frozen[1] < grace_s
    out["loss_stall_s"] = mine["stall_s"] if mine else None
    back = back_in(r)
    if back is not None:
        joining = {"join_start": frozen[1], "first_commit": back}
        out["kills_after"] = sum(1 for e in losses if e is not mine and e["at_s"] + e["stall_s"] > frozen[1])
        out.update(rejoined_step=r["rejoined_step"], rejoined_epoch=r["rejoined_epoch"], rejoin_s=back - frozen[1],
                   members_stall_s=max((_join_stall(o, joining, median) for o in others.values()), default=None))
    return out


def freeze_checks(f: dict[str, Any] | None, steps: int) -> list[tuple[Any, ...]]:
    """The judge's check of a run's freeze: ``(name, value, op, limit, what)``."""
    if not f:
        return []
    back = int(f["rejoins"] == 1 and f["rejoined_step"] is not None and f["final_step"] == steps)
    return [("rejoined", back, "in", [0 if f.get("found_over") else 1, 1], "the frozen member left out, in the "
             "job again (counters.rejoins 1) and at the last step with the others (or, thawed too near the end, "
             "found the job over)")]


def freeze_line(key: str, f: dict[str, Any]) -> str:
    """The text report's line of a run's freeze."""
    def s(value: Any) -> str:
        return "-" if value is None else f"{value:.2f}"

    if not f["frozen_s"]:
        return f"  {key:<24} member {f['index']} NOT frozen (the run ended before step {f['step']})"
    t0, t1 = f["frozen_s"]
    over = f"; the job ended {s(f['thaw_to_end_s'])} s after its thaw, too soon: it found the job over" \
        if f.get("found_over") else ""
    back = (f"rejoined at step {f['rejoined_step']} (epoch {f['rejoined_epoch']}), its first commit back "
            f"{s(f['rejoin_s'])} s after its thaw, the members' stall {s(f['members_stall_s'])} s"
            if f["rejoined_step"] is not None else f"NOT rejoined (counters.rejoins {f['rejoins']}{over})")
    return (f"  {key:<24} member {f['index']} stopped at step {f['frozen_at']} ({t0:.2f}-{t1:.2f} s): the others' "
            f"stall {s(f['loss_stall_s'])} s; {back}")
