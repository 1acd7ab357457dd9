"""``fastreduce bench chaos``: each mode trains through three losses and three joins.

Issue 49's chaos run. Per mode under :class:`fastreduce.Membership` (:data:`MODES`:
the fused reducer with a bf16 wire, the overlapped reducer with an fp32 wire and buckets
small enough that several are in flight, DiLoCo, gossip over a ring with the overlapped
mode's buckets and an fp32 wire, ZeRO (``ZeroOptimizer(redundant=True)``, AdamW, the
overlapped mode's buckets reduce-scattered during backward)) and per transport (``FASTREDUCE_TRANSPORT``
``process_group``, i.e. Gloo, and ``shm``), ``members`` (4) processes train one seeded MLP
regression (:func:`.faults.build_model`, AdamW with a cosine learning rate over the committed
steps, each (step, rank) its own seeded batch, :func:`.faults.batch_for`) to ``steps`` (300)
committed steps through ``Membership``, with a coordinator
(:func:`fastreduce.membership.serve`) in the launcher. Gossip (:class:`fastreduce.DecentralizedDataParallel`) steps inside forward
and backward, so ``commit()`` runs them; its AdamW and cosine schedule are per bucket
(``optim_fn``, ``lr_scheduler_fn``: a ``LambdaLR`` over the bucket's own steps, one per
committed step), kept across epochs in the mode's state.

The kills (:func:`schedule`, drawn from ``seed``, the same steps and victims in every mode):
one in each third of the run, a member (any one alive then, a healed replacement included)
dies (SIGKILL to itself: :func:`.common.crash`) at a point of each kind, in a seeded order:

* ``mid-step``: after its backward, before ``commit()``;
* ``in-flight``: overlapped, inside backward as the first layer's gradient is computed (the
  later layers' buckets in flight; ZeRO alike, their reduce-scatters); fused, as its reduction begins (its peers in the
  collective); DiLoCo, after its inner step as the sync begins (its peers in the sync; the
  step moved to the next sync); gossip, as overlapped (the later layers' buckets stepped, their
  exchanges of this round in flight);
* ``between``: before the next step's forward.

``join_after`` (20) committed steps after each kill, a replacement joins: a process started
with the others (so its imports are done), told to join then; the world returns to
``members``. Every process records, per step: its begin and end (wall clock), whether the
step was committed, the world, the epoch and the training loss; a digest of its parameters
at every committed step (DiLoCo: at every sync, when the ranks' parameters are one), and a
replacement's right after its healing; after the last step (gossip: after
``global_avg()``, every rank's parameters := their exact mean), the final digest. Gossip's ranks
differ by design: only rank 0 records a digest per step, and a heal is checked against it (a
joiner takes rank 0's state). Then, per mode and transport, a failure-free run: the
same members, data and seeds, no kill, the same committed steps.

The figures (:func:`run_chaos_bench`): committed steps of the final members; the losses and
joins (``Membership.counters``, and per loss from the timeline: the steps discarded, the stall:
from the end of the last committed step before it to the end of the first committed after it,
less one median step); every digest of one step equal on every member that recorded it, each
heal checked at the replacement's first step, the final digests equal; the final model's
(gossip: the global average's) held-out loss (4096 held-out
rows) against the failure-free run's, within ``tolerance_pct`` (1%); the wall time from the
first step begun to the last committed. Outputs (:func:`write_outputs`): ``chaos.csv`` (a row
per mode and transport), ``chaos_steps.csv`` (a row per member and step), ``chaos.png`` (loss
and world size against wall time, a panel per mode; the ``plot`` extra, else skipped with a
note). ``--quick``: 3 members, 30 steps, one kill (``in-flight``) and one join, the
overlapped mode on shared memory.

Three more failure kinds (:mod:`.chaos_events`): ``--straggler F`` (a first member no kill takes
works ``F`` times as long per step for a window; ``--evict``: the job asks it to leave, and
with ``--spares`` a spare takes its place), ``--coordinator etcd`` (a 3-member etcd cluster
as the coordinator, its leader killed mid-run) and ``--freeze S`` (a first member stopped
whole for ``S`` s wherever it is, left out by the others, back in the job in the same process:
:mod:`.chaos_freeze`).
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import random
import statistics
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .chaos_events import (Slowdown, check_events, coordinator, coordinator_figures, draw_events, etcd_missing,
                           event_checks, event_lines, event_spares, event_title, events_for, legend_handles, membership_policy,
                           only_untaken, eviction_epoch, straggler_figures, summary_cells, summary_fields,
                           timeline_events)
from .chaos_freeze import (REJOIN_GRACE_S, Freeze, Freezer, but_frozen, freeze_figures, is_frozen_step,
                           mark_freeze_loss, note_freeze, thaw_by, without_stop)
from .common import crash, machine_info
from .faults import TIMEOUT_S, Record, Shared, _enter, _env, _join_stall, _median_step, _wait, batch_for, build_model

__all__ = ["KINDS", "MODES", "TRANSPORTS", "ChaosConfig", "format_text", "quick_config",
           "run_chaos_bench", "schedule", "write_outputs"]

MODES = ("fused_bf16", "overlap", "zero", "diloco", "gossip")
TRANSPORTS = ("process_group", "shm")
KINDS = ("mid-step", "in-flight", "between")
JOINER_POINTS = ("admitted", "healing", "first-step")
"""Where a replacement dies as it joins (:mod:`.joiner_kills`): as the members admit it (before
it enters the epoch formed for it), as its healing begins (the members sending it the state),
after its first backward (the members at their first step of the epoch with it)."""
IN_FLIGHT = {"fused_bf16": "as its reduction begins, its peers in the collective",
             "overlap": "inside backward, the later layers' buckets in flight",
             "zero": "inside backward, the later layers' buckets' reduce-scatters in flight",
             "diloco": "after its inner step, as the sync begins (the next sync step)",
             "gossip": "inside backward, the later layers' buckets stepped and their exchanges in flight"}
HELDOUT_SEED = 1000
"""Added to ``seed`` for the held-out rows (the training batches' seeds stay far below it)."""


@dataclass(kw_only=True)
class ChaosConfig:
    """One run of the suite."""

    modes: tuple[str, ...] = MODES
    """Which modes to run (``--chaos-modes``)."""
    transports: tuple[str, ...] = TRANSPORTS
    """Which transports (``--chaos-transports``)."""
    members: int = 4
    """Processes the job starts with (and returns to after each join)."""
    steps: int = 300
    """Committed steps each run trains to."""
    params_m: float = 0.1
    """The MLP's size in millions of fp32 parameters."""
    batch: int = 64
    """Rows per rank and step."""
    lr: float = 3e-3
    """AdamW's peak learning rate (cosine to 0 over the committed steps)."""
    seed: int = 0
    """Draws the kills (steps, victims, order) and the data."""
    kinds: tuple[str, ...] = KINDS
    """The kills, one per kind, in an order drawn from ``seed``."""
    join_after: int = 20
    """Committed steps between a kill and its replacement's start of joining."""
    sync_every: int = 10
    """DiLoCo's ``H`` (one fragment; outer SGD, lr 1.0, no momentum)."""
    bucket_mb: float = 0.05
    """The overlapped and gossip modes' bucket size (MB): several buckets in flight."""
    heldout: int = 4096
    """Held-out rows."""
    tolerance_pct: float = 1.0
    """The final held-out loss within this of the failure-free run's (percent)."""
    heartbeat_s: float = 0.25
    """``FASTREDUCE_HEARTBEAT_S``."""
    pace_s: float = 0.0
    """A pause after each step (not timed), so that ``--quick``'s replacement arrives in time."""
    joiner_runs: int = 0
    """``--joiner-runs N``: instead of the chaos run, :mod:`.joiner_kills`: a replacement killed at
    each point of its joining, ``N`` jobs per mode, transport and point."""
    spares: bool = False
    """``--spares``: the replacements are warm spares (``Membership(spare=True)``), registered from
    the start and taken in by the epoch the survivors form at each loss, not told to join
    ``join_after`` steps later."""
    straggler: float = 0.0
    """``--straggler F``: a first member no kill takes works ``F`` times as long per step for a
    window of steps (0: none; :mod:`.chaos_events`)."""
    straggler_steps: int = 0
    """``--straggler-steps N``: the straggler's window (0: a fifth of the steps)."""
    evict: bool = False
    """``--evict``: every member runs ``Membership(evict_slower_than=..., evict_for_s=...)``, so the
    straggler is asked to leave (with ``spares``, a spare more is started to take its place)."""
    evict_slower_than: float = 1.5
    """The eviction's ratio: a member busy this many times the members' median per step."""
    evict_for_s: float = 3.0
    """Seconds the straggler is named before it is asked to leave (``--evict``)."""
    coordinator: str = "builtin"
    """``--coordinator etcd``: the job's coordinator is a 3-member etcd cluster, its leader killed
    (SIGKILL) at a step drawn in the middle third of the run; ``builtin``: the launcher's."""
    freeze: float = 0.0
    """``--freeze S``: a first member no kill takes (nor the straggler) stopped whole by the
    launcher for ``S`` s, wherever it is, then back (0: none; :mod:`.chaos_freeze`)."""
    quick: bool = False

    def __post_init__(self) -> None:
        bad = [m for m in self.modes if m not in MODES] + [t for t in self.transports if t not in TRANSPORTS]
        if bad or not self.modes or not self.transports:
            raise ValueError(f"modes among {', '.join(MODES)} and transports among {', '.join(TRANSPORTS)}, got "
                             f"{self.modes!r} and {self.transports!r}")
        if not self.kinds or any(k not in KINDS for k in self.kinds) or len(set(self.kinds)) != len(self.kinds):
            raise ValueError(f"kinds: distinct kinds among {', '.join(KINDS)}, got {self.kinds!r}")
        if self.joiner_runs < 0:
            raise ValueError(f"joiner_runs must be >= 0 (0: the chaos run), got {self.joiner_runs}")
        if self.members < 3:
            raise ValueError(f"members must be at least 3 (two survivors go on), got {self.members}")
        if self.spares and len(self.kinds) >= self.members:
            raise ValueError(f"with spares each kill takes a first member: at most {self.members - 1} kills for "
                             f"{self.members} members, got {len(self.kinds)}")
        if not self.params_m > 0 or self.batch < 1 or self.join_after < 1 or self.sync_every < 1:
            raise ValueError("params_m must be positive; batch, join_after and sync_every at least 1")
        if "diloco" in self.modes and self.steps % self.sync_every:
            raise ValueError(f"steps={self.steps} must be a multiple of sync_every={self.sync_every} (DiLoCo's "
                             "final model is the one its last sync made)")
        if self._segment() <= self.join_after + self.sync_every + 2:
            raise ValueError(f"steps={self.steps} leaves no room for {len(self.kinds)} kills, each replaced "
                             f"{self.join_after} steps later")
        check_events(self, schedule)

    def _segment(self) -> int:
        return (self.steps - self._start() - max(3, self.steps // 10)) // len(self.kinds)

    def _start(self) -> int:
        return max(3, self.steps // 20)


def quick_config(**given: Any) -> ChaosConfig:
    """``--quick``: 3 members, a 0.05M model, 30 steps, one kill inside backward and one join,
    the overlapped mode on shared memory; a tolerance of 5%: 30 steps are far from converged,
    so every batch missed shows in the held-out loss (1.0-1.5% in a one-process simulation of
    this schedule; 2.3% measured, where the replacement's join took 7 more steps)."""
    base = dict(modes=("overlap",), transports=("shm",), members=3, steps=30, params_m=0.05, batch=32,
                kinds=("in-flight",), join_after=8, tolerance_pct=5.0, pace_s=0.02, quick=True)
    return ChaosConfig(**{**base, **given})


def schedule(cfg: ChaosConfig, mode: str) -> list[dict[str, Any]]:
    """The kills: ``kind``, ``step`` (the victim dies at its first chance at or after this many
    committed steps), ``victim`` (a process index: ``0..members-1`` the first members, then the
    replacements in order; with ``spares``, a first member: which spare a loss takes in is not
    known beforehand) and the ``replacement`` that joins ``join_after`` steps later (a spare:
    at some loss)."""
    rng = random.Random(cfg.seed)
    kinds = list(cfg.kinds)
    rng.shuffle(kinds)
    seg, alive, kills = cfg._segment(), list(range(cfg.members)), []
    for k, kind in enumerate(kinds):
        lo = cfg._start() + k * seg
        step = rng.randrange(lo, max(lo + 1, lo + seg - cfg.join_after - cfg.sync_every - max(2, seg // 8)))
        if mode == "diloco" and kind == "in-flight":
            step += -(step + 1) % cfg.sync_every  # inner step step + 1 syncs
        victim = rng.choice(alive)
        alive.remove(victim)
        if not cfg.spares:  # (spares: which one a loss takes in is the coordinator's choice; the first members die)
            alive.append(cfg.members + k)
        kills.append({"kind": kind, "step": step, "victim": victim, "replacement": cfg.members + k})
    return kills


# ---------------------------------------------------------------- one process

@dataclass
class ChaosRecord(Record):
    """A process's figures: :class:`.faults.Record`'s, and per step (``iters``' order)."""

    epochs: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    at: list[tuple[int, int]] = field(default_factory=list)  # committed steps before and after
    digests: dict[str, str] = field(default_factory=dict)  # committed step -> parameter digest
    entered: dict[str, str] = field(default_factory=dict)  # gossip: epoch -> rank 0's digest as it entered it
    why: list[list[str]] = field(default_factory=list)  # per step: why each epoch its commit entered formed
    final_digest: str = ""  # after the last step (gossip: after global_avg)
    lr_steps: list[int] = field(default_factory=list)  # gossip: each bucket's scheduler steps at the end
    joined_step: int = -1
    joined_epoch: int = -1
    heldout: float | None = None
    heldout_initial: float | None = None
    killed: str = ""  # where this process was killed (its record saved as it died)
    killed_s: float = 0.0  # when (time.time())
    slowed_steps: list[int] = field(default_factory=list)  # the straggler: its first and last slowed step
    slowed_s: list[float] = field(default_factory=list)  # the first's begin and the last's end (time.time())
    left_at: int = -1  # evicted: the committed steps when it was out (m.left)
    left_s: float = 0.0  # and when
    rejoined_step: int = -1  # the frozen member (--freeze): the step and epoch it rejoined at
    rejoined_epoch: int = -1

    def finish(self, m: Any) -> None:
        c = m.counters
        self.counters = {"discarded_steps": c.discarded_steps, "losses": c.losses, "joins": c.joins,
                         "resyncs": c.resyncs, "rejoins": c.rejoins, "stalls": [list(s) for s in c.stalls],
                         "epoch": m.epoch.number,
                         "world": m.world}
        self.final_step = m.step


def _digest(model: nn.Module) -> str:
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return hashlib.sha256(params.numpy().tobytes()).hexdigest()[:16]


def _cosine(cfg: ChaosConfig, step: int) -> float:
    """The learning rate's factor at ``step`` committed steps (every mode's schedule)."""
    return 0.5 * (1 + math.cos(math.pi * step / cfg.steps))


def _gossip(cfg: ChaosConfig, model: nn.Module, scheds: list[Any]) -> Any:
    """Gossip over a ring, the overlapped mode's buckets: an AdamW and a cosine ``LambdaLR``
    per bucket, its count the bucket's steps (one per committed step; kept across epochs in
    the mode's state); each scheduler built is added to ``scheds``."""
    import fastreduce

    def schedule_of(opt: torch.optim.Optimizer) -> Any:
        scheds.append(torch.optim.lr_scheduler.LambdaLR(opt, lambda k: _cosine(cfg, k)))
        return scheds[-1]

    def adamw(named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for _, p in named], lr=cfg.lr)

    return fastreduce.DecentralizedDataParallel(model, adamw, schedule_of, topology="ring", bucket_mb=cfg.bucket_mb)


def _heldout(cfg: ChaosConfig, model: nn.Module) -> float:
    x, y = batch_for(replace(cfg, seed=cfg.seed + HELDOUT_SEED, batch=cfg.heldout), 0, 0)  # type: ignore[arg-type]
    with torch.no_grad():
        return nn.functional.mse_loss(model(x), y).item()


def member(index: int, cfg: ChaosConfig, mode: str, port: int | str, out: str, env: dict[str, str], spawned: float,
           kill: dict[str, Any] | None, go: int | None, shared: list[Shared],
           events: dict[str, Any] | None = None) -> None:
    """One process: a first member, or (``go``) the replacement told to join by ``shared[go]``;
    ``kill``: where and at which step it dies; ``port``: the coordinator's (or its address,
    ``etcd://...``); ``events``: the straggler and the eviction policy (:mod:`.chaos_events`)."""
    record = ChaosRecord(**asdict(_enter(env, spawned, index)))
    slow, frozen = Slowdown(events, index), Freeze(events, index)
    try:
        import fastreduce
        from fastreduce.membership import Membership, MembershipError

        for name in ("FusedReducer", "ZeroOptimizer", "DiLoCo", "DecentralizedDataParallel"):
            getattr(fastreduce, name)  # imported now (names load on first use), not in a timed join
        model = build_model(cfg.params_m)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        outer = torch.optim.SGD(model.parameters(), lr=1.0)
        record.heldout_initial = _heldout(cfg, model)
        m: Any = None

        def armed(kind: str) -> bool:
            """Whether to die here, now; if so, the record is saved first (a few ms)."""
            if kill is None or kill["kind"] != kind or m is None or m.step < kill["step"]:
                return False  # (a replacement as the victim: at its first chance once it has joined)
            if kind == "in-flight" and mode == "diloco" and (m.step + 1) % cfg.sync_every:
                return False  # a sync step
            record.killed, record.killed_s = kind, time.time()
            record.finish(m)
            record.save(Path(out) / f"{index}.json")
            return True

        scheds: list[Any] = []  # gossip's, every epoch's

        def build() -> Any:
            if mode == "gossip":
                return _gossip(cfg, model, scheds)
            if mode == "diloco":
                return fastreduce.DiLoCo(model, opt, outer, sync_every=cfg.sync_every)
            if mode == "zero":
                return fastreduce.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=cfg.lr, module=model,
                                                redundant=True, bucket_mb=cfg.bucket_mb)
            if mode == "overlap":
                return fastreduce.FusedReducer(model, wire_dtype=torch.float32, overlap=True, bucket_mb=cfg.bucket_mb)
            reducer = fastreduce.FusedReducer(model, wire_dtype=torch.bfloat16)
            reduce = reducer.reduce
            reducer.reduce = lambda *a, **k: crash() if armed("in-flight") else reduce(*a, **k)  # type: ignore
            return reducer

        if mode in ("overlap", "zero", "gossip"):  # the first layer's gradient comes last in backward
            model[0].weight.register_hook(lambda g: crash() if armed("in-flight") else g)
        if mode == "diloco":  # before the mode's own hook (registered later): the step done, the sync not begun
            opt.register_step_post_hook(lambda *_: crash() if armed("in-flight") else None)
        shared[0].ready.wait(TIMEOUT_S)  # every process imported and built before the first step
        spare = go is not None and cfg.spares  # (a spare waits registered: taken in at a loss)
        if go is not None and not spare:
            shared[go].go.wait(TIMEOUT_S)
        record.join_start = time.time()
        m = Membership(port if isinstance(port, str) else f"127.0.0.1:{port}", world_size=cfg.members, min_ranks=2,
                       tag=f"chaos {mode}", wait_s=TIMEOUT_S if spare else 120, spare=spare,
                       **membership_policy(events))
        if kill is not None and kill["kind"] in ("admitted", "healing"):
            _die_joining(m, kill["kind"], record, Path(out) / f"{index}.json")
        try:
            m.join({"model": model} if mode == "zero" else {"model": model, "optimizer": opt}, build)
            late = False
        except MembershipError as err:
            # a replacement told to join so late that the job ended first (on etcd a join takes
            # 1.5-3 s): as a spare never needed (where the launcher waits for it: an error)
            late = go is not None and "the job ended before it admitted this process" in str(err)
            if not late:
                raise
        if m.left or late:  # a spare the job ended without needing: no record, never admitted (the launcher's untaken)
            m.close()
            return
        record.joined_step = m.step
        if go is not None:  # admitted (the launcher may end one never admitted once the job is done), healed:
            (Path(out) / f"{index}.joined").touch()
            record.digests[str(m.step)] = _digest(model)  # the members' parameters after that step
            record.joined_epoch = m.epoch.number
            record.entered[str(m.epoch.number)] = record.digests[str(m.step)]
        while m.step < cfg.steps and not m.left:
            if armed("between"):
                crash()
            t0, before, since = time.time(), m.step, time.perf_counter()  # (since: the straggler's work)
            epoch, changes = m.epoch.number, len(m.counters.stalls)
            shared[0].started(t0)
            x, y = batch_for(cfg, m.step, m.rank)  # type: ignore[arg-type]
            if mode == "gossip":  # the mode steps and exchanges inside forward and backward: commit runs them
                ok, loss = _gossip_step(m, x, y, armed, lambda: slow.sleep(before, since))
            else:
                stepper = m.mode if mode == "zero" else opt  # ZeRO: the mode is the optimizer
                for group in stepper.param_groups:
                    group["lr"] = cfg.lr * _cosine(cfg, m.step)
                train_loss = nn.functional.mse_loss(model(x), y)
                train_loss.backward()
                if armed("mid-step") or armed("first-step"):
                    crash()
                slow.sleep(before, since)
                ok, loss = m.commit(stepper.step), train_loss.item()
                (m.mode if mode == "zero" else opt).zero_grad()
            record.step_done(t0, ok, m.world, shared[0], m.step)
            frozen.after(m, record, lambda: _digest(model))
            if m.left:  # evicted (asked to leave at this step's poll): out, its step committed with the others'
                record.left_at, record.left_s = m.step, time.time()
            slow.note(record, before)
            for s in shared[1:]:
                s.committed(m.step, record.iters[-1][1])
            record.epochs.append(m.epoch.number)
            record.why.append([why for why, _ in m.counters.stalls[changes:]])
            if mode == "gossip" and m.epoch.number != epoch and m.rank == 0:  # what it sent the joiners (a step
                record.entered[str(m.epoch.number)] = _digest(model)  # failed at a loss stepped some buckets)
            record.losses.append(loss)
            record.at.append((before, m.step))
            if ok and m.step > before and _one_model(cfg, mode, m):
                record.digests[str(m.step)] = _digest(model)
            time.sleep(cfg.pace_s)
        if m.left:  # evicted: its model is not the job's; out cleanly
            record.finish(m)
            m.close()
            record.save(Path(out) / f"{index}.json")
            return
        if mode == "gossip":  # every rank's parameters := their exact mean, the model evaluated
            m.mode.global_avg()
            record.lr_steps = sorted({s.last_epoch for s in scheds[-m.mode.num_buckets:]})
        record.final_digest = _digest(model)
        record.heldout = _heldout(cfg, model)
        record.finish(m)
        m.close()
    except BaseException:  # noqa: BLE001 - reported by the launcher
        record.error = traceback.format_exc()
    record.save(Path(out) / f"{index}.json")


def _die_joining(m: Any, kind: str, record: ChaosRecord, path: Path) -> None:
    """Make this replacement die (SIGKILL to itself) as it is admitted (``admitted``) or as
    its healing begins (``healing``: only a joiner receives the state), its record saved first."""
    def die(_epoch: Any) -> None:
        record.killed, record.killed_s = kind, time.time()
        record.save(path)
        crash()

    m.at("enter" if kind == "admitted" else "sync_state", die)


def _gossip_step(m: Any, x: torch.Tensor, y: torch.Tensor, armed: Any, slow: Any = None) -> tuple[bool, float]:
    """One gossip step through ``m.commit``: forward and backward through ``m.mode`` (a new
    wrapper each epoch); the training loss, NaN where the step failed before it. ``slow``:
    called after the backward (the straggler sleeps there)."""
    box = [math.nan]

    def forward_backward() -> None:
        loss = nn.functional.mse_loss(m.mode(x), y)
        loss.backward()
        box[0] = loss.item()
        if armed("mid-step") or armed("first-step"):  # its buckets stepped, their exchanges in flight
            crash()
        if slow is not None:
            slow()

    return m.commit(forward_backward), box[0]


def _one_model(cfg: ChaosConfig, mode: str, m: Any) -> bool:
    """Whether this member records a digest of this committed step: every member where the
    members hold one model (DiLoCo: at its syncs); gossip's rank 0 alone (its ranks differ by
    design; a joiner takes rank 0's state)."""
    if mode == "gossip":
        return m.rank == 0
    return mode != "diloco" or m.step % cfg.sync_every == 0


def run_job(cfg: ChaosConfig, mode: str, transport: str, kills: list[dict[str, Any]], out: Path,
            events: dict[str, Any] | None = None) -> dict[str, Any]:
    """The coordinator (the launcher's, or an etcd cluster), ``members`` processes, one
    replacement per kill (and a spare for the straggler's eviction); their records.
    ``events``: the straggler, the coordinator and its leader's kill (:func:`.chaos_events.events_for`)."""
    from ..launch import rank_context
    from ..membership import serve

    events = events or {}
    extra = event_spares(events)
    ctx = rank_context("fastreduce.bench.chaos")
    n = cfg.members + len(kills) + len(extra)
    shared = [Shared.make(ctx, k["step"] + cfg.join_after, n) for k in kills] or [Shared.make(ctx, cfg.steps + 1, n)]
    env = _env(FASTREDUCE_HEARTBEAT_S=str(cfg.heartbeat_s), FASTREDUCE_TRANSPORT=transport)
    victims = {k["victim"]: k for k in kills}
    # a spare more than the kills; on etcd (a vote about once a second), a replacement told late
    waiting = set(range(cfg.members, n)) if extra or events.get("coordinator") == "etcd" else set()
    with coordinator(events, lambda: serve(0, "127.0.0.1"), shared[0].progress) as (where, leader_kill):
        procs = start_members(ctx, n, cfg, mode, where, out, env, victims, shared, events=events)
        freeze = events.get("freeze")
        freezer = None if not freeze else \
            Freezer(procs[freeze["index"]].pid, freeze, shared[0].progress, thaw_by(cfg.steps))
        try:
            if freezer is not None:
                freezer.start()
            _watch(procs, out, set(victims), time.time() + TIMEOUT_S, waiting, cfg.steps)
        finally:
            frozen = freezer.stop() if freezer is not None else None  # (thawed first, where still stopped)
            _wait(procs, time.time())
    job = {"records": records_of(out, n), "first": shared[0].first.value, "codes": [p.exitcode for p in procs]}
    if freeze:
        note_freeze(job["records"], freeze, frozen)
    if events:  # a spare never taken (no eviction), or a replacement never admitted, was ended here
        job.update(untaken=[i for i in sorted(waiting) if job["records"][i] is None and
                            not (out / f"{i}.joined").exists()], coordinator_kill=leader_kill.get("kill"))
    return job


def records_of(out: Path, n: int) -> dict[int, dict[str, Any] | None]:
    """The ``n`` processes' records in ``out`` (``None``: one that wrote none)."""
    return {i: json.loads(f.read_text()) if (f := out / f"{i}.json").exists() else None for i in range(n)}


def failed(procs: list[Any], out: Path, victims: set[int]) -> bool:
    """Whether a process that is no victim has ended without its record or with an error in it."""
    for i, p in enumerate(procs):
        f = out / f"{i}.json"
        if p.exitcode is not None and i not in victims and (not f.exists() or json.loads(f.read_text())["error"]):
            return True
    return False


def _watch(procs: list[Any], out: Path, victims: set[int], deadline: float, waiting: set[int] = frozenset(),
           steps: int = 0) -> None:
    """Until every process has ended, or one that is no victim has ended without its
    record or with an error in it (the others, waiting for a step or a signal that will
    never come, are then given 5 s and killed), or the deadline. ``waiting``: spares one of
    which may never be taken (the straggler's, where it was not evicted), or (etcd: a vote
    about once a second) replacements told to join near the end: once a final member has
    trained ``steps`` and only those never admitted are left, they are ended."""
    while time.time() < deadline and any(p.is_alive() for p in procs):
        if failed(procs, out, victims):
            deadline = min(deadline, time.time() + 5)
        if waiting and only_untaken(procs, out, waiting, steps):
            return
        time.sleep(0.2)


# ---------------------------------------------------------------- the figures

def _loss_events(r: dict[str, Any], median: float) -> list[dict[str, Any]]:
    """The losses one member lived through: the first step discarded, with fewer members
    than the step before, or whose commit entered an epoch formed at a loss (a warm spare
    in the lost one's place, a local-update mode's sync run again: no step discarded, the
    world as large), the steps discarded up to the next committed one, the epoch formed at
    the loss (:func:`_loss_epoch`), the stall (as in the faults suite)."""
    iters, events, i = r["iters"], [], 0
    why = r.get("why") or [[] for _ in iters]
    while i < len(iters):
        shrank = i > 0 and iters[i][3] < iters[i - 1][3]
        if iters[i][2] and not shrank and "loss" not in why[i]:
            i += 1
            continue
        j = next((j for j in range(i, len(iters)) if iters[j][2]), None)
        if j is None:
            break
        before = iters[i - 1][1] if i else iters[i][0]
        events.append({"epoch": _loss_epoch(r, i, j), "discarded": j - i, "stall_s": iters[j][1] - before - median,
                       "at_step": r["at"][i][0], "at_s": iters[i][0]})
        i = j + 1
    return events


def _loss_epoch(r: dict[str, Any], i: int, j: int) -> int:
    """The epoch formed at the loss of the event that begins at iteration ``i`` and ends
    with the commit of iteration ``j`` (the key by which the members' views of one loss are
    merged): the survivors form it together, whereas the epoch the commit ended in can
    differ between them (a member evicted at that commit's poll stays in it, the others
    form one more without it). The epochs an iteration formed follow the last one's
    number; ``why`` lists them inner first (an epoch formed at a loss while another was
    entered comes before the outer one), so the loss's comes after those formed at a poll.
    Without a loss named (a shrink at a leave): the epoch the commit ended in."""
    why = r.get("why") or []
    k = next((k for k in range(i, j + 1) if k < len(why) and "loss" in why[k]), None)
    if k is None:
        return r["epochs"][j]
    prev = r["epochs"][k - 1] if k else r["epochs"][k] - len(why[k])
    return prev + 1 + sum(w != "loss" for w in why[k])


def _losses(records: dict[int, dict[str, Any]], median: float, left: int | None = None) -> list[dict[str, Any]]:
    """Per loss (the epoch it formed, in order): the largest stall and discard count over
    the members that saw it, and Membership's own stall (its counters, the largest).
    ``left``: the epoch formed without the evicted straggler (its shrink is a leave, not a loss).
    The frozen member's own step discarded as it was left out is no loss it saw."""
    by_epoch: dict[int, list[dict[str, Any]]] = {}
    for r in records.values():
        events = [e for e in _loss_events(r, median)
                  if (e["epoch"] != left or e["discarded"]) and not is_frozen_step(r, e)]
        own = [s for why, s in r["counters"].get("stalls", []) if why == "loss"]
        for k, e in enumerate(events):
            e["membership_stall_s"] = own[k] if len(own) == len(events) else None
            by_epoch.setdefault(e["epoch"], []).append(e)
    out = []
    for epoch in sorted(by_epoch):
        seen = by_epoch[epoch]
        own = [e["membership_stall_s"] for e in seen if e["membership_stall_s"] is not None]
        out.append({"epoch": epoch, "members": len(seen), "at_step": min(e["at_step"] for e in seen),
                    "at_s": min(e["at_s"] for e in seen),  # (when the first step it failed began)
                    "stall_s": max(e["stall_s"] for e in seen), "discarded": max(e["discarded"] for e in seen),
                    "membership_stall_s": max(own) if own else None})
    return out


def _digests(records: dict[int, dict[str, Any]], kills: list[dict[str, Any]], per_step: bool = True) -> dict[str, Any]:
    """Every step's digests equal across the members that recorded it (``per_step``; gossip:
    not compared, only its rank 0 records them); each heal: the replacement's digest right
    after it against every member's at that step (gossip: rank 0's as it entered the
    replacement's epoch, what it sent: a step that failed at a loss had stepped some of
    its buckets, which gossip keeps); the frozen member's right after it rejoined (``kills``'
    entries with a ``rejoined`` index), as a heal; the final members' final digests (gossip:
    after ``global_avg``) equal."""
    by_step: dict[str, dict[int, str]] = {}
    for i, r in records.items():
        for step, d in r["digests"].items():
            by_step.setdefault(step, {})[i] = d
    differ = sorted((int(s) for s, ds in by_step.items() if len(set(ds.values())) > 1)) if per_step else []
    heals = []
    for k in kills:
        kind = "rejoined" if "rejoined" in k else "joined"
        who = k["rejoined"] if kind == "rejoined" else k["replacement"]
        j = records.get(who) or {}
        step, epoch = j.get(f"{kind}_step", -1), j.get(f"{kind}_epoch", -1)
        if step < 0:
            heals.append({"replacement": who, "step": None, "compared": 0, "equal": False})
            continue
        ds = by_step.get(str(step), {}) if per_step else \
            {i: d for i, r in records.items() if (d := r["entered"].get(str(epoch))) is not None}
        heals.append({"replacement": who, "step": step, "compared": len(ds),
                      "equal": len(ds) > 1 and len(set(ds.values())) == 1})
    final = {r["final_digest"] for r in records.values() if not r["killed"] and r.get("left_at", -1) < 0}
    return {"steps_compared": sum(1 for ds in by_step.values() if len(ds) > 1) if per_step else 0,
            "steps_differ": differ[:20], "heals": heals, "final_equal": len(final) == 1,
            "equal": not differ and all(h["equal"] for h in heals) and len(final) == 1}


def figures(cfg: ChaosConfig, job: dict[str, Any], kills: list[dict[str, Any]], mode: str = "",
            events: dict[str, Any] | None = None) -> dict[str, Any]:
    """One run's figures (a chaos run, or the failure-free one with ``kills`` empty); ``events``:
    the straggler and the coordinator's (:mod:`.chaos_events`)."""
    untaken = set(job.get("untaken", ()))  # a spare or replacement the job ended without
    records = {i: r for i, r in job["records"].items() if i not in untaken}
    errors = {i: r["error"] for i, r in records.items() if r and r["error"]}
    missing = [i for i, r in records.items() if r is None]
    if errors or missing:
        text = "\n".join(f"process {i}: {e}" for i, e in errors.items())
        return {"error": (text or f"processes {missing} left no record (killed by the launcher's timeout?)")[-4000:],
                "codes": job["codes"]}
    seen = {i: r for i, r in records.items() if not r["killed"]}  # Membership's counters: the evicted's too
    final = {i: r for i, r in seen.items() if r["left_at"] < 0}  # (evicted: out)
    median = _median_step(list(final.values()))
    plan, freeze = (events or {}).get("straggler"), (events or {}).get("freeze")
    losses = _losses(records, median, eviction_epoch(records, plan))
    joins, spares = [], event_spares(events)
    # a warm spare waited from the job's start: its joining began with the loss (or the eviction,
    # or the freeze) that took it in, the last before its first commit
    gone = [r["killed_s"] if r["killed"] else r["left_s"] for r in records.values()
            if r and (r["killed"] or r.get("left_at", -1) >= 0)]
    gone += [r["frozen_s"][0] for r in records.values() if r and r.get("frozen_s")]
    for i in [k["replacement"] for k in kills] + spares:
        j = records.get(i)
        if j is None:  # a spare never taken, or a replacement the job ended before admitting
            joins.append({"replacement": i, "joined_step": -1, "first_commit_s": None, "members_stall_s": None,
                          "membership_joined_s": None})
            continue
        if cfg.spares and j["first_commit"]:
            j = {**j, "join_start": max((t for t in gone if t < j["first_commit"]), default=j["join_start"])}
        joins.append({"replacement": i, "joined_step": j["joined_step"],
                      # (none where it was killed before its first commit: a later kill's victim)
                      "first_commit_s": j["first_commit"] - j["join_start"] if j["first_commit"] else None,
                      "members_stall_s": max(_join_stall(without_stop(r), j, median)  # (not the frozen one's stop)
                                             for o, r in records.items() if o != i),
                      "membership_joined_s": next((s for w, s in j["counters"]["stalls"] if w == "joined"), None)})
    healed = [k for k in kills if k["replacement"] not in untaken] if not spares else \
        [{"replacement": j["replacement"]} for j in joins if j["joined_step"] >= 0]
    if freeze and records.get(freeze["index"], {}).get("rejoined_step", -1) >= 0:
        healed.append({"rejoined": freeze["index"]})
    first = job["first"]
    heldout = sorted({r["heldout"] for r in final.values()})
    extra: dict[str, Any] = {}
    running = but_frozen(final, freeze)  # (the stall another event cost: not the frozen member's stop)
    if plan:
        extra["straggler"] = straggler_figures(plan, records, running, first, median, losses, len(kills))
    if (events or {}).get("coordinator_kill_step") is not None:
        extra["coordinator"] = coordinator_figures(job.get("coordinator_kill"), running, median, first)
    if freeze:
        mark_freeze_loss(losses, records, freeze, median)
        extra["freeze"] = freeze_figures(freeze, records, final, first, median, losses,
                                         REJOIN_GRACE_S[(events or {}).get("coordinator", "builtin")])
    return {**extra, "median_step_s": median, "final_steps": sorted({r["final_step"] for r in final.values()}),
            "final_world": sorted({r["counters"]["world"] for r in final.values()}),
            "losses": max(r["counters"]["losses"] for r in seen.values()),
            "joins": max(r["counters"]["joins"] for r in seen.values()),
            "replacements_joined": sum(1 for j in joins if j["joined_step"] >= 0),
            "resyncs": max(r["counters"]["resyncs"] for r in seen.values()),
            "discarded_steps": max(r["counters"]["discarded_steps"] for r in seen.values()),
            "per_loss": losses, "per_join": joins,
            "max_stall_s": max((e["stall_s"] for e in losses), default=None),
            "digests": _digests(records, healed, per_step=mode != "gossip"),
            "lr_steps": sorted({n for r in final.values() for n in r["lr_steps"]}),
            "heldout": heldout[0], "heldout_equal": len(heldout) == 1,
            "heldout_initial": next(iter(final.values()))["heldout_initial"],
            "wall_s": max(r["iters"][-1][1] for r in final.values() if r["iters"]) - first,  # (none: admitted
            # at the last step, on etcd)
            "members": {i: _timeline(r, first) for i, r in records.items()}}


def _timeline(r: dict[str, Any], first: float) -> dict[str, Any]:
    """A member's steps: ``[begin_s, end_s, committed, world, epoch, step, after, loss]``,
    seconds from the run's first step (the loss ``None`` where gossip's step failed first)."""
    rows = [[round(t0 - first, 4), round(t1 - first, 4), ok, world, e, a, b,
             None if math.isnan(loss) else round(loss, 6)]
            for (t0, t1, ok, world), e, (a, b), loss in zip(r["iters"], r["epochs"], r["at"], r["losses"])]
    return {"joined_step": r["joined_step"], "killed": r["killed"], "steps": rows, **timeline_events(r, first)}


def start_members(ctx: Any, n: int, cfg: ChaosConfig, mode: str, port: int | str, out: Any, env: dict[str, str],
                  kills: dict[int, Any], shared: list, events: dict[str, Any] | None = None) -> list:
    """The job's ``n`` member processes, started: the first ``cfg.members`` join at once, the
    others are replacements told when to join through ``shared``; ``kills``: index -> its kill;
    ``events``: the straggler and the eviction policy (:func:`member`)."""
    procs = []
    for i in range(n):
        go = i - cfg.members if i >= cfg.members else None
        p = ctx.Process(target=member, args=(i, cfg, mode, port, str(out), env, time.time(), kills.get(i), go, shared,
                                             events), daemon=True)
        p.start()
        procs.append(p)
    return procs


def run_chaos_bench(cfg: ChaosConfig) -> dict[str, Any]:
    """Every mode and transport: the chaos run and the failure-free one; the report (JSON-able).
    (With ``joiner_runs`` the suite runs :mod:`.joiner_kills` instead: :mod:`fastreduce.bench` picks.)"""
    import tempfile

    if cfg.coordinator == "etcd" and (why := etcd_missing()):
        raise RuntimeError(why)  # before anything starts
    t0 = time.perf_counter()
    report: dict[str, Any] = {"config": asdict(cfg), "machine": machine_info(),
                              "model_params": sum(p.numel() for p in build_model(cfg.params_m).parameters()),
                              "schedule": {m: schedule(cfg, m) for m in cfg.modes},
                              "runs": {}}
    new_events = bool(cfg.straggler) or cfg.coordinator != "builtin" or bool(cfg.freeze)
    if new_events:  # the straggler, the coordinator's leader and the freeze, per mode (the chaos runs')
        report["events"] = {m: events_for(cfg, report["schedule"][m]) for m in cfg.modes}
    for mode in cfg.modes:
        kills = report["schedule"][mode]
        for transport in cfg.transports:
            run: dict[str, Any] = {"mode": mode, "transport": transport}
            for name, ks in (("chaos", kills), ("failure_free", [])):
                events = events_for(cfg, ks, chaos=name == "chaos") if new_events else None
                with tempfile.TemporaryDirectory(prefix=f"fastreduce-chaos-{mode}-{transport}-") as tmp:
                    try:
                        job = run_job(cfg, mode, transport, ks, Path(tmp), events)
                        run[name] = figures(cfg, job, ks, mode, events)
                    except Exception:  # noqa: BLE001 - one run's failure is a row of the report
                        run[name] = {"error": traceback.format_exc()[-4000:]}
            chaos, free = run["chaos"], run["failure_free"]
            if "error" not in chaos and "error" not in free:
                run["heldout_diff_pct"] = 100 * (chaos["heldout"] - free["heldout"]) / free["heldout"]
            report["runs"][f"{mode}/{transport}"] = run
    report["targets"] = judge(cfg, report)
    report["config"]["wall_seconds"] = round(time.perf_counter() - t0, 1)
    return report


def judge(cfg: ChaosConfig, report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per run: held-out loss within the tolerance, digests equal, at most one step discarded
    per loss, every kill seen as a loss and followed by a join, the last step committed
    (``op`` ``"in"``: ``limit`` is the range ``[low, high]``)."""
    targets: dict[str, dict[str, Any]] = {}
    for key, run in report["runs"].items():
        c = run["chaos"]
        if "error" in c or "heldout_diff_pct" not in run:
            targets[f"{key} ran"] = {"value": "failed", "limit": "ran", "op": "==", "pass": False, "what": "the run"}
            continue
        n = len(report["schedule"][run["mode"]])
        strag, frozen = c.get("straggler"), c.get("freeze")
        spare = int(bool(strag and strag["spare"] is not None and strag["evicted"]))  # taken in at the eviction
        froze = int(bool(frozen and frozen["frozen_s"]))  # a loss more
        spare += froze and int(frozen["spare"] is not None)  # (a spare taken in at it)
        # one fewer where a kill's loss was still forming after its thaw: whether the rejoined member
        # filled that loss's room, or a spare did, is the order of two requests
        joins = [n + spare - int(froze and frozen["spare"] is not None and frozen["kills_after"] > 0), n + spare]
        checks = [("held-out", abs(run["heldout_diff_pct"]), "<=", cfg.tolerance_pct,
                   "|held-out loss - failure-free's| (%)"),
                  ("digests", int(not c["digests"]["equal"] or not c["heldout_equal"]), "<=", 0,
                   "steps, heals or final models where the members' parameters differ (0: none; gossip: "
                   "heals against rank 0, the final global average)"),
                  ("discarded", max((e["discarded"] for e in c["per_loss"]), default=0), "<=", 1,
                   "steps discarded at one loss (the most)"),
                  ("losses", len(c["per_loss"]), "==", n + froze, "losses seen (one per kill"
                   + (", and the freeze)" if froze else ")")),
                  ("joins", c["replacements_joined"], "in", joins, "replacements joined (one per kill"
                   + (", and the spares at the eviction or the freeze)" if spare else ")")),
                  ("steps", min(c["final_steps"]), "==", cfg.steps, "committed steps of the final members")]
        checks += event_checks(strag, c.get("coordinator"), frozen, cfg.steps)
        for name, value, op, limit, what in checks:
            ok = value <= limit if op == "<=" else limit[0] <= value <= limit[1] if op == "in" else value == limit
            targets[f"{key} {name}"] = {"value": value, "limit": limit, "op": op, "pass": bool(ok), "what": what}
    return targets


# ---------------------------------------------------------------- the table, CSVs and chart

def _cell(value: Any, fmt: str = "{:.2f}") -> str:
    return "-" if value is None else fmt.format(value) if isinstance(value, float) else str(value)


def summary_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per mode and transport (the table's columns)."""
    rows = []
    for run in report["runs"].values():
        c, f = run["chaos"], run["failure_free"]
        row: dict[str, Any] = {"mode": run["mode"], "transport": run["transport"]}
        if "error" in c or "error" in f:
            text = (c.get("error") or f.get("error", "")).strip().splitlines()
            rows.append({**row, "error": text[-1] if text else "failed"})
            continue
        rows.append({**row, "committed_steps": min(c["final_steps"]), "losses": c["losses"],
                     "joins": c["replacements_joined"],
                     "discarded_steps": sum(e["discarded"] for e in c["per_loss"]), "resyncs": c["resyncs"],
                     "max_stall_s": c["max_stall_s"], "heldout": c["heldout"], "heldout_failure_free": f["heldout"],
                     "heldout_diff_pct": run["heldout_diff_pct"], "digests_equal": c["digests"]["equal"],
                     "wall_s": c["wall_s"], "wall_failure_free_s": f["wall_s"],
                     "median_step_ms": 1e3 * c["median_step_s"], **summary_cells(c)})
    return rows


SUMMARY_FIELDS = ("mode", "transport", "committed_steps", "losses", "joins", "discarded_steps", "resyncs",
                  "max_stall_s", "heldout", "heldout_failure_free", "heldout_diff_pct", "digests_equal", "wall_s",
                  "wall_failure_free_s", "median_step_ms", "error")
STEP_FIELDS = ("mode", "transport", "run", "member", "begin_s", "end_s", "committed", "world", "epoch", "step",
               "after", "loss")


def format_text(report: dict[str, Any]) -> str:
    c = report["config"]
    lines = [f"chaos suite: {c['members']} members, MLP of {report['model_params'] / 1e6:.2f}M params, AdamW "
             f"(lr {c['lr']:g}, cosine), batch {c['batch']}/rank, {c['steps']} committed steps, seed {c['seed']}; "
             + ("each kill's place taken by a warm spare at the loss (a spare's join counted from its registration)"
                if c.get("spares") else f"each kill replaced {c['join_after']} steps later")
             + f"; held-out loss on {c['heldout']} rows against a "
             f"failure-free run (same data and seeds), tolerance {c['tolerance_pct']:g}%", ""]
    for mode, kills in report["schedule"].items():
        lines.append(f"kills ({mode}): " + "; ".join(
            f"{k['kind']} at step {k['step']} (process {k['victim']}, replaced by {k['replacement']})" for k in kills))
    plans, happened = event_lines(report)
    lines += plans
    lines += ["", f"{'mode':<11}{'transport':<14}{'steps':>6}{'losses':>7}{'joins':>6}{'discard':>8}{'max stall':>10}"
                  f"{'held-out':>10}{'no-fail':>9}{'diff':>8}{'digests':>8}{'wall s':>8}{'no-fail s':>10}"]
    for row in summary_rows(report):
        if "error" in row:
            lines.append(f"{row['mode']:<11}{row['transport']:<14}FAILED")
            continue
        lines.append(f"{row['mode']:<11}{row['transport']:<14}{row['committed_steps']:>6}{row['losses']:>7}"
                     f"{row['joins']:>6}{row['discarded_steps']:>8}{_cell(row['max_stall_s']):>10}"
                     f"{row['heldout']:>10.5f}{row['heldout_failure_free']:>9.5f}{row['heldout_diff_pct']:>+7.2f}%"
                     f"{'yes' if row['digests_equal'] else 'NO':>8}{row['wall_s']:>8.1f}{row['wall_failure_free_s']:>10.1f}")
    lines += ["", "(max stall: s from the end of the last committed step before a loss to the end of the first "
              "after it, less one median step; discard: steps discarded over all losses; joins: replacements admitted; digests: every member's "
              "parameters equal at every committed step (DiLoCo: at its syncs), after each heal and at the end; "
              "gossip, whose ranks differ by design: each joiner's equal to rank 0's after its heal, and every "
              "member's global average at the end)", "per loss:"]
    for key, run in report["runs"].items():
        ch = run["chaos"]
        if "error" in ch:
            lines.append(f"  {key} FAILED:\n{ch['error']}")
            continue
        if "error" in run["failure_free"]:
            lines.append(f"  {key} failure-free run FAILED:\n{run['failure_free']['error']}")
        causes = iter(f"{k['kind']:<9} step {k['step']:>3}" for k in report["schedule"][run["mode"]])
        for e in ch["per_loss"]:
            cause = "freeze    " + " " * 8 if e.get("freeze") else next(causes, "(no kill) " + " " * 8)
            lines.append(f"  {key:<24} {cause}: stall {e['stall_s']:.2f} s (Membership's "
                         f"{_cell(e['membership_stall_s'])}), {e['discarded']} discarded, seen at step {e['at_step']}")
        if ch["lr_steps"]:
            lines.append(f"  {key:<24} each bucket's lr scheduler stepped {'/'.join(map(str, ch['lr_steps']))} "
                         f"times (committed steps: {min(ch['final_steps'])})")
        for j in ch["per_join"]:
            if j["members_stall_s"] is None:  # the straggler's spare never taken, or a replacement never admitted
                lines.append(f"  {key:<24} {j['replacement']} never admitted before the last step (the job "
                             "ended first)")
                continue
            first = "-" if j["first_commit_s"] is None else f"{j['first_commit_s']:.2f}"
            began = "the loss (or eviction) that took it in" if report["config"].get("spares") else "it began joining"
            lines.append(f"  {key:<24} join of {j['replacement']} at step {j['joined_step']}: first commit "
                         f"{first} s after {began}, members' stall {j['members_stall_s']:.2f} s")
    if happened:
        lines += ["straggler, coordinator and freeze:", *happened]
    if c["quick"]:
        lines.append("(--quick: one kill, one join, a tiny model and 30 steps: proves the suite runs)")
    if report["targets"]:
        from .report import target_lines
        lines += ["", "targets (report only):", *target_lines(report["targets"], width=34)]
    return "\n".join(lines)


def step_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for run in report["runs"].values():
        for name in ("chaos", "failure_free"):
            for i, mem in run[name].get("members", {}).items():
                rows += [dict(zip(STEP_FIELDS, (run["mode"], run["transport"], name, i, *s))) for s in mem["steps"]]
    return rows


def _write(path: Path, fields: tuple[str, ...], rows: list[dict[str, Any]]) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for row in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})


def _curve(run: dict[str, Any], every: int = 10) -> tuple[list[float], list[float], list[float], list[int]]:
    """Per committed step: the time it ended (the members' median: not a frozen member's step
    that ended after its thaw), the members' mean training loss (smoothed over ``every``
    steps), and the world over time."""
    by_step: dict[int, list[tuple[float, float]]] = {}
    world: list[tuple[float, int]] = []
    for mem in run["members"].values():
        for begin, end, ok, w, _, step, after, loss in mem["steps"]:
            world.append((end, w))
            if ok and after > step and loss is not None:
                by_step.setdefault(step, []).append((end, loss))
    steps = sorted(by_step)
    t = [statistics.median(e for e, _ in by_step[s]) for s in steps]
    loss = [statistics.fmean(v for _, v in by_step[s]) for s in steps]
    smooth = [statistics.fmean(loss[max(0, i - every + 1):i + 1]) for i in range(len(loss))]
    world.sort()
    return t, smooth, [e for e, _ in world], [w for _, w in world]


def write_chart(report: dict[str, Any], path: Path) -> str | None:
    """Training loss and world size against wall time, a panel per mode, a colour per
    transport (the failure-free run dashed), the chaos runs' events marked (each kill, each
    replacement's first step, the straggler's slowed steps and its eviction, the etcd
    leader's kill: :func:`.chaos_events.draw_events`, in the legend); ``None`` when written."""
    from .report import pyplot

    plt = pyplot()
    if plt is None:
        return "chaos chart skipped: matplotlib is not installed (pip install 'fastreduce[plot]')"
    modes = list(dict.fromkeys(r["mode"] for r in report["runs"].values()))
    fig, axes = plt.subplots(len(modes), 1, figsize=(10, 3.8 * len(modes)), squeeze=False)
    for ax, mode in zip(axes[:, 0], modes):
        twin = ax.twinx()
        drawn: set[str] = set()
        for n, run in enumerate(r for r in report["runs"].values() if r["mode"] == mode):
            colour = f"C{n}"
            for name, style in (("chaos", "-"), ("failure_free", "--")):
                if "members" not in run[name]:
                    continue
                t, loss, tw, w = _curve(run[name])
                label = f"{run['transport']}" + (" (failure-free)" if name == "failure_free" else "")
                ax.plot(t, loss, style, color=colour, lw=1.2 if name == "chaos" else 0.9, label=label)
                if name == "chaos":
                    twin.step(tw, w, where="post", color=colour, alpha=0.45, lw=1.0)
                    drawn |= draw_events(ax, run[name])
        failed = [r["transport"] for r in report["runs"].values() if r["mode"] == mode and "error" in r["chaos"]]
        ax.set(xlabel="wall time, s (from the first step)", ylabel="training loss (mean of members, 10 steps)",
               title=f"{mode}: {report['config']['steps']} committed steps, kills: "
                     + ", ".join(f"{k['kind']} @{k['step']}" for k in report["schedule"][mode])
                     + event_title(report.get("events", {}).get(mode))
                     + (f"\nthe chaos run FAILED on {', '.join(failed)} (see the report)" if failed else ""))
        twin.set_ylabel("world size (thin)")
        twin.set_ylim(0, report["config"]["members"] + 1)
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(handles=ax.get_legend_handles_labels()[0] + legend_handles(drawn), fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def write_outputs(report: dict[str, Any], out: Path) -> dict[str, Any]:
    """``chaos.csv``, ``chaos_steps.csv`` and ``chaos.png`` (or a note) in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    rows = summary_rows(report)
    _write(out / "chaos.csv", summary_fields(SUMMARY_FIELDS, rows), rows)
    _write(out / "chaos_steps.csv", STEP_FIELDS, step_rows(report))
    note = write_chart(report, out / "chaos.png")
    return {"chaos_csv": str(out / "chaos.csv"), "chaos_steps_csv": str(out / "chaos_steps.csv"),
            "chaos_png": None if note else str(out / "chaos.png"), "chaos_chart_note": note}
