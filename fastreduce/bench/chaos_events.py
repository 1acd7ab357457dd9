"""``fastreduce bench chaos``'s failure kinds beside the member kills and joins (:mod:`.chaos`).

**A straggler** (``--straggler F``): one first member that no kill takes (the highest-index
one: :func:`straggler_plan`) works ``F`` times as long per step for a window of committed
steps (``straggler_steps``, default a fifth of the run) from a step drawn from ``seed`` (its
own draw: the kills are the same steps and victims as without it). In its loop, after its
backward and before ``commit()``, it sleeps ``F - 1`` times the seconds its own forward and
backward took (:class:`Slowdown`; gossip: at the end of its backward, inside ``commit``).
With ``--evict`` every member runs ``Membership(..., evict_slower_than=evict_slower_than (1.5),
evict_for_s=evict_for_s (3 s))`` (:func:`membership_policy`): the epoch's rank 0 asks a member
that works that many times the members' median per step for that many seconds to leave
(:class:`fastreduce.status.Evictions`); the straggler's ``m.left`` turns true at the next
poll, and its loop ends cleanly (its record saved, ``m.close()``). With ``--spares`` too, one
more warm spare is started for the eviction, and the epoch formed without the straggler
takes it in: the job is whole again. Its figures (:func:`straggler_figures`): the window (the
steps slowed and their wall times), whether and when it was evicted, the job's median step
before, during (to the eviction, or the window's end) and after, from the final members' steps.

**The coordinator's leader killed** (``--coordinator etcd``): the job's coordinator is a
3-member etcd cluster (:class:`.etcd.EtcdCluster`, its data on tmpfs, tuned for a LAN: 50 ms
heartbeat, 500 ms election, as ``tests/test_etcd.py``) started by the launcher for each run
(the failure-free one on etcd too), the members' address ``etcd://...`` (``poll_s`` 1 s, etcd's
default). At a step drawn from ``seed`` in the middle third of the run (away from the kills
and joins where it can be) a thread of the launcher that watches the committed steps kills
the etcd leader (SIGKILL; :class:`LeaderKill`); the cluster goes on with two. Its figures
(:func:`coordinator_figures`): the step and wall time of the kill, the stall (the longest gap
between two commits of a final member from the kill to :data:`STALL_WITHIN_S` after it, less
the median step).

**A member stopped whole and back** (``--freeze S``): :mod:`.chaos_freeze`.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from .chaos_freeze import back_in, check_freeze, freeze_checks, freeze_line, freeze_plan
from .common import last_free

__all__ = ["COORDINATORS", "LeaderKill", "Slowdown", "check_events", "coordinator",
           "coordinator_figures", "draw_events", "etcd_missing", "event_checks", "event_lines", "event_spares",
           "event_title", "eviction_epoch", "eviction_expected", "events_for", "legend_handles", "membership_policy",
           "only_untaken", "straggler_figures", "straggler_plan", "summary_cells", "summary_fields",
           "timeline_events"]

COORDINATORS = ("builtin", "etcd")
ETCD_MEMBERS = 3
COORDINATOR_STALL_S = 2.0
"""The etcd leader's kill: at most this stall (``tests/test_etcd.py``'s bound)."""
CALM_AFTER = 20
JOIN_LAG = 40
STALL_WITHIN_S = 3.0
"""The coordinator kill's stall: the longest gap between two commits that ends from the kill
to this many seconds after it."""
EVICTION_WITHIN_S = 0.5
"""The eviction's stall: the others form the epoch without it at the poll it left at."""
EVICTION_LAG_S = 4.0
"""How long past ``evict_for_s`` a straggler may stay slow before the policy must have asked it
to leave: the status each member publishes is read about once a second, and it is named only
in a read whose steps were slow (measured 2.3-3.7 s past ``evict_for_s`` here)."""


def etcd_missing() -> str | None:
    """Why ``--coordinator etcd`` cannot run on this machine, or ``None``."""
    from .etcd import etcd_binary

    missing = [] if etcd_binary() is not None else ["no etcd server on PATH"]
    import importlib.util

    if importlib.util.find_spec("etcd3gw") is None:
        missing.append("no etcd3gw package")
    if not missing:
        return None
    return (f"--coordinator etcd runs a {ETCD_MEMBERS}-member etcd cluster, and this machine has "
            f"{' and '.join(missing)}: apt-get install etcd-server (Debian, Ubuntu; any etcd on PATH) and "
            "pip install 'fastreduce[etcd]' (etcd3gw)")


