"""``fastreduce bench faults``: training that goes on at a loss and a join, side by side.

Issue 49's measurement, for the fused mode (``--faults-mode zero``: ZeRO, fastreduce's
contenders only): the same model, data and failure schedule under three ways of surviving a
lost process.

=======================  ===============================================================
 ``fastreduce_gloo``,     :class:`fastreduce.Membership` + :class:`fastreduce.FusedReducer`
 ``fastreduce_shm``       (``--faults-wire``, fp32 by default), on Gloo
                          (``FASTREDUCE_TRANSPORT=process_group``) and on shared memory;
                          a coordinator (:func:`fastreduce.membership.serve`) in the launcher
 ``torchft``              torchft 0.2.0 (``pip install torchft==0.2.0``, by ``make bench``;
                          skipped with a note where it does not import): a Lighthouse in the
                          launcher, each member a replica of one rank with its own
                          ``Manager`` (``ProcessGroupGloo`` with a 5 s timeout, async quorum,
                          ``init_sync=False``: the replicas start from the same seed), one
                          ``Manager.allreduce`` of a flat fp32 gradient buffer per step,
                          AdamW stepped on ``should_commit()``
 ``checkpoint_restart``   a plain :class:`fastreduce.FusedReducer` on Gloo, saved by
                          :class:`fastreduce.checkpoint.Checkpointer` every
                          ``checkpoint_every`` (20) steps, under a launcher that, like
                          torchrun's agent (it polls every 0.1 s), kills the whole job when a
                          rank dies and starts it again (fresh interpreters: the imports are
                          paid again) from the last checkpoint
=======================  ===============================================================

The schedule (:class:`FaultsConfig`): ``members`` (4) processes train a ``params_m``-million
parameter MLP (1M by default; ``--params-m 10`` for the joiner target's model) with AdamW on
seeded batches (each rank its own, drawn from the step and the rank) to ``steps`` (300)
committed steps. The last member dies (SIGKILL to itself) mid-step (after its backward, before the
reduction) at a step drawn from ``seed``; ``join_after`` (20) committed steps later a
replacement joins: a process started with the others (spawned fresh, so its process start and
imports are measured, and reported apart), waiting until it is told to join. Under
checkpoint-restart there is no replacement: the relaunched job is it.

Per contender: the survivors' **stall at the loss** (from the end of the last committed step
before the loss to the end of the first committed step after it, less one median step: the
time training stood still), the **steps discarded** (steps computed and thrown away: the
step in flight, and under checkpoint-restart the steps since the checkpoint), the joiner's
time from the moment it starts joining (``Membership``/``Manager`` made; the relaunch after
the loss was seen) to its **first committed step**, its **process start + imports** apart,
the members' **stall at the join** (each member's steps between the joiner's start and its
first commit, their excess over the median step, summed; the largest member's), and the
**wall time to** ``steps`` committed steps (from the first step begun to the last committed).

The **per-step cost with no failure**: after the run, the same processes (the survivors and
the joiner) time blocks of ``block`` steps without the fault tolerance and with it,
alternately, ``rounds`` (3) times: Membership's ``commit()`` against the same
``FusedReducer``'s ``reduce()`` alone on the same group; torchft's Manager step against a
plain ``dist.all_reduce`` of the same flat buffer on an ordinary Gloo group of the same
processes; checkpoint-restart's ``checkpoint_every`` steps ending in a save against as many
without. The ratio is the median of the rounds' ratios, each block's figure its mean step over the
ranks with the slowest tenth of its steps left out (bursts of other work on a shared machine).

Targets (reported, never enforced; issue 49): stall at a loss at most 2 s on Gloo, 0.5 s on
shared memory; at most one step discarded per loss; the joiner's first committed step at most
1 s after it starts joining (the issue states it for a 10M-parameter model), the members'
stall at a join at most 0.5 s; the no-failure step at most 1.02x; the wall time to ``steps``
committed steps below torchft's and checkpoint-restart's.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import statistics
import time
import traceback
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from .common import crash, machine_info

__all__ = ["CONTENDERS", "FaultsConfig", "build_model", "format_text", "quick_config", "run_faults_bench"]

SPARE = "fastreduce_spare"
"""fastreduce on Gloo whose replacement is a warm spare (``Membership(spare=True)``): it registers
at the start and is admitted by the epoch the survivors form at the loss."""
CONTENDERS = ("fastreduce_gloo", "fastreduce_shm", SPARE, "torchft", "checkpoint_restart")
TRANSPORTS = {"fastreduce_gloo": "process_group", "fastreduce_shm": "shm", SPARE: "process_group"}
WIRES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MODES = ("fused", "zero")
"""``--faults-mode``: fastreduce's mode under Membership (``zero``: ``ZeroOptimizer(redundant=True)``,
fastreduce's contenders only: torchft and checkpoint-restart reduce one fused buffer)."""
DIM = 64
"""The MLP's input and output width; its hidden width is picked for ``params_m``."""
LR = 1e-3
POLL_S = 0.1
"""How often the checkpoint-restart launcher looks at its ranks (torchrun's agent: 0.1 s)."""
TIMEOUT_S = float(os.environ.get("FASTREDUCE_FAULTS_TIMEOUT_S", 600))
"""The longest one job may take before the launcher kills it."""


