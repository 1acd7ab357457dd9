"""The HF Trainer and Lightning going on when a member dies and a replacement joins
(``fastreduce.Membership`` inside the trainers; the hand-written loop: ``keep_training.py``).

    python examples/keep_training_trainers.py --trainer hf          # 3 members; member 2 dies at step 10
    python examples/keep_training_trainers.py --trainer lightning --mode diloco

On one host this starts a coordinator (``fastreduce.membership.serve``), 3 member processes
and one replacement, each a plain process (not ``torchrun``) running the same training
script: a small MLP regression with AdamW, gradient clipping and a warm-up + cosine LR
schedule, through ``FastReduceTrainer(..., fastreduce_membership=m)`` or
``FastReduceStrategy(mode, membership=m)``. Member 2 dies (SIGKILL to itself) in the forward of step
``--kill-at``; the survivors discard that step and go on; the replacement, started at once
and told to join when member 2 is gone, is admitted and takes the whole state from a live
member. Each member prints its end: the step count, its parameters' digest (the same on all).

What each member does, on several hosts: ``fastreduce coordinator --port 29400`` on one
machine, then ``FASTREDUCE_COORDINATOR=thathost:29400 python train.py`` on each, where
``train.py`` does what :func:`hf_member` or :func:`lightning_member` does.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib
import os
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn

from keep_training import die, freeze, graphs  # this folder's: SIGKILL or SIGSTOP to itself; the graphs compiled

STEPS = 24
BATCH = 4
SAMPLES = 96
LR, WARMUP = 1e-2, 4
LOG_EVERY = 4
EVAL_EVERY = 8  # optimizer steps between evaluations (each member's own, on every sample)
HEARTBEAT = "0.25"
LOST_AFTER = "2"  # s: a member silent this long is lost, and the survivors wait this long for each other (a
#                  loaded 2-core machine runs 4 trainers: 1 s left a slow survivor out of the next epoch)
PAUSE = 0.1  # s per step: the replacement (started at once, imports done) arrives mid-run
PAUSE_MISSING = 0.5  # s per step while a member is missing and its replacement asks to join
PAUSE_WAITING = 2.0  # s per step while a member is missing and its replacement has not asked yet (a
#                    compiled trainer's set-up, Lightning's sanity check, on a loaded machine): it still
#                    arrives mid-run, and the members never stop stepping (it is admitted at their polls)
FROZEN_S = 6.0  # s a frozen member stays stopped: past the loss window (LOST_AFTER) and the others' next epoch
SLOWED_S = 0.6  # s more per forward of a slowed member: the straggler policy asks it to leave within seconds
ASKING = "replacement.asking"  # written by a replacement as its trainer is about to join (in ``out``)
NONE_COMING = "none.coming"  # written by launch where no member comes back (in ``out``): no longer pauses
MODES = ("fused", "overlap", "zero", "localsgd", "diloco", "gossip")
_HF_IMPORTS = ("transformers.trainer", "fastreduce.integrations.transformers")
PRELOAD = {"hf": _HF_IMPORTS, "gaudi": _HF_IMPORTS, "lightning": ("lightning.pytorch", "fastreduce.integrations.lightning")}
"""What a member imports before it waits (a replacement is ready to join at once): once, in the
fork server the members are forked from (:func:`launch`)."""
SETTINGS: dict[str, dict[str, Any]] = {
    "fused": {"wire_dtype": torch.float32}, "overlap": {"wire_dtype": torch.float32, "bucket_mb": 0.0005},
    "zero": {"bucket_mb": 0.0005},  # (redundant=True: set by the trainer under a Membership)
    "localsgd": {"sync_every": 4}, "diloco": {"sync_every": 4, "fragments": 2, "fragment_delay": 1},
    "gossip": {"topology": "ring", "bucket_mb": 0.0005},  # (its buckets' AdamW, built like the trainer's)
}


class Samples(torch.utils.data.Dataset):
    """``SAMPLES`` seeded (x, y) pairs, y = sin(sum x), each with its index (what a member
    trained: :class:`Draws`)."""

    def __init__(self, as_dict: bool):
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(SAMPLES, 8, generator=g)
        self.y = self.x.sum(1).sin()
        self.as_dict = as_dict

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> Any:
        return {"x": self.x[i], "y": self.y[i], "i": i} if self.as_dict else (self.x[i], self.y[i], i)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def schedule(optimizer: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    """Warm-up then cosine (``transformers.get_cosine_schedule_with_warmup``'s shape)."""
    import math

    def factor(s: int) -> float:
        if s < WARMUP:
            return (s + 1) / WARMUP
        return 0.5 * (1 + math.cos(math.pi * (s - WARMUP) / max(1, steps - WARMUP)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def expected_lrs(steps: int) -> list[float]:
    """The lr of each step 1..steps in a run without failures."""
    opt = torch.optim.AdamW(net().parameters(), lr=LR)
    sched = schedule(opt, steps)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def digest(params: torch.Tensor) -> str:
    return hashlib.sha256(params.numpy().tobytes()).hexdigest()[:12]


SAVE_EVERY = 2 * EVAL_EVERY  # committed steps between the job's own checkpoints (where a member is given ``saves``)


def _membership(port: int, saves: str = "", world: int = 3, evict: bool = False) -> Any:
    """``evict``: a member busy 1.5x the members' median for 1 s is asked to leave."""
    from fastreduce.membership import JobCheckpoints, Membership

    policy = {"evict_slower_than": 1.5, "evict_for_s": 1.0} if evict else {}
    return Membership(f"127.0.0.1:{port}", world_size=world, min_ranks=2, wait_s=60,
                      checkpoints=JobCheckpoints(saves, every=SAVE_EVERY) if saves else None, **policy)


def _pause(m: Any, world: int, out: str) -> None:
    """A step long enough for the replacement to arrive mid-run: longer while the job is short
    of the ``world`` members it started with, longest until the replacement asks to join (none
    of that where no member comes back: :data:`NONE_COMING`)."""
    missing = m.world < world and not (Path(out) / NONE_COMING).exists()
    time.sleep(PAUSE if not missing else PAUSE_MISSING if (Path(out) / ASKING).exists() else PAUSE_WAITING)


def _asking(out: str, go: Any) -> None:
    """A replacement (``go``: the event it waited for) about to ask to join: the members may
    go back to their pace (:func:`_pause`)."""
    if go is not None:
        (Path(out) / ASKING).touch()


def _die_at(module: nn.Module, index: int, kill: int | tuple[str, int] | None, step: Any,
            others: list[Path] = ()) -> None:
    """Member ``index`` dies in the forward of step ``kill`` (``step()``: the trainer's count)
    as the OS kills a process: SIGKILL to itself, no teardown (what ``kill -9`` does); ``kill``
    ``("frozen", k)``: stopped whole there for :data:`FROZEN_S` instead (SIGSTOP, then SIGCONT),
    once; ``("frozen-past-end", k)``: stopped until the files ``others`` (the other members'
    results) exist; ``("slowed", k)``: each forward from step ``k`` on :data:`SLOWED_S` longer
    (a straggler). (Left out of a compiled forward: traced, the step count would be a guard, a
    graph per step.)"""
    if kill is None:
        return
    if not isinstance(kill, tuple):
        at, act = kill, die
    elif kill[0] == "frozen-past-end":
        at, act = kill[1], lambda: freeze(120, others)
    elif kill[0] == "slowed":
        at, act = kill[1], lambda: time.sleep(SLOWED_S)
    else:
        at, act = kill[1], lambda: freeze(FROZEN_S)
    done: list[int] = []
    every = isinstance(kill, tuple) and kill[0] == "slowed"

    def hook(*_: Any) -> None:
        if (step() >= at) if every else (step() == at and not done):
            done.append(at)
            act()

    module.register_forward_pre_hook(torch.compiler.disable(hook))


class Draws:
    """What a member trained at each step it stepped, a discarded one too (``attempts``): the
    step, the data position, world and rank it drew its samples at, and those samples in the
    order drawn. A discarded step's samples are drawn again at the same step; a committed
    step's are never drawn again in that data epoch (tests/test_trainers_membership.py).
    ``glue()``: the trainer's ``TrainerMembership``."""

    def __init__(self, glue: Any) -> None:
        self.glue, self.attempts, self.drawn, self.at = glue, [], [], (0, 0, 0, 0)
        self.trained = torch.compiler.disable(self._trained)  # (left out of a compiled step, as _die_at)

    def _trained(self, samples: torch.Tensor) -> None:
        """A micro-batch's forward."""
        if not self.drawn:
            glue = self.glue()
            self.at = (glue.m.step + 1, glue.sampler.position, glue.m.world, glue.m.rank)
        self.drawn += samples.tolist()

    def stepped(self) -> None:
        """The trainer's optimizer step (before its commit)."""
        self.attempts.append((*self.at, self.drawn))
        self.drawn = []


# ====================================================================== Hugging Face


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = net()

    def forward(self, x: torch.Tensor, y: torch.Tensor, i: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        return {"loss": nn.functional.mse_loss(self.net(x).squeeze(-1), y)}


def hf_member(port: int, out: str, mode: str, index: int, kill: int | tuple[str, int] | None, steps: int,
              go: Any = None, resume: str | None = None, saves: str = "", world: int = 3,
              gaudi: bool = False, compiled: str = "", evict: bool = False) -> dict[str, Any]:
    """A member through ``FastReduceTrainer`` (``gaudi``: optimum-habana's ``GaudiTrainer``,
    ``FastReduceGaudiTrainer``, on its CPU path: ``use_habana=False``; ``compiled``: the
    ``torch_compile_backend`` of ``torch_compile=True``)."""
    from transformers import TrainerCallback, TrainingArguments

    from fastreduce.integrations.transformers import FastReduceTrainer

    made, arguments, extra = FastReduceTrainer, TrainingArguments, {}
    if gaudi:
        from optimum.habana import GaudiConfig, GaudiTrainingArguments

        from fastreduce.integrations.optimum_habana import FastReduceGaudiTrainer

        made, extra = FastReduceGaudiTrainer, {"gaudi_config": GaudiConfig()}
        arguments = functools.partial(GaudiTrainingArguments, use_habana=False, use_lazy_mode=False, adam_epsilon=1e-8)
    model = Regressor()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    args = arguments(output_dir=str(Path(out) / f"hf{index}"), max_steps=steps,
                             per_device_train_batch_size=BATCH, gradient_accumulation_steps=2,
                             eval_strategy="steps", eval_steps=EVAL_EVERY, per_device_eval_batch_size=16,
                             label_names=["y"], prediction_loss_only=True, max_grad_norm=1.0, logging_steps=LOG_EVERY,
                             save_strategy="steps" if resume == "save" else "no", save_steps=EVAL_EVERY,
                             report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
                             **({"torch_compile": True, "torch_compile_backend": compiled} if compiled else {}))
    lrs: list[tuple[int, float]] = []  # (step, its lr), discarded ones too
    draws = Draws(lambda: trainer.fastreduce_membership)
    model.register_forward_pre_hook(torch.compiler.disable(lambda module, _, kw: draws.trained(kw["i"])
                                                           if module.training else None), with_kwargs=True)

    class Record(TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            lrs.append((trainer.fastreduce_membership.m.step + 1, opt.param_groups[0]["lr"]))  # the step's lr
            draws.stepped()
            _pause(trainer.fastreduce_membership.m, world, out)

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            _asking(out, go)  # (before or after the trainer's own join: either way at or after its set-up)

    trainer = made(model=model, args=args, train_dataset=Samples(as_dict=True), eval_dataset=Samples(as_dict=True),
                   optimizers=(opt, schedule(opt, steps)), callbacks=[Record()], fastreduce_mode=mode,
                   fastreduce_config=SETTINGS[mode], fastreduce_membership=_membership(port, saves, world, evict), **extra)
    _die_at(model.net, index, kill, lambda: trainer.state.global_step, _others(out, index, world))
    if go is not None:  # a replacement: everything built, join when told
        go.wait(120)
    trainer.train(resume_from_checkpoint=resume if resume not in (None, "save") else None)
    glue = trainer.fastreduce_membership
    logs = [e for e in trainer.state.log_history if "loss" in e]
    evals = [e for e in trainer.state.log_history if "eval_loss" in e]
    return {"global_step": trainer.state.global_step, "lrs": lrs, "logs": logs, "evals": evals,
            "joined_at": glue.joined_at, "graphs": graphs(), "draws": draws.attempts,
            "position": glue.sampler.position, "seed": glue.sampler.seed,
            "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
            "counters": vars(glue.m.counters), "world": glue.m.world, "epoch": glue.m.epoch.number, "m": glue.m,
            "mode_class": type(glue.m.mode).__name__, "redundant": getattr(glue.m.mode, "redundant", None),
            "left": glue.m.left}


def _others(out: str, index: int, world: int) -> list[Path]:
    """The results the other first members save as they end (``frozen-past-end`` waits for them)."""
    return [Path(out) / f"member{i}.pt" for i in range(world) if i != index]


# ====================================================================== Lightning


def lightning_member(port: int, out: str, mode: str, index: int, kill: int | tuple[str, int] | None, steps: int,
                     go: Any = None, saves: str = "", world: int = 3, compiled: str = "",
                     evict: bool = False) -> dict[str, Any]:
    """A member through ``FastReduceStrategy`` (``compiled``: ``trainer.fit(torch.compile(module,
    backend=compiled))``, as Lightning's users compile)."""
    import lightning.pytorch as pl

    from fastreduce.integrations.lightning import FastReduceStrategy

    lrs: list[tuple[int, float]] = []  # (step, its lr), discarded ones too
    draws = Draws(lambda: strategy.membership)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y, i = batch
            draws.trained(i)
            return nn.functional.mse_loss(self(x).squeeze(-1), y)  # (through forward: what a compiled module compiles)

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            # (logged here, not in training_step: a compiled module's training_step is traced, and
            # self.log there fails in dynamo with or without fastreduce: lightning 2.6, torch 2.13)
            self.log("loss", outputs["loss"])

        def validation_step(self, batch: Any, batch_idx: int) -> None:  # each member's own, on every sample
            x, y, _ = batch
            self.log("val_loss", nn.functional.mse_loss(self.net(x).squeeze(-1), y), sync_dist=True)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=LR)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule(opt, steps), "interval": "step"}}

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            lrs.append((self.trainer.strategy.membership.m.step + 1, optimizer.param_groups[0]["lr"]))
            draws.stepped()
            _pause(self.trainer.strategy.membership.m, world, out)

        def on_train_start(self) -> None:  # (the strategy's, which joins, comes next: Lightning's fit loop)
            _asking(out, go)

    module = Module()
    strategy = FastReduceStrategy(mode, membership=_membership(port, saves, world, evict), **SETTINGS[mode])
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, strategy=strategy, accumulate_grad_batches=2,
                         gradient_clip_val=1.0, log_every_n_steps=LOG_EVERY, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=1,
                         check_val_every_n_epoch=None, val_check_interval=2 * EVAL_EVERY)  # in batches
    _die_at(module.net, index, kill, lambda: trainer.global_step, _others(out, index, world))
    if go is not None:
        go.wait(120)
    fitted = torch.compile(module, backend=compiled) if compiled else module
    trainer.fit(fitted, torch.utils.data.DataLoader(Samples(as_dict=False), batch_size=BATCH, shuffle=True),
                torch.utils.data.DataLoader(Samples(as_dict=False), batch_size=16))
    glue = strategy.membership
    logged = {k: float(v) for k, v in trainer.logged_metrics.items()}
    return {"global_step": trainer.global_step, "lrs": lrs, "logged": logged, "draws": draws.attempts,
            "position": glue.sampler.position, "seed": glue.sampler.seed, "joined_at": glue.joined_at,
            "params": torch.cat([p.detach().reshape(-1) for p in module.parameters()]), "graphs": graphs(),
            "counters": vars(glue.m.counters), "world": glue.m.world, "epoch": glue.m.epoch.number, "m": glue.m,
            "mode_class": type(glue.m.mode).__name__, "redundant": getattr(glue.m.mode, "redundant", None),
            "left": glue.m.left}


# ====================================================================== the job on one host

def gaudi_on_cpu() -> None:
    """optimum-habana on its CPU path (``use_habana=False``; these members and
    tests/test_gaudi_trainer.py's ranks): its ``pip`` found beside this interpreter, as in an
    activated venv (``import optimum.habana`` asks it for Habana's plugin's version), and no
    HPU asked for memory figures (``GaudiTrainer.log`` adds them to every log, importing
    habana_frameworks: optimum-habana 1.21, transformers/trainer.py; that module's function
    replaced, in a test harness only: no HPU is here to answer it)."""
    import sys

    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    import optimum.habana.transformers.trainer as gaudi_trainer_module

    gaudi_trainer_module.get_hpu_memory_stats = lambda device=None: {}


def member(trainer: str, index: int, port: int, out: str, mode: str, kill: int | tuple[str, int] | None, go: Any,
           steps: int, transport: str = "process_group", resume: str | None = None, saves: str = "", world: int = 3,
           compiled: str = "", evict: bool = False) -> None:
    """One process: train (``go``: an event to wait for before training, for a replacement),
    save what it saw to ``out/member<index>.pt``. ``resume`` (the HF Trainer): ``"save"``, a
    checkpoint every ``EVAL_EVERY`` steps; a checkpoint folder: the job resumed from it.
    ``saves``: a directory where the job saves itself every :data:`SAVE_EVERY` committed steps
    (:class:`fastreduce.JobCheckpoints`), and which a new job resumes from; ``world``: the members the
    job starts with; ``compiled``: a ``torch.compile`` backend the trainer compiles the model with;
    ``evict``: the straggler policy on (:func:`_membership`)."""
    os.environ.update(FASTREDUCE_HEARTBEAT_S=HEARTBEAT, FASTREDUCE_LOST_AFTER_S=LOST_AFTER,
                      FASTREDUCE_TRANSPORT=transport, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    torch.set_num_threads(1)
    facts: dict[str, Any] = {"index": index}
    try:
        for name in PRELOAD[trainer]:  # (already there where the fork server imported them)
            importlib.import_module(name)
        if trainer == "gaudi":
            gaudi_on_cpu()
        if trainer in ("hf", "gaudi"):
            facts.update(hf_member(port, out, mode, index, kill, steps, go, resume, saves, world, trainer == "gaudi",
                                   compiled, evict))
        else:
            facts.update(lightning_member(port, out, mode, index, kill, steps, go, saves, world, compiled, evict))
        facts.pop("m").close()
    except BaseException:  # noqa: BLE001 - reported by the launcher
        facts["error"] = traceback.format_exc()
    torch.save(facts, Path(out) / f"member{index}.pt")


def launch(trainer: str, out: Path, mode: str = "fused", kill_at: int | None = 10, steps: int = STEPS,
           timeout: float = 180, transport: str = "process_group", resume: str | None = None,
           saves: str = "", members: int = 3, compiled: str = "", frozen: bool | str = False,
           slowed: bool = False) -> dict[int, dict]:
    """A coordinator, ``members`` members (member 2 dies in the forward of step ``kill_at``;
    ``None``: none does) and, where one dies, a replacement told to join once it is gone;
    returns what each member saved. ``frozen``: member 2 is stopped whole there instead
    (:func:`_die_at`; ``"past-end"``: until the others have ended), and no replacement is
    started; ``slowed``: member 2 is slowed from there on, every member runs the straggler
    policy, and no replacement is started. ``resume``, ``saves``, ``compiled``: :func:`member`'s.

    The members are forked from this process's fork server (:func:`fastreduce.launch.rank_context`),
    which imports the trainer's libraries once (:data:`PRELOAD`) where it starts here: on 2
    cores, four members each importing them took three times as long."""
    from fastreduce.launch import rank_context
    from fastreduce.membership import serve

    server = serve(0, "127.0.0.1")
    ctx = rank_context("keep_training_trainers", *PRELOAD[trainer])
    go = ctx.Event()
    kill = ("frozen-past-end" if frozen == "past-end" else "frozen", kill_at) if frozen and kill_at is not None \
        else ("slowed", kill_at) if slowed else kill_at
    if frozen == "past-end" or slowed:
        (out / NONE_COMING).touch()
    frozen = frozen or slowed  # (no replacement)
    procs = {i: ctx.Process(target=member, args=(trainer, i, server.port, str(out), mode, kill if i == 2 else None,
                                                 None, steps, transport, resume, saves, members, compiled, slowed))
             for i in range(members)}
    if kill_at is not None and not frozen:
        procs[members] = ctx.Process(target=member, args=(trainer, members, server.port, str(out), mode, None, go,
                                                          steps, transport, None, saves, members, compiled))
    for p in procs.values():
        p.start()
    try:
        if kill_at is not None and not frozen:
            procs[2].join(timeout)
            go.set()
        for p in procs.values():
            p.join(timeout)
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
    return {i: torch.load(path, weights_only=False) for i in range(members + 1)
            if (path := out / f"member{i}.pt").exists()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trainer", choices=("hf", "lightning"), default="hf")
    ap.add_argument("--mode", choices=MODES, default="fused")
    ap.add_argument("--kill-at", type=int, default=10)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as out:
        found = launch(args.trainer, Path(out), args.mode, args.kill_at)
    for i, f in sorted(found.items()):
        if "error" in f:
            raise SystemExit(f"member {i} failed:\n{f['error']}")
        print(f"member {i}: step {f['global_step']}, world {f['world']}, epoch {f['epoch']}, joined at step "
              f"{f['joined_at']}, {f['counters']['discarded_steps']} step(s) discarded, "
              f"parameters {digest(f['params'])}")


if __name__ == "__main__":
    main()