def check_events(cfg: Any, schedule: Callable[[Any, str], list[dict[str, Any]]]) -> None:
    """``ChaosConfig``'s straggler and coordinator settings, each wrong one a ``ValueError``
    (``schedule``: :func:`.chaos.schedule`, whose victims the straggler must not be)."""
    if not (cfg.straggler == 0 or (math.isfinite(cfg.straggler) and cfg.straggler > 1)):
        raise ValueError(f"straggler must be 0 (none) or a factor above 1 (2: twice its step's work), "
                         f"got {cfg.straggler:g}")
    if cfg.straggler_steps < 0 or (cfg.straggler_steps and not cfg.straggler):
        raise ValueError(f"straggler_steps must be >= 0 (0: a fifth of the steps) and needs a straggler, got "
                         f"{cfg.straggler_steps}")
    if cfg.evict and not cfg.straggler:
        raise ValueError("evict needs a straggler to evict (--straggler F, F > 1)")
    if not cfg.evict_for_s > 0 or not cfg.evict_slower_than > 1:
        raise ValueError(f"evict_for_s must be positive and evict_slower_than above 1, got {cfg.evict_for_s:g} "
                         f"and {cfg.evict_slower_than:g}")
    if cfg.evict and not cfg.spares and cfg.members < 4:
        raise ValueError(f"evict without spares needs at least 4 members (the straggler out and a member "
                         f"killed still leave two), got {cfg.members}")
    if cfg.coordinator not in COORDINATORS:
        raise ValueError(f"coordinator must be one of {', '.join(COORDINATORS)}, got {cfg.coordinator!r}")
    if (cfg.straggler or cfg.coordinator != "builtin") and cfg.joiner_runs:
        raise ValueError("straggler and coordinator are the chaos run's; --joiner-runs runs another scenario")
    if cfg.straggler:
        window = straggler_window(cfg)
        if cfg.steps - window - straggler_tail(cfg) < cfg._start():
            raise ValueError(f"the straggler's window of {window} steps leaves no room in {cfg.steps} steps "
                             f"(steps before it and {straggler_tail(cfg)} after it)")
        if straggler_index(cfg, schedule(cfg, cfg.modes[0])) is None:
            raise ValueError(f"every first member of {cfg.members} is killed: no straggler to slow "
                             "(more members, or fewer kinds)")
    kills = schedule(cfg, cfg.modes[0])  # (the same victims in every mode)
    check_freeze(cfg, {k["victim"] for k in kills}, straggler_index(cfg, kills) if cfg.straggler else None)


# ---------------------------------------------------------------- the plan (the launcher)