@dataclass(kw_only=True)
class FaultsConfig:
    """One run of the suite."""

    contenders: tuple[str, ...] = CONTENDERS
    """Which to run (``--faults-contenders``)."""
    members: int = 4
    """Processes the job starts with; the last one is lost, a replacement joins."""
    steps: int = 300
    """Committed steps each contender trains to."""
    params_m: float = 1.0
    """The MLP's size in millions of fp32 parameters."""
    batch: int = 32
    """Rows per rank and step."""
    wire: str = "fp32"
    """fastreduce's wire dtype (``fp32`` or ``bf16``; torchft's buffer is fp32)."""
    mode: str = "fused"
    """fastreduce's mode (:data:`MODES`)."""
    seed: int = 0
    """Draws the step at which the member is lost, and the data."""
    join_after: int = 20
    """Committed steps between the loss and the replacement's start of joining."""
    checkpoint_every: int = 20
    """Checkpoint-restart's save interval (steps)."""
    rounds: int = 3
    """No-failure cost: rounds of (without, with) blocks; the ratio is their median."""
    block: int = 100
    """Steps per timed block (checkpoint-restart's: ``checkpoint_every`` steps and a save,
    timed as one)."""
    heartbeat_s: float = 0.25
    """``FASTREDUCE_HEARTBEAT_S`` for fastreduce's members and checkpoint-restart's ranks."""
    torchft_timeout_s: float = 5.0
    """torchft's ``ProcessGroupGloo`` timeout (the issue's anchor: 5 s)."""
    pace_s: float = 0.0
    """A pause after each step (not timed): ``--quick``'s steps are too short for the
    replacement to arrive before the end otherwise."""
    quick: bool = False

    def __post_init__(self) -> None:
        unknown = [c for c in self.contenders if c not in CONTENDERS]
        if unknown or not self.contenders:
            raise ValueError(f"contenders must be among {', '.join(CONTENDERS)}, got {self.contenders!r}")
        if self.wire not in WIRES:
            raise ValueError(f"wire must be one of {', '.join(WIRES)}, got {self.wire!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.mode == "zero" and set(self.contenders) - set(TRANSPORTS):
            raise ValueError("the zero mode runs fastreduce's contenders only (torchft and checkpoint-restart "
                             "reduce one fused buffer): --faults-contenders fastreduce_gloo,fastreduce_shm")
        if self.members < 3:
            raise ValueError(f"members must be at least 3 (two survivors go on), got {self.members}")
        if not self.params_m > 0 or self.batch < 1 or self.rounds < 1 or self.block < 1:
            raise ValueError("params_m must be positive; batch, rounds and block at least 1")
        if self.checkpoint_every < 1 or self.join_after < 1:
            raise ValueError("checkpoint_every and join_after must be at least 1")
        if self.kill_step + self.join_after + 2 > self.steps:
            raise ValueError(f"steps={self.steps} leaves no room for the loss at step {self.kill_step} and the "
                             f"join {self.join_after} steps later")

    @property
    def kill_step(self) -> int:
        """The step (committed steps so far) the last member dies in: drawn from ``seed``
        in the first third of the run, never on a checkpoint's step."""
        lo = max(2, self.steps // 8)
        rng = random.Random(self.seed)
        while True:
            step = rng.randrange(lo, max(lo + 1, self.steps // 3))
            if step % self.checkpoint_every:
                return step


def quick_config(**given: Any) -> FaultsConfig:
    """``--quick``: 3 members, a 0.05M model, 24 steps, a save every 5 (the smoke test's)."""
    base = dict(members=3, steps=24, params_m=0.05, batch=8, join_after=5, checkpoint_every=5, rounds=3,
                block=3, pace_s=0.02, quick=True)
    return FaultsConfig(**{**base, **given})


# ---------------------------------------------------------------- the model and the data

def build_model(params_m: float) -> nn.Sequential:
    """A 4-layer MLP of about ``params_m`` million parameters (the same on every process)."""
    p = params_m * 1e6
    b = 2 * DIM + 3  # parameters = 2 w^2 + (2 DIM + 3) w + DIM
    width = max(8, int((-b + math.sqrt(b * b + 8 * max(p - DIM, 0))) / 4))
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, width), nn.ReLU(), nn.Linear(width, DIM))


def batch_for(cfg: FaultsConfig, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 1009 + rank)
    x = torch.randn(cfg.batch, DIM, generator=g)
    return x, x.roll(1, dims=1).sin()


def _loss(model: nn.Module, cfg: FaultsConfig, step: int, rank: int) -> None:
    x, y = batch_for(cfg, step, rank)
    nn.functional.mse_loss(model(x), y).backward()


# ---------------------------------------------------------------- what a process records

@dataclass
class Shared:
    """What the launcher and the replacement read while the job runs (written by the
    members, so a SIGKILL of any one loses nothing): committed steps so far, when the
    first step began and the last committed one ended; ``go`` is set as the step
    ``go_at`` is committed: the replacement's signal to join."""

    progress: Any
    first: Any
    last: Any
    go: Any
    go_at: int
    ready: Any  # every process of the job, the replacement's included, imported and built

    @classmethod
    def make(cls, ctx: Any, go_at: int, parties: int) -> Shared:
        return cls(ctx.Value("i", 0), ctx.Value("d", 0.0), ctx.Value("d", 0.0), ctx.Event(), go_at,
                   ctx.Barrier(parties))

    def started(self, t: float) -> None:
        with self.first.get_lock():
            if self.first.value == 0.0:
                self.first.value = t

    def committed(self, step: int, t: float) -> None:
        with self.progress.get_lock():
            self.progress.value = max(self.progress.value, step)
            self.last.value = max(self.last.value, t)
        if step >= self.go_at and not self.go.is_set():
            self.go.set()


@dataclass
class Record:
    """One process's figures, written as ``<contender>-<index>[-<attempt>].json``."""

    index: int
    spawned: float  # time.time() when the launcher started it
    imported: float = 0.0  # when its function began: the interpreter up, torch and fastreduce imported
    join_start: float = 0.0  # Membership / Manager made, or (restart) the process group begun
    first_commit: float = 0.0
    iters: list[tuple[float, float, bool, int]] = field(default_factory=list)  # (begin, end, committed, world)
    blocks: dict[str, list[list[float]]] = field(default_factory=lambda: {"without": [], "with": []})
    counters: dict[str, Any] = field(default_factory=dict)
    final_step: int = 0
    error: str = ""

    def step_done(self, t0: float, ok: bool, world: int, shared: Shared, step: int) -> None:
        t1 = time.time()
        self.iters.append((t0, t1, ok, world))
        if ok:
            self.first_commit = self.first_commit or t1
            shared.committed(step, t1)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))