def straggler_window(cfg: Any) -> int:
    """The steps the straggler is slowed for: ``straggler_steps``, or a fifth of the run."""
    return cfg.straggler_steps or max(2, cfg.steps // 5)


def straggler_tail(cfg: Any) -> int:
    """Steps left after the window at the latest (the job's pace after it)."""
    return max(5, cfg.steps // 10)


def straggler_index(cfg: Any, kills: list[dict[str, Any]]) -> int | None:
    """The highest-index first member no kill takes (``None``: every first member dies)."""
    return last_free(cfg.members, {k["victim"] for k in kills})


def straggler_plan(cfg: Any, kills: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The straggler (``None`` without ``--straggler``): its process ``index``, slowed from
    ``from`` committed steps to ``to`` (excluded) by ``factor`` (the window drawn where it
    comes within 3 steps of no kill or join, if there is such a place); ``evict``: the
    members' policy; ``spare``: the process index of the spare started for its eviction (or ``None``)."""
    index = straggler_index(cfg, kills) if cfg.straggler else None
    if index is None:
        return None
    window = straggler_window(cfg)
    starts = range(cfg._start(), cfg.steps - window - straggler_tail(cfg) + 1)
    busy = {k["step"] for k in kills} | (set() if cfg.spares else {k["step"] + cfg.join_after for k in kills})
    calm = [s for s in starts if not any(s - 3 <= b < s + window + 3 for b in busy)]  # clear of kills and joins
    start = random.Random(f"chaos-straggler-{cfg.seed}").choice(calm or list(starts))
    return {"index": index, "from": start, "to": start + window, "steps": window, "factor": cfg.straggler,
            "evict": cfg.evict, "evict_slower_than": cfg.evict_slower_than if cfg.evict else None,
            "evict_for_s": cfg.evict_for_s if cfg.evict else None,
            "spare": cfg.members + len(kills) if cfg.evict and cfg.spares else None}


def coordinator_kill_step(cfg: Any, kills: list[dict[str, Any]]) -> int | None:
    """The committed steps at which the etcd leader dies (``None``: the built-in coordinator):
    drawn in the middle third of the run where its next :data:`CALM_AFTER` steps are clear of
    the kills (from 3 steps before each to 5 after) and the joins (a replacement told to join
    is admitted at a vote, about one a second on etcd: up to :data:`JOIN_LAG` steps later),
    where there is such a step; else where the clearance after it is the longest."""
    if cfg.coordinator != "etcd":
        return None
    span = range(cfg.steps // 3, max(cfg.steps // 3 + 1, 2 * cfg.steps // 3))
    busy = [(k["step"] - 3, k["step"] + 5) for k in kills]
    if not cfg.spares:  # (spares: taken in at the loss)
        busy += [(k["step"] + cfg.join_after, k["step"] + cfg.join_after + JOIN_LAG) for k in kills]

    def clearance(s: int) -> int:  # steps from s to the next busy one (-1: s is in one, or just after)
        if any(lo <= s <= hi + 3 for lo, hi in busy):
            return -1
        return min([lo - s for lo, _ in busy if lo > s] + [cfg.steps - s])
    calm = [s for s in span if clearance(s) > CALM_AFTER]
    if not calm:
        best = max(clearance(s) for s in span)
        calm = [s for s in span if clearance(s) == best]
    return random.Random(f"chaos-coordinator-{cfg.seed}").choice(calm)


def events_for(cfg: Any, kills: list[dict[str, Any]], chaos: bool = True) -> dict[str, Any]:
    """A run's failures beside its ``kills``: the straggler's plan, the coordinator and the step
    its leader dies at, the freeze's plan. The failure-free run (``chaos`` false): the coordinator alone."""
    if not chaos:
        return {"straggler": None, "coordinator": cfg.coordinator, "coordinator_kill_step": None, "freeze": None}
    straggler, leader = straggler_plan(cfg, kills), coordinator_kill_step(cfg, kills)
    return {"straggler": straggler, "coordinator": cfg.coordinator, "coordinator_kill_step": leader,
            "freeze": freeze_plan(cfg, kills, straggler, leader)}


# ---------------------------------------------------------------- one process

def event_spares(events: dict[str, Any] | None) -> list[int]:
    """The process indices of the spares started beside the kills' (``--spares``): for the
    straggler's eviction and for the freeze's loss."""
    plans = [(events or {}).get(kind) for kind in ("straggler", "freeze")]
    return [p["spare"] for p in plans if p and p["spare"] is not None]


def membership_policy(events: dict[str, Any] | None) -> dict[str, Any]:
    """``Membership``'s eviction settings for a run (empty: the policy off, the default)."""
    plan = (events or {}).get("straggler")
    if not plan or not plan["evict"]:
        return {}
    return {"evict_slower_than": plan["evict_slower_than"], "evict_for_s": plan["evict_for_s"]}


class Slowdown:
    """The straggler's side, in its own loop: :meth:`sleep` after its backward (``since``: when
    its forward began), :meth:`note` after each step, into its record."""

    def __init__(self, events: dict[str, Any] | None, index: int):
        plan = (events or {}).get("straggler")
        self.plan = plan if plan and plan["index"] == index else None

    def slowed(self, step: int) -> bool:
        return self.plan is not None and self.plan["from"] <= step < self.plan["to"]

    def sleep(self, step: int, since: float) -> None:
        if self.slowed(step):
            time.sleep((self.plan["factor"] - 1) * (time.perf_counter() - since))

    def note(self, record: Any, before: int) -> None:
        """Its record's ``slowed_steps`` (first, last) and ``slowed_s`` (the first's begin, the
        last's end), where the step begun at ``before`` committed steps was slowed."""
        if not self.slowed(before):
            return
        t0, t1 = record.iters[-1][:2]
        if not record.slowed_steps:
            record.slowed_steps, record.slowed_s = [before, before], [t0, t1]
        record.slowed_steps[1], record.slowed_s[1] = before, t1


# ---------------------------------------------------------------- the launcher

@contextlib.contextmanager
def coordinator(events: dict[str, Any], serve: Callable[[], Any], progress: Any) -> Iterator[tuple[Any, dict]]:
    """A run's coordinator: ``(where, box)``, ``where`` the built-in one's port (``serve()``) or
    the etcd cluster's address; where the etcd leader dies, a :class:`LeaderKill` watching
    ``progress`` runs until the block ends, and ``box["kill"]`` is then its result."""
    box: dict[str, Any] = {}
    if events.get("coordinator") != "etcd":
        server = serve()  # (kept alive to the end of the block)
        yield server.port, box
        return
    from .etcd import LAN, temporary_cluster

    with temporary_cluster(ETCD_MEMBERS, "fastreduce-chaos-etcd-", **LAN) as cluster:
        killer = None
        if events.get("coordinator_kill_step") is not None:
            killer = LeaderKill(cluster, events["coordinator_kill_step"], progress)
            killer.start()
        try:
            yield cluster.address("chaos"), box
        finally:
            box["kill"] = killer.stop() if killer is not None else None


def only_untaken(procs: list[Any], out: Path, waiting: set[int], steps: int) -> bool:
    """Whether the processes still alive are spares or replacements of ``waiting`` never
    admitted (no ``<i>.joined``) and a final member (not killed, not evicted) has saved its
    record at ``steps``: the job is done without them."""
    if not all(i in waiting and not (out / f"{i}.joined").exists() for i, p in enumerate(procs) if p.is_alive()):
        return False
    for i in range(len(procs)):
        try:
            r = json.loads((out / f"{i}.json").read_text())
        except (OSError, ValueError):  # none yet, or being written
            continue
        if not r["killed"] and r.get("left_at", -1) < 0 and not r["error"] and r["final_step"] >= steps:
            return True
    return False


class LeaderKill(threading.Thread):
    """The launcher's thread that kills the etcd leader (SIGKILL) once ``progress`` (the
    committed steps, a shared value the members raise) reaches ``step``; :attr:`result`."""

    def __init__(self, cluster: Any, step: int, progress: Any):
        super().__init__(name="chaos-etcd-leader-kill", daemon=True)
        self.cluster, self.step, self.progress = cluster, step, progress
        self.done = threading.Event()
        self.result: dict[str, Any] | None = None

    def run(self) -> None:
        while not self.done.wait(0.01):
            if self.progress.value < self.step:
                continue
            try:
                leader = self.cluster.leader(10.0)
                at, step = time.time(), self.progress.value
                self.cluster.kill(leader)
                self.result = {"leader": leader, "step": step, "at": at, "etcd_alive": self.cluster.alive()}
            except Exception as e:  # noqa: BLE001 - a row of the report
                self.result = {"error": f"{type(e).__name__}: {e}"}
            return

    def stop(self) -> dict[str, Any] | None:
        self.done.set()
        self.join(40)
        return self.result


# ---------------------------------------------------------------- the figures

def _median_ms(durations: list[float]) -> float | None:
    return 1e3 * statistics.median(durations) if durations else None


def eviction_epoch(records: dict[int, dict[str, Any]], plan: dict[str, Any] | None) -> int | None:
    """The epoch the others formed without the evicted straggler (the first after its last),
    or ``None``: the survivors' step with a member fewer there is a leave, not a loss (none
    where a spare took its place at once)."""
    r = records.get(plan["index"]) if plan else None
    if r is None or r.get("left_at", -1) < 0 or not r["epochs"]:
        return None
    last = max(r["epochs"])
    return min((e for i, o in records.items() if i != plan["index"] for e in o["epochs"] if e > last), default=None)


def gap_stall(final: dict[int, dict[str, Any]], at: float, median: float,
              within: float = STALL_WITHIN_S) -> tuple[float, float]:
    """The longest gap between two commits of a final member that ends after ``at`` and begins
    at most ``within`` s after it, and that less ``median``: the stall an event at ``at`` cost."""
    gap = 0.0
    for r in final.values():
        ends = sorted(t1 for _, t1, ok, _ in r["iters"] if ok)
        gap = max([gap] + [b - a for a, b in zip(ends, ends[1:]) if b >= at and a <= at + within])
    return gap, gap - median


def straggler_figures(plan: dict[str, Any], records: dict[int, dict[str, Any]], final: dict[int, dict[str, Any]],
                      first: float, median: float, losses: Any = (), spares: int = 0) -> dict[str, Any]:
    """The straggler's window and eviction (the stall it cost the others: :func:`gap_stall`
    over the :data:`EVICTION_WITHIN_S` after it; ``loss_near``: a loss seen within 10 steps of
    it, whose stall it may be), and the job's median step (ms) before the window, during its
    slowed steps (to the eviction where that came first), and after the window and the eviction,
    from the final members' steps; ``spares``: the spares started for the kills (``--spares``)."""
    r = records.get(plan["index"]) or {}
    left = r.get("left_at", -1)
    stop, end = (min(left, plan["to"]), max(left, plan["to"])) if left >= 0 else (plan["to"], plan["to"])
    phases: dict[str, list[float]] = {"before": [], "during": [], "after": []}
    for m in final.values():
        for (t0, t1, ok, _), (a, b) in zip(m["iters"], m["at"]):
            phase = "before" if a < plan["from"] else "during" if a < stop else "after" if a >= end else None
            if ok and b > a and phase:
                phases[phase].append(t1 - t0)
    ms = {k: _median_ms(v) for k, v in phases.items()}
    slowed_s = [round(t - first, 4) for t in r.get("slowed_s") or []]
    # the spare taken in at the eviction (which one a loss or the eviction takes: the coordinator's pick)
    first_spare = plan["spare"] - spares if plan["spare"] is not None and left >= 0 else None
    taken = [o["joined_step"] for i, o in records.items()
             if first_spare is not None and i >= first_spare and o["joined_step"] >= left]
    return {**{k: plan[k] for k in ("index", "factor", "from", "to", "evict", "evict_slower_than", "evict_for_s")},
            "slowed_steps": r.get("slowed_steps") or None, "slowed_s": slowed_s or None,
            "calm_s": _calm_s(r, r["slowed_s"]) if r.get("slowed_s") else None,
            "evicted": left >= 0, "left_at": left if left >= 0 else None,
            "left_s": round(r["left_s"] - first, 4) if left >= 0 else None,
            "slow_for_s": round(r["left_s"] - r["slowed_s"][0], 3) if left >= 0 and r.get("slowed_s") else None,
            "median_step_ms": ms,
            "ratio_during": ms["during"] / ms["before"] if ms["during"] and ms["before"] else None,
            "ratio_after": ms["after"] / ms["before"] if ms["after"] and ms["before"] else None,
            "eviction_stall_s": gap_stall(final, r["left_s"], median, EVICTION_WITHIN_S)[1] if left >= 0 else None,
            "loss_near": left >= 0 and any(left - 10 <= e["at_step"] <= left + 10 for e in losses),
            "spare": plan["spare"], "spare_joined_step": min(taken, default=None)}


def _calm_s(r: dict[str, Any], span: list[float]) -> float:
    """The longest stretch of ``span`` (the straggler's slowed seconds) in which the straggler
    ``r`` stayed in one epoch: a loss, a join or a rejoin there starts the policy's count
    again (an epoch's first status has no waits to subtract)."""
    t0, t1 = span
    cuts = [it[1] for it, e, before in zip(r["iters"][1:], r["epochs"][1:], r["epochs"])
            if e != before and t0 < it[1] < t1]
    bounds = [t0, *cuts, t1]
    return max(b - a for a, b in zip(bounds, bounds[1:]))


def coordinator_figures(kill: dict[str, Any] | None, final: dict[int, dict[str, Any]], median: float,
                        first: float) -> dict[str, Any]:
    """The etcd leader's kill: its step and wall time (s from the first step), and the stall
    (:func:`gap_stall`: the longest gap between two commits of a final member around it, less
    the median step); ``epoch_changed``: a loss or a join in those seconds too."""
    if kill is None or "error" in kill:
        return {"killed": False, "error": (kill or {}).get("error", "the leader was not killed (the run ended first)")}
    at = kill["at"]
    gap, stall = gap_stall(final, at, median)
    return {"killed": True, "leader": kill["leader"], "step": kill["step"], "at_s": round(at - first, 4),
            "etcd_alive": kill["etcd_alive"], "longest_gap_s": gap, "stall_s": stall,
            "epoch_changed": _epoch_changed(final, at)}


def _epoch_changed(final: dict[int, dict[str, Any]], at: float) -> bool:
    """Whether a final member stepped in another epoch (a loss or a join) from ``at`` to
    :data:`STALL_WITHIN_S` after it: the stall there may be theirs."""
    for r in final.values():
        epochs = [e for (_, t1, _, _), e in zip(r["iters"], r["epochs"]) if t1 <= at + STALL_WITHIN_S]
        after = [e for (_, t1, _, _), e in zip(r["iters"], r["epochs"]) if at <= t1 <= at + STALL_WITHIN_S]
        if after and len(set(epochs[-len(after) - 1:])) > 1:
            return True
    return False


def timeline_events(r: dict[str, Any], first: float) -> dict[str, Any]:
    """A member's timeline's event times (s from the run's first step), where it has them:
    ``killed_s``; the straggler's ``slowed_steps`` and ``slowed_s``; evicted, ``left_at`` and ``left_s``;
    the frozen member's ``frozen_s`` and, rejoined, ``rejoined_s`` (its first commit after)."""
    out: dict[str, Any] = {}
    if r.get("killed_s"):
        out["killed_s"] = round(r["killed_s"] - first, 4)
    if r.get("slowed_s"):
        out.update(slowed_steps=r["slowed_steps"], slowed_s=[round(t - first, 4) for t in r["slowed_s"]])
    if r.get("left_at", -1) >= 0:
        out.update(left_at=r["left_at"], left_s=round(r["left_s"] - first, 4))
    if r.get("frozen_s"):
        out["frozen_s"] = [round(t - first, 4) for t in r["frozen_s"]]
        if (back := back_in(r)) is not None:
            out["rejoined_s"] = round(back - first, 4)
    return out


def slow_s(s: dict[str, Any]) -> float:
    """The seconds the straggler (:func:`straggler_figures`) was slow: its slowed steps' span."""
    return s["slowed_s"][1] - s["slowed_s"][0] if s["slowed_s"] else 0.0


def eviction_expected(s: dict[str, Any]) -> list[int]:
    """The straggler's ``evicted`` as the policy must have it, ``[low, high]``: never without
    ``--evict``; with it, by the seconds it was slow (its slowed steps' span, to its eviction
    where that came first): under ``evict_for_s`` it must stay (the policy acts in seconds:
    a fast mode's window of steps can be over in one); slow in one epoch (``calm_s``: no
    loss, join or rejoin, each of which starts the count again) for ``evict_for_s`` plus
    :data:`EVICTION_LAG_S` or more, with the job's median step ``evict_slower_than`` times
    its median before or more (``ratio_during``: the policy compares busy times, and a
    sleep of ``F - 1`` times the straggler's work slowed the job 0.9-2.4x at ``F`` = 3
    here), it must be out; else either."""
    if not s["evict"]:
        return [0, 0]
    calm, ratio = s.get("calm_s"), s.get("ratio_during")
    long_and_slow = calm is not None and calm >= s["evict_for_s"] + EVICTION_LAG_S and \
        ratio is not None and ratio >= s["evict_slower_than"]
    return [0, 0] if slow_s(s) < s["evict_for_s"] else [1, 1] if long_and_slow else [0, 1]


def event_checks(straggler: dict[str, Any] | None, coord: dict[str, Any] | None, freeze: dict[str, Any] | None = None,
                 steps: int = 0) -> list[tuple[Any, ...]]:
    """The judge's checks of a run's straggler, coordinator kill and freeze (``steps``: the
    run's): ``(name, value, op, limit, what)``."""
    checks: list[tuple[Any, ...]] = []
    if straggler:
        checks.append(("evicted", int(straggler["evicted"]), "in", eviction_expected(straggler),
                       "the straggler out (1: asked to leave; --evict: 1 where it was slow evict_for_s "
                       f"+ {EVICTION_LAG_S:g} s or more, 0 under evict_for_s; 0 without --evict)"))
    if coord:
        checks.append(("etcd leader", coord["stall_s"] if coord["killed"] else math.inf, "<=", COORDINATOR_STALL_S,
                       "s of stall at the etcd leader's kill (the longest gap between commits, less the median)"))
    return checks + freeze_checks(freeze, steps)


# ---------------------------------------------------------------- the report

def _f(value: Any, fmt: str = "{:.2f}") -> str:
    return "-" if value is None else fmt.format(value)


def event_lines(report: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The text report's lines: per mode, the plan (after the kills); per run, what happened."""
    plans, runs = [], []
    for mode, ev in report.get("events", {}).items():
        p = ev.get("straggler")
        if p:
            policy = (f"asked to leave at {p['evict_slower_than']:g}x the median for {p['evict_for_s']:g} s"
                      + (f" (spare {p['spare']} started for it)" if p["spare"] is not None else "")
                      if p["evict"] else "no eviction policy: it stays")
            plans.append(f"straggler ({mode}): process {p['index']} works {p['factor']:g}x per step over steps "
                         f"{p['from']}-{p['to'] - 1}; {policy}")
        if ev.get("coordinator_kill_step") is not None:
            plans.append(f"coordinator ({mode}): a {ETCD_MEMBERS}-member etcd cluster, its leader killed (SIGKILL) "
                         f"at step {ev['coordinator_kill_step']}")
        if f := ev.get("freeze"):
            plans.append(f"freeze ({mode}): process {f['index']} stopped whole (SIGSTOP, wherever it is) once the "
                         f"members reach step {f['step']}, for {f['seconds']:g} s, then back" + (f" (spare {f['spare']} started for its loss)"
                                                                 if f["spare"] is not None else ""))
    for key, run in report["runs"].items():
        ch = run["chaos"]
        s, c = ch.get("straggler"), ch.get("coordinator")
        if s:
            runs.append(_straggler_line(key, s))
        if ch.get("freeze"):
            runs.append(freeze_line(key, ch["freeze"]))
        if c:
            runs.append(f"  {key:<24} etcd leader e{c['leader']} killed at step {c['step']} ({c['at_s']:.2f} s): "
                        f"stall {c['stall_s']:.2f} s (longest gap between commits {c['longest_gap_s']:.2f} s within "
                        f"{STALL_WITHIN_S:g} s of it); etcd members alive {c['etcd_alive']}"
                        + ("; an epoch changed then too (a loss or a join): the stall may be theirs"
                           if c["epoch_changed"] else "; no epoch change") if c["killed"] else
                        f"  {key:<24} etcd leader NOT killed: {c['error']}")
    return plans, runs


def _straggler_line(key: str, s: dict[str, Any]) -> str:
    ms, spare = s["median_step_ms"], s["spare_joined_step"]
    where = (f"steps {s['slowed_steps'][0]}-{s['slowed_steps'][1]} ({s['slowed_s'][0]:.2f}-{s['slowed_s'][1]:.2f} s)"
             if s["slowed_steps"] else "no step slowed")
    if s["evicted"]:
        fate = (f"evicted at step {s['left_at']} ({s['left_s']:.2f} s, {_f(s['slow_for_s'])} s after its slowdown; "
                f"the others' stall {_f(s['eviction_stall_s'])} s"
                + (", a loss within 10 steps of it: the stall may be the loss's" if s["loss_near"] else "")
                + (f"; a spare taken in at step {spare}" if spare is not None else "") + ")")
    elif s["evict"]:
        fate = (f"NOT evicted (the policy asks once it has named it, busy {s['evict_slower_than']:g}x the median or "
                f"more, in every read of the status, about one a second, for {s['evict_for_s']:g} s; the window "
                f"lasted {slow_s(s):.1f} s)")
    else:
        fate = "not evicted (no policy: it stays)"
    return (f"  {key:<24} straggler {s['index']} ({s['factor']:g}x): slowed {where}, {fate}; median step "
            f"{_f(ms['before'], '{:.1f}')} ms before, {_f(ms['during'], '{:.1f}')} during "
            f"({_f(s['ratio_during'], '{:.2f}x')}), {_f(ms['after'], '{:.1f}')} after "
            f"({_f(s['ratio_after'], '{:.2f}x')})")


def summary_cells(chaos: dict[str, Any]) -> dict[str, Any]:
    """The CSV summary's cells of the new events (none where the run had none)."""
    row: dict[str, Any] = {}
    s, c = chaos.get("straggler"), chaos.get("coordinator")
    if s:
        ms = s["median_step_ms"]
        row.update(straggler=s["index"], straggler_factor=s["factor"], straggler_from=s["from"],
                   straggler_to=s["to"], straggler_evicted_step=s["left_at"], straggler_evicted_s=s["left_s"],
                   step_ms_before=ms["before"], step_ms_during=ms["during"], step_ms_after=ms["after"])
    if c:
        row.update(coordinator_kill_step=c.get("step"), coordinator_kill_s=c.get("at_s"),
                   coordinator_stall_s=c.get("stall_s"))
    if f := chaos.get("freeze"):
        row.update(frozen=f["index"], frozen_step=f["frozen_at"], frozen_loss_stall_s=f["loss_stall_s"],
                   rejoined_step=f["rejoined_step"], rejoin_s=f["rejoin_s"],
                   rejoin_members_stall_s=f["members_stall_s"])
    return row


def summary_fields(fields: tuple[str, ...], rows: list[dict[str, Any]]) -> tuple[str, ...]:
    """The summary's ``fields`` (its last, ``error``, last) with :data:`SUMMARY_EXTRA`'s any row has."""
    return fields[:-1] + tuple(k for k in SUMMARY_EXTRA if any(k in row for row in rows)) + fields[-1:]


SUMMARY_EXTRA = ("straggler", "straggler_factor", "straggler_from", "straggler_to", "straggler_evicted_step",
                 "straggler_evicted_s", "step_ms_before", "step_ms_during", "step_ms_after", "coordinator_kill_step",
                 "coordinator_kill_s", "coordinator_stall_s", "frozen", "frozen_step", "frozen_loss_stall_s",
                 "rejoined_step", "rejoin_s", "rejoin_members_stall_s")


STYLES = {"kill": {"color": "red", "ls": ":", "lw": 1.2},
          "join": {"color": "green", "ls": "--", "lw": 0.9},
          "slow": {"color": "orange", "alpha": 0.18},
          "evicted": {"color": "purple", "ls": "-.", "lw": 1.6},
          "coordinator": {"color": "black", "ls": "-", "lw": 1.8},
          "frozen": {"color": "blue", "alpha": 0.15},
          "rejoined": {"color": "blue", "ls": "--", "lw": 1.2}}
LABELS = {"kill": "a member killed", "join": "a replacement's first step", "slow": "the straggler slowed",
          "evicted": "the straggler evicted", "coordinator": "the etcd leader killed",
          "frozen": "a member stopped whole", "rejoined": "its first step, rejoined"}
SPANS = ("slow", "frozen")


def draw_events(ax: Any, run: dict[str, Any]) -> set[str]:
    """Mark a chaos run's events on ``ax`` (wall time, s from the first step): each kill and
    each replacement's first step (vertical lines), the straggler's slowed steps (a shaded
    span) and its eviction, the etcd leader's kill, the frozen member's stop (a span) and its
    first step rejoined. Returns the kinds drawn (for the legend)."""
    drawn: set[str] = set()
    for mem in run.get("members", {}).values():
        marks = {"kill": mem.get("killed_s") if mem.get("killed") else None,
                 "join": mem["steps"][0][0] if mem.get("joined_step", -1) > 0 and mem["steps"] else None,  # (a
                 "slow": mem.get("slowed_s"), "evicted": mem.get("left_s"),  # first member's joined_step is 0)
                 "frozen": mem.get("frozen_s"), "rejoined": mem.get("rejoined_s")}
        for kind, at in marks.items():
            if at is None or (kind in SPANS and not at):
                continue
            if kind in SPANS:
                ax.axvspan(*at, **STYLES[kind])
            else:
                ax.axvline(at, **STYLES[kind])
            drawn.add(kind)
    c = run.get("coordinator")
    if c and c.get("killed"):
        ax.axvline(c["at_s"], **STYLES["coordinator"])
        drawn.add("coordinator")
    return drawn


def event_title(events: dict[str, Any] | None) -> str:
    """The chart title's words for a mode's straggler and coordinator kill (empty: none)."""
    if not events:
        return ""
    words = []
    p = events.get("straggler")
    if p:
        words.append(f"straggler {p['index']} {p['factor']:g}x @{p['from']}-{p['to'] - 1}"
                     + (f" (evict at {p['evict_slower_than']:g}x for {p['evict_for_s']:g} s)" if p["evict"] else ""))
    if events.get("coordinator_kill_step") is not None:
        words.append(f"etcd leader killed @{events['coordinator_kill_step']}")
    if f := events.get("freeze"):
        words.append(f"member {f['index']} stopped {f['seconds']:g} s @{f['step']}")
    return ("\n" + "; ".join(words)) if words else ""


def legend_handles(drawn: set[str]) -> list[Any]:
    """The legend's entries of the events drawn (in :data:`LABELS`' order)."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = []
    for kind in LABELS:
        if kind in drawn:
            style = STYLES[kind]
            handles.append(Patch(color=style["color"], alpha=0.35, label=LABELS[kind]) if kind in SPANS else
                           Line2D([], [], color=style["color"], ls=style["ls"], lw=style["lw"], label=LABELS[kind]))
    return handles