def _enter(env: dict[str, str], spawned: float, index: int) -> Record:
    os.dup2(2, 1)  # stdout stays the report's
    record = Record(index=index, spawned=spawned, imported=time.time())
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(1)
    logging.getLogger("torchft").setLevel(logging.ERROR)
    for name in ("torchft_quorums", "torchft_commits", "torchft_errors"):
        logging.getLogger(name).setLevel(logging.ERROR)
    return record


def _timed_blocks(record: Record, cfg: FaultsConfig, barrier: Callable[[], None],
                  without: Callable[[], None], with_: Callable[[], None], block: int) -> None:
    """``cfg.rounds`` rounds of a block without and a block with, alternating which is
    first; each step's seconds recorded (see :func:`_block_s`)."""
    for r in range(cfg.rounds):
        kinds = (("without", without), ("with", with_))
        for kind, step in (kinds if r % 2 == 0 else kinds[::-1]):
            barrier()
            times = []
            for _ in range(block):
                t = time.perf_counter()
                step()
                times.append(time.perf_counter() - t)
            record.blocks[kind].append(times)


# ---------------------------------------------------------------- fastreduce.Membership

def fastreduce_member(index: int, cfg: FaultsConfig, port: int, out: str, name: str, env: dict[str, str],
                      spawned: float, kill: int | None, joiner: bool, shared: Shared) -> None:
    """One member (``joiner``: the replacement, which joins once ``shared.go`` is set)."""
    record = _enter(env, spawned, index)
    try:
        import fastreduce
        from fastreduce.membership import Membership

        model = build_model(cfg.params_m)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        zero = cfg.mode == "zero"
        mode_class = fastreduce.ZeroOptimizer if zero else fastreduce.FusedReducer  # (imported on first use)
        shared.ready.wait(TIMEOUT_S)  # the replacement is imported before the members begin
        spare = joiner and name == SPARE  # (registered from the start: it waits for the loss)
        if joiner and not spare:
            shared.go.wait(TIMEOUT_S)
        record.join_start = time.time()
        m = Membership(f"127.0.0.1:{port}", world_size=cfg.members, min_ranks=2, tag=f"{cfg.mode} {cfg.wire}",
                       wait_s=120, spare=spare)
        if zero:  # the mode is the optimizer, rebuilt at every epoch
            m.join({"model": model}, lambda: mode_class(
                model.parameters(), torch.optim.AdamW, lr=LR, module=model, redundant=True,
                wire_dtype=WIRES[cfg.wire]))
        else:
            m.join({"model": model, "optimizer": opt}, lambda: mode_class(model, wire_dtype=WIRES[cfg.wire]))

        def stepper() -> Any:
            return m.mode if zero else opt

        while m.step < cfg.steps:
            t0 = time.time()
            shared.started(t0)
            _loss(model, cfg, m.step, m.rank)
            if kill == m.step:
                crash()
            ok = m.commit(stepper().step)  # the reduction, AdamW's step (ZeRO: the vote between them)
            stepper().zero_grad()
            record.step_done(t0, ok, m.world, shared, m.step)
            time.sleep(cfg.pace_s)

        def without() -> None:  # the same mode, outside Membership (ZeRO: its copies of the shards kept)
            _loss(model, cfg, m.step, m.rank)
            if zero:
                m.mode.step()
                m.mode.wait_params()
            else:
                m.mode.reduce()
                opt.step()
            stepper().zero_grad()

        def with_() -> None:
            _loss(model, cfg, m.step, m.rank)
            m.commit(stepper().step)
            stepper().zero_grad()

        _timed_blocks(record, cfg, dist.barrier, without, with_, cfg.block)
        c = m.counters
        record.counters = {"discarded_steps": c.discarded_steps, "losses": c.losses, "joins": c.joins,
                           "stalls": [list(s) for s in c.stalls]}
        record.final_step = m.step
        m.close()
    except BaseException:  # noqa: BLE001 - reported by the launcher
        record.error = traceback.format_exc()
    record.save(Path(out) / f"{name}-{index}.json")


# ---------------------------------------------------------------- torchft

def torchft_available() -> str | None:
    """``None`` where torchft imports, else why not."""
    try:
        import torchft  # noqa: F401
        from torchft.coordination import LighthouseServer  # noqa: F401
    except Exception as err:  # noqa: BLE001 - any import failure means: skip it
        return f"torchft does not import here ({type(err).__name__}: {err}); pip install torchft==0.2.0"
    return None


def torchft_member(index: int, cfg: FaultsConfig, where: tuple[str, int], out: str, name: str,
                   env: dict[str, str], spawned: float, kill: int | None, joiner: bool, shared: Shared,
                   ready: Any) -> None:
    """One replica of one rank: its own Manager, one allreduce of a flat gradient buffer."""
    record = _enter(env, spawned, index)
    try:
        from torchft import Manager, ProcessGroupGloo

        lighthouse, plain_port = where
        model = build_model(cfg.params_m)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        params = list(model.parameters())
        flat = torch.zeros(sum(p.numel() for p in params))
        views = list(flat.split([p.numel() for p in params]))
        views = [v.view(p.shape) for v, p in zip(views, params)]
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # this replica group's
        shared.ready.wait(TIMEOUT_S)  # the replacement is imported before the members begin
        if joiner:
            shared.go.wait(TIMEOUT_S)

        def state_dict() -> dict[str, Any]:
            return {"model": model.state_dict(), "optimizer": opt.state_dict()}

        def load_state_dict(sd: dict[str, Any]) -> None:
            model.load_state_dict(sd["model"])
            opt.load_state_dict(sd["optimizer"])

        record.join_start = time.time()
        manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=cfg.torchft_timeout_s)), min_replica_size=2,
                          load_state_dict=load_state_dict, state_dict=state_dict, replica_id=f"replica_{index}",
                          lighthouse_addr=lighthouse, store_addr="127.0.0.1", store_port=store.port, rank=0,
                          world_size=1, use_async_quorum=True, init_sync=False, timeout=timedelta(seconds=30),
                          quorum_timeout=timedelta(seconds=60))
        if ready is not None:
            ready.wait(TIMEOUT_S)  # every first replica beats before any asks for a quorum
        data_rank = min(index, cfg.members - 1)

        def ft_step(kill_at: int | None = None) -> bool:
            manager.start_quorum()
            _loss(model, cfg, manager.current_step(), data_rank)
            if kill_at == manager.current_step():
                crash()
            torch._foreach_copy_(views, [p.grad for p in params])
            manager.allreduce(flat).wait()
            torch._foreach_copy_([p.grad for p in params], views)
            ok = manager.should_commit()
            if ok:
                opt.step()
            opt.zero_grad(set_to_none=False)
            return ok

        # A replica's should_commit is its own (another's may differ; the next quorum heals
        # it), so one may end a step behind: it stops when any replica has committed the last
        # step, rather than ask for a quorum that the finished replicas never join.
        while max(manager.current_step(), shared.progress.value) < cfg.steps:
            t0 = time.time()
            shared.started(t0)
            ok = ft_step(kill)
            record.step_done(t0, ok, manager.num_participants(), shared, manager.current_step())
            time.sleep(cfg.pace_s)
        # the no-manager baseline: an ordinary Gloo group of the same processes
        plain = dist.TCPStore("127.0.0.1", plain_port, is_master=False, wait_for_workers=False)
        dist.init_process_group("gloo", store=dist.PrefixStore("plain/", plain), rank=data_rank,
                                world_size=cfg.members, timeout=timedelta(seconds=120))

        def without() -> None:
            _loss(model, cfg, manager.current_step(), data_rank)
            torch._foreach_copy_(views, [p.grad for p in params])
            dist.all_reduce(flat)
            flat.div_(cfg.members)
            torch._foreach_copy_([p.grad for p in params], views)
            opt.step()
            opt.zero_grad(set_to_none=False)

        _timed_blocks(record, cfg, dist.barrier, without, ft_step, cfg.block)
        record.final_step = manager.current_step()
        record.save(Path(out) / f"{name}-{index}.json")  # before the shutdown, which may linger
        dist.barrier()
        manager.shutdown(wait=False)
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported by the launcher
        record.error = traceback.format_exc()
    record.save(Path(out) / f"{name}-{index}.json")
    os._exit(0)  # torchft's servers and threads: no interpreter teardown


# ---------------------------------------------------------------- checkpoint-restart

def restart_rank(rank: int, cfg: FaultsConfig, port: int, attempt: int, out: str, env: dict[str, str],
                 spawned: float, kill: int | None, shared: Shared) -> None:
    """One rank of one attempt: resume from the last checkpoint, train, save every few steps."""
    record = _enter(env, spawned, rank)
    name = f"checkpoint_restart-{rank}-{attempt}"
    try:
        import fastreduce
        from fastreduce.checkpoint import Checkpointer

        record.join_start = time.time()
        store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
        dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt{attempt}/", store), rank=rank,
                                world_size=cfg.members, timeout=timedelta(seconds=120))
        model = build_model(cfg.params_m)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        reducer = fastreduce.FusedReducer(model, wire_dtype=WIRES[cfg.wire])
        ckpt = Checkpointer(Path(out) / "checkpoints", model, opt, mode=reducer)
        step = ckpt.load_latest()

        def plain() -> None:
            _loss(model, cfg, step, rank)
            reducer.reduce()
            opt.step()
            opt.zero_grad()

        while step < cfg.steps:
            t0 = time.time()
            shared.started(t0)
            _loss(model, cfg, step, rank)
            if kill == step:
                crash()
            reducer.reduce()
            opt.step()
            opt.zero_grad()
            step += 1
            if step % cfg.checkpoint_every == 0:
                ckpt.save(step)
            record.step_done(t0, True, cfg.members, shared, step)
            time.sleep(cfg.pace_s)
        saves = iter(range(cfg.steps + 1, cfg.steps + 1 + cfg.rounds))

        def with_() -> None:  # a checkpoint's worth of steps and its save
            for _ in range(cfg.checkpoint_every):
                plain()
            ckpt.save(next(saves))

        def without() -> None:
            for _ in range(cfg.checkpoint_every):
                plain()

        _timed_blocks(record, cfg, dist.barrier, without, with_, 1)
        record.final_step = step
        record.save(Path(out) / f"{name}.json")
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported by the launcher
        record.error = traceback.format_exc()
    record.save(Path(out) / f"{name}.json")


# ---------------------------------------------------------------- the launchers

def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, **extra}


def _wait(procs: list[Any], deadline: float) -> None:
    for p in procs:
        p.join(max(0.0, deadline - time.time()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)


def _elastic_job(cfg: FaultsConfig, name: str, out: Path) -> dict[str, Any]:
    """A fastreduce or torchft job: the members, the loss, the replacement told to join."""
    from ..launch import rank_context

    fork, spawn = rank_context("fastreduce.bench.faults"), mp.get_context("spawn")
    kill = cfg.kill_step
    shared = Shared.make(spawn, kill + cfg.join_after, cfg.members + 1)
    env = _env(FASTREDUCE_HEARTBEAT_S=str(cfg.heartbeat_s), FASTREDUCE_TRANSPORT=TRANSPORTS.get(name, "process_group"))
    if name == "torchft":
        os.environ.setdefault("RUST_LOG", "error")  # torchft's servers log every quorum and commit at info
        env.setdefault("RUST_LOG", os.environ["RUST_LOG"])
        from torchft.coordination import LighthouseServer

        server = LighthouseServer(bind="[::]:0", min_replicas=2)
        plain = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        ready = fork.Barrier(cfg.members)
        target: Callable[..., None] = torchft_member
        where: Any = (server.address(), plain.port)
        extra: Callable[[int], tuple] = lambda i: (ready if i < cfg.members else None,)  # noqa: E731
    else:
        from ..membership import serve

        server = serve(0, "127.0.0.1")
        target, where, extra = fastreduce_member, server.port, lambda i: ()
    procs = []
    for i in range(cfg.members + 1):  # the last: the replacement, spawned fresh (its imports are measured)
        ctx = spawn if i == cfg.members else fork
        args = (i, cfg, where, str(out), name, env, time.time(), kill if i == cfg.members - 1 else None,
                i == cfg.members, shared, *extra(i))
        p = ctx.Process(target=target, args=args, daemon=True)
        p.start()
        procs.append(p)
    deadline = time.time() + TIMEOUT_S
    try:
        _wait(procs[:cfg.members], deadline)  # the replacement is done with them, or will never be
        _wait(procs[cfg.members:], min(deadline, time.time() + 30))
    finally:
        _wait(procs, time.time())
        if name == "torchft":
            server.shutdown()
    records = {}
    for i in range(cfg.members + 1):
        f = out / f"{name}-{i}.json"
        records[i] = json.loads(f.read_text()) if f.exists() else None
    return {"records": records, "first": shared.first.value, "name": name}


def _restart_job(cfg: FaultsConfig, out: Path) -> dict[str, Any]:
    """Checkpoint-restart: attempts until one ends with every rank done."""
    from ..launch import rank_context

    fork, spawn = rank_context("fastreduce.bench.faults"), mp.get_context("spawn")
    shared = Shared.make(spawn, cfg.steps + 1, 1)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = _env(FASTREDUCE_HEARTBEAT_S=str(cfg.heartbeat_s), FASTREDUCE_TRANSPORT="process_group")
    attempts: list[dict[str, Any]] = []
    deadline = time.time() + TIMEOUT_S
    for attempt in range(3):
        ctx = fork if attempt == 0 else spawn  # a relaunch starts new interpreters: imports paid again
        launched = time.time()
        procs = []
        for rank in range(cfg.members):
            kill = cfg.kill_step if attempt == 0 and rank == cfg.members - 1 else None
            p = ctx.Process(target=restart_rank, args=(rank, cfg, store.port, attempt, str(out), env, time.time(),
                                                       kill, shared), daemon=True)
            p.start()
            procs.append(p)
        failed_at = None
        while time.time() < deadline:
            codes = [p.exitcode for p in procs]
            if any(c not in (None, 0) for c in codes):
                failed_at = time.time()
                break
            if all(c == 0 for c in codes):
                break
            time.sleep(POLL_S)
        committed, last = shared.progress.value, shared.last.value
        _wait(procs, time.time())  # the agent stops the rest of the job
        attempts.append({"launched": launched, "failed_at": failed_at, "committed": committed, "last_commit": last,
                         "codes": [p.exitcode for p in procs]})
        if failed_at is None:
            break
    records = {}
    for i, _ in enumerate(attempts):
        for rank in range(cfg.members):
            f = out / f"checkpoint_restart-{rank}-{i}.json"
            records[f"{rank}-{i}"] = json.loads(f.read_text()) if f.exists() else None
    return {"records": records, "attempts": attempts, "first": shared.first.value}


# ---------------------------------------------------------------- the figures

def _median_step(records: list[dict[str, Any]]) -> float:
    durations = [t1 - t0 for r in records for t0, t1, ok, _ in r["iters"] if ok]
    return statistics.median(durations) if durations else float("nan")


def _loss_stall(record: dict[str, Any], median: float) -> float | None:
    """From the end of the last step committed before the loss (the first step discarded,
    or the first with fewer members) to the end of the first committed at or after it,
    less one median step."""
    iters = record["iters"]
    lost = _lost_at(iters, iters[0][3] if iters else 0)
    if lost is None:
        return None
    after = next((i for i in range(lost, len(iters)) if iters[i][2]), None)
    if after is None:
        return None
    before = iters[lost - 1][1] if lost else iters[lost][0]
    return iters[after][1] - before - median


def _lost_at(iters: list[Any], world: int) -> int | None:
    """The index of the first step a loss touched: discarded, or with fewer than ``world``."""
    return next((i for i, it in enumerate(iters) if not it[2] or it[3] < world), None)


def _full_again(record: dict[str, Any], members: int) -> float | None:
    """From the end of the first step this survivor committed after the loss (its first in the
    next epoch) to the end of its first committed with ``members`` members again."""
    iters = record["iters"]
    lost = _lost_at(iters, members)
    if lost is None:
        return None
    entered = next((it[1] for it in iters[lost:] if it[2]), None)
    full = next((it[1] for it in iters[lost:] if it[2] and it[3] == members), None)
    return None if entered is None or full is None else full - entered


def _join_stall(record: dict[str, Any], joiner: dict[str, Any], median: float) -> float:
    """The excess over the median step of this member's steps that overlap the joiner's
    joining (from its start to its first commit), summed."""
    lo, hi = joiner["join_start"], joiner["first_commit"]
    return sum(max(0.0, t1 - t0 - median) for t0, t1, _, _ in record["iters"] if t1 >= lo and t0 <= hi)


TRIM = 0.1
"""The share of a block's slowest steps left out of its figure (bursts of the other
processes on a shared machine)."""


def _block_s(records: list[dict[str, Any]], kind: str, k: int) -> float:
    """Block ``k``'s seconds per step: each step's mean over the ranks (coupled by the
    collective, their sums are the block's wall time), the slowest :data:`TRIM` of the
    steps left out, the rest averaged."""
    steps = sorted(statistics.fmean(ts) for ts in zip(*(r["blocks"][kind][k] for r in records)))
    return statistics.fmean(steps[:max(1, round(len(steps) * (1 - TRIM)))])


def _ratio(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The no-failure cost: per round, the with block over the without block
    (:func:`_block_s`); the median of the rounds."""
    rounds = min(len(r["blocks"]["with"]) for r in records)
    if not rounds:
        return {}
    w, wo = [_block_s(records, "with", k) for k in range(rounds)], [_block_s(records, "without", k) for k in range(rounds)]
    ratios = [a / b for a, b in zip(w, wo)]
    return {"ratio": statistics.median(ratios), "rounds": ratios, "with_s": w, "without_s": wo}


def _elastic_figures(cfg: FaultsConfig, job: dict[str, Any]) -> dict[str, Any]:
    records = job["records"]
    errors = {i: r["error"] for i, r in records.items() if r and r["error"]}
    if errors:
        return {"error": "\n".join(f"process {i}: {e}" for i, e in errors.items())[-4000:]}
    victim = cfg.members - 1
    survivors = [records[i] for i in range(cfg.members) if i != victim and records[i]]
    joiner = records[cfg.members]
    if len(survivors) < cfg.members - 1 or joiner is None:
        missing = [i for i, r in records.items() if r is None and i != victim]
        return {"error": f"processes {missing} left no record (killed by the launcher's timeout?)"}
    finals = [*survivors, joiner]
    median = _median_step(survivors)
    stalls = [s for s in (_loss_stall(r, median) for r in survivors) if s is not None]
    discarded = max(sum(1 for it in r["iters"] if not it[2]) for r in survivors)
    spare = job.get("name") == SPARE  # its join is the loss's epoch: its stall is the loss's, above
    full = [f for f in (_full_again(r, cfg.members) for r in survivors) if f is not None]
    out = {"median_step_s": median, "loss_stall_s": max(stalls) if stalls else None, "discarded_steps": discarded,
           "join_stall_s": None if spare else max(_join_stall(r, joiner, median) for r in survivors),
           "joiner_first_commit_s": None if spare else joiner["first_commit"] - joiner["join_start"],
           "full_again_s": max(full) if full else None,
           "joiner_start_imports_s": joiner["imported"] - joiner["spawned"],
           "wall_s": max(r["iters"][-1][1] for r in finals) - job["first"],
           "final_steps": sorted({r["final_step"] for r in finals}), "no_failure": _ratio(finals)}
    counters = [r["counters"] for r in survivors if r["counters"]]
    if counters:  # Membership's own account of each new epoch's stall (the largest member's)
        for why in ("loss", "join"):
            seen = [s for c in counters for w, s in c["stalls"] if w == why]
            out[f"membership_{why}_stall_s"] = max(seen) if seen else None
        out["membership_joined_s"] = next((s for w, s in joiner["counters"]["stalls"] if w == "joined"), None)
    return out


def _restart_figures(cfg: FaultsConfig, job: dict[str, Any]) -> dict[str, Any]:
    records, attempts = job["records"], job["attempts"]
    failed = {str(i) for i, a in enumerate(attempts) if a["failed_at"] is not None}
    # a failed attempt's survivors raise RankLostError (what the relaunch answers), unless the
    # agent stopped them first: the others' errors are the bench's
    errors = {k: r["error"] for k, r in records.items() if r and r["error"]
              and not (k.split("-")[1] in failed and "RankLostError" in r["error"])}
    if errors or len(attempts) != 2 or attempts[-1]["failed_at"] is not None:
        return {"error": ("\n".join(f"rank-attempt {k}: {e}" for k, e in errors.items())[-4000:]
                          or f"expected one failure and one relaunch, got {attempts}")}
    last = [records[f"{r}-1"] for r in range(cfg.members)]
    if any(r is None for r in last):
        return {"error": "a relaunched rank left no record"}
    median = _median_step(last)
    t_lost = attempts[0]["last_commit"]  # the end of the last step committed before the loss
    committed = attempts[0]["committed"]
    resumed = min(r["first_commit"] for r in last)
    ckpt = committed - committed % cfg.checkpoint_every
    redo_end = max(r["iters"][committed - ckpt - 1][1] for r in last) if committed > ckpt else resumed
    return {"median_step_s": median,
            "loss_stall_s": resumed - t_lost - median,
            "loss_seen_after_s": attempts[0]["failed_at"] - t_lost,
            "relaunch_to_first_commit_s": resumed - attempts[1]["launched"],
            "joiner_first_commit_s": max(r["first_commit"] - r["join_start"] for r in last),
            "joiner_start_imports_s": max(r["imported"] - r["spawned"] for r in last),
            "discarded_steps": committed - ckpt + 1,
            "lost_per_failure_s": redo_end - t_lost,
            "join_stall_s": None,
            "wall_s": max(r["iters"][-1][1] for r in last) - job["first"],
            "final_steps": sorted({r["final_step"] for r in last}),
            "no_failure": _ratio(last)}


def run_faults_bench(cfg: FaultsConfig, out: Path | None = None) -> dict[str, Any]:
    """Run each contender's job in turn; the report (JSON-able)."""
    import tempfile

    t0 = time.perf_counter()
    report: dict[str, Any] = {"config": {**asdict(cfg), "kill_step": cfg.kill_step}, "machine": machine_info(),
                              "model_params": sum(p.numel() for p in build_model(cfg.params_m).parameters()),
                              "contenders": {}}
    for name in cfg.contenders:
        if name == "torchft" and (why := torchft_available()) is not None:
            report["contenders"][name] = {"skipped": why}
            continue
        with tempfile.TemporaryDirectory(prefix=f"fastreduce-faults-{name}-") as tmp:
            try:
                if name == "checkpoint_restart":
                    figures = _restart_figures(cfg, _restart_job(cfg, Path(tmp)))
                else:
                    figures = _elastic_figures(cfg, _elastic_job(cfg, name, Path(tmp)))
            except Exception:  # noqa: BLE001 - one contender's failure is a row of the report
                figures = {"error": traceback.format_exc()[-4000:]}
        report["contenders"][name] = figures
    report["targets"] = judge(cfg, report["contenders"])
    report["config"]["wall_seconds"] = round(time.perf_counter() - t0, 1)
    return report


# ---------------------------------------------------------------- targets and the table

LOSS_STALL_S = {"fastreduce_gloo": 2.0, "fastreduce_shm": 0.5, SPARE: 2.0}
FULL_AGAIN_S = 0.5
"""Issue 62: with a warm spare, the world back at full size at most this long after the
survivors enter their next epoch."""
JOINER_S, JOIN_STALL_S, STEP_RATIO = 1.0, 0.5, 1.02


def judge(cfg: FaultsConfig, contenders: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Issue 49's targets on fastreduce's rows (report only)."""
    targets: dict[str, dict[str, Any]] = {}

    def add(name: str, value: Any, op: str, limit: Any, what: str) -> None:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return
        ok = value <= limit if op == "<=" else value < limit
        targets[name] = {"value": value, "limit": limit, "op": op, "pass": bool(ok), "what": what}

    for name, stall in LOSS_STALL_S.items():
        f = contenders.get(name, {})
        if "error" in f or "skipped" in f or not f:
            continue
        add(f"{name} loss stall", f["loss_stall_s"], "<=", stall, "survivors' stall at the loss (s)")
        add(f"{name} discarded", f["discarded_steps"], "<=", 1, "steps discarded at the loss")
        add(f"{name} joiner", f["joiner_first_commit_s"], "<=", JOINER_S,
            f"joiner's first commit after it starts joining (s, {cfg.params_m:g}M params)")
        add(f"{name} join stall", f["join_stall_s"], "<=", JOIN_STALL_S, "members' stall at the join (s)")
        if name == SPARE:
            add(f"{name} full again", f["full_again_s"], "<=", FULL_AGAIN_S,
                "world at full size again after the survivors' first step in their next epoch (s)")
        alone = "ZeroOptimizer(redundant=True)" if cfg.mode == "zero" else "FusedReducer"
        add(f"{name} step", f["no_failure"].get("ratio"), "<=", STEP_RATIO, f"no-failure step / {alone} alone")
        for anchor in ("torchft", "checkpoint_restart"):
            a = contenders.get(anchor, {})
            if a.get("wall_s") is not None:
                add(f"{name} wall vs {anchor}", f["wall_s"] / a["wall_s"], "<", 1.0,
                    f"wall time to {cfg.steps} committed steps / {anchor}'s")
    return targets


def _cell(value: Any, fmt: str = "{:.2f}") -> str:
    if value is None:
        return "-"
    return fmt.format(value) if isinstance(value, float) else str(value)


def format_text(report: dict[str, Any]) -> str:
    c = report["config"]
    lines = [f"faults suite: {c['members']} members, MLP of {report['model_params'] / 1e6:.2f}M params, AdamW, "
             f"batch {c['batch']}/rank, {c['steps']} committed steps; the last member lost mid-step at step "
             f"{c['kill_step']}, a replacement joins {c['join_after']} steps later; fastreduce "
             f"{c.get('mode', 'fused')}, wire {c['wire']}; "
             f"checkpoint every {c['checkpoint_every']} steps; no-failure cost: median of {c['rounds']} "
             f"rounds of blocks of {c['block']} steps without/with (mean over the ranks, slowest tenth left out)",
             "",
             f"{'contender':<20}{'step ms':>8}{'no-fail':>9}{'loss stall':>11}{'discarded':>10}"
             f"{'joiner 1st':>11}{'start+imp':>10}{'join stall':>11}{'wall s':>8}"]
    for name, f in report["contenders"].items():
        if "skipped" in f or "error" in f:
            lines.append(f"{name:<20}{'skipped: ' + f['skipped'] if 'skipped' in f else 'FAILED'}")
            continue
        ratio = f["no_failure"].get("ratio")
        lines.append(f"{name:<20}{f['median_step_s'] * 1e3:>8.1f}{_cell(ratio, '{:.3f}x'):>9}"
                     f"{_cell(f['loss_stall_s']):>11}{f['discarded_steps']:>10}{_cell(f['joiner_first_commit_s']):>11}"
                     f"{_cell(f['joiner_start_imports_s']):>10}{_cell(f['join_stall_s']):>11}{f['wall_s']:>8.1f}")
    lines += ["", "(seconds; loss stall: the end of the last committed step before the loss to the end of the "
              "first after it, less one median step; joiner 1st: from its start of joining (Membership/Manager "
              "made; checkpoint-restart: the relaunched process's start of init) to its first commit, its "
              "process start + imports apart; join stall: the members' excess step time while it joins; "
              "checkpoint-restart: no-fail is a save every checkpoint_every steps against none)"]
    for name, f in report["contenders"].items():
        if "membership_loss_stall_s" in f:
            lines.append(f"{name}: Membership's counters: loss {_cell(f['membership_loss_stall_s'])} s, join "
                         f"{_cell(f['membership_join_stall_s'])} s, the joiner's healing "
                         f"{_cell(f['membership_joined_s'])} s")
        if f.get("full_again_s") is not None:
            cold = (f["joiner_start_imports_s"] or 0) + (f["joiner_first_commit_s"] or 0)
            lines.append(f"{name}: at full size again {f['full_again_s']:.2f} s after the survivors' first step in "
                         f"their next epoch" + ("" if name == SPARE else
                                                f" (told to join {c['join_after']} steps after the loss; a cold "
                                                f"replacement, started and joining at the loss: {cold:.2f} s)"))
        if "lost_per_failure_s" in f:
            lines.append(f"{name}: {f['lost_per_failure_s']:.2f} s lost per failure (back at the step it was at), "
                         f"relaunch to first commit {f['relaunch_to_first_commit_s']:.2f} s, "
                         f"{f['discarded_steps']} steps computed again or discarded")
        if "error" in f:
            lines.append(f"{name} FAILED:\n{f['error']}")
    if c["quick"]:
        lines.append("(--quick: a tiny model and few steps prove the suite runs; the targets mean little)")
    if report["targets"]:
        from .report import target_lines
        lines += ["", "targets (report only):", *target_lines(report["targets"], width=30)]
    return "\n".join(lines)
