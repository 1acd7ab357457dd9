"""Every fastreduce mode inside Lightning (``FastReduceStrategy(mode=...)``), on real processes:
``torchrun --standalone --nproc-per-node 2``, Gloo on CPU.

One torchrun launch (this file's ``__main__`` part) trains, per mode, on the same batches
(Lightning's DistributedSampler over an unshuffled loader; one epoch is 10 optimizer steps):

- Lightning: 20 optimizer steps of ``accumulate_grad_batches=2``, AdamW with two param
  groups (weight decay on the weights only), ``gradient_clip_val`` below every step's norm,
  a cosine schedule with warm-up stepped per optimizer step, a ``ModelCheckpoint`` at the
  end of each epoch, a ``CSVLogger`` with ``log_every_n_steps=5``;
- the same mode in a hand-written loop (its own class, the same optimizer, groups,
  schedule, clipping and accumulation): the reference, equal to 1e-6;
- Lightning resumed from its step-10 checkpoint (``fit(ckpt_path=...)``, a new Trainer,
  strategy and mode) to step 20: bit for bit the run that never stopped;
- ``fit(torch.compile(module, backend="aot_eager"))`` in the modes tests/test_lightning.py
  does not compile (ZeRO, LocalSGD, DiLoCo, gossip): equal to the eager fit, 1e-6.

A second launch, on 3 ranks, resumes the fused, overlapped and ZeRO checkpoints saved on 2.

Skipped without the ``lightning`` extra.
"""

from __future__ import annotations

import contextlib
import csv
import math
import os
import sys
from pathlib import Path

import pytest
import torch
from launching import leave, load_runs, torchrun
from models import TRAINER_MODES

STEPS, SAVE, ACCUM, BATCH = 20, 10, 2, 4
LR, WD, CLIP, WARMUP = 1e-2, 0.1, 0.05, 4
MODES = TRAINER_MODES  # name: settings of the strategy and of the reference loop's mode
FIGURES = ("fastreduce/bytes_per_step", "fastreduce/wait_seconds_per_step", "fastreduce/comm_share")  # every mode's
COUNT = {"fused": "fastreduce/reductions", "overlap": "fastreduce/reductions", "zero": "fastreduce/buckets",
         "localsgd": "fastreduce/syncs", "diloco": "fastreduce/syncs", "gossip": "fastreduce/rounds"}
OPTIMIZER = {"zero": "ZeroOptimizer", "gossip": "_Steered"}  # what Lightning steps, where not the AdamW
COMPILED = ["zero", "localsgd", "diloco", "gossip"]  # (fused and overlap: tests/test_lightning.py)
RESHARDED = ("fused", "overlap", "zero")  # their state loads onto any world size
pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------------- in-process checks

def test_modes_by_name_and_their_settings_checked_at_construction() -> None:
    pytest.importorskip("lightning")
    from lightning.pytorch.strategies import StrategyRegistry

    from fastreduce.integrations.lightning import FastReduceStrategy

    for name in ("zero", "localsgd", "diloco", "overlap", "gossip"):
        entry = StrategyRegistry[f"fastreduce_{name}"]
        assert entry["strategy"] is FastReduceStrategy and entry["init_params"] == {"mode": name}
    assert StrategyRegistry["fastreduce"]["init_params"] == {}
    s = FastReduceStrategy("localsgd", sync_every=8, process_group_backend="gloo")
    assert s.mode.name == "localsgd" and s.mode.config == {"sync_every": 8} and s.reducer_config is None
    assert s.process_group_backend == "gloo" and s.mode.obj is None
    assert FastReduceStrategy(overlap=True).mode.name == "overlap"  # today's default: overlap=True
    assert FastReduceStrategy("zero", overlap=False).mode.config == {"overlap": False}  # ZeRO's own overlap
    with pytest.raises(ValueError, match="unknown fastreduce mode 'zeros'"):
        FastReduceStrategy("zeros")
    with pytest.raises(TypeError, match="'zero' .* does not take the setting 'sync_every'"):
        FastReduceStrategy("zero", sync_every=4)
    with pytest.raises(TypeError, match="unexpected"):
        FastReduceStrategy("zero", sync_evry=4)
    with pytest.raises(ValueError, match="find_unused_parameters"):
        FastReduceStrategy("localsgd", sync_every=4, find_unused_parameters=True)
    with pytest.raises(TypeError, match="outer_optimizer"):
        FastReduceStrategy("diloco", sync_every=4, outer_optimizer=3)
    assert FastReduceStrategy("gossip", eval_params="own").mode.eval_params == "own"
    with pytest.raises(ValueError, match="mode 'overlap' keeps the same parameters on every rank"):
        FastReduceStrategy("overlap", eval_params="own")


# ---------------------------------------------------------------------- on real ranks


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """``{run: [per-rank facts]}`` of the 2-rank launch."""
    pytest.importorskip("lightning")
    out = tmp_path_factory.mktemp("lightning_modes")
    torchrun(__file__, 2, "train", str(out), timeout=300)
    torchrun(__file__, 3, "reshard", str(out), timeout=200)
    return load_runs(out)


def _close(a: torch.Tensor, b: torch.Tensor, atol: float) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=atol)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.cell("lightning", "train")
def test_lightning_equals_the_hand_written_loop(runs: dict, mode: str) -> None:
    """Lightning in each mode ends where the mode's own loop ends, on every rank (1e-6):
    accumulation 2, clipping on every step, cosine schedule with warm-up, AdamW groups."""
    for ours, ref in zip(runs[f"{mode}_lightning"], runs[f"{mode}_loop"]):
        assert ours["global_step"] == STEPS
        assert float((ref["params"] - ref["start"]).norm()) > 10 * LR * CLIP, "training did not move the parameters"
        assert min(ref["grad_norms"]) > 2 * CLIP, ref["grad_norms"]  # every step clipped
        _close(ours["params"], ref["params"], 1e-6)
        assert ours["lrs"] == pytest.approx(ref["lrs"], rel=1e-9), (ours["lrs"], ref["lrs"])
        assert ours["lrs"][0] < ours["lrs"][WARMUP] and ours["lrs"][-1] < ours["lrs"][WARMUP]  # warm-up, decay
        assert ours["optimizer"] == OPTIMIZER.get(mode, "AdamW")
        if mode not in ("zero", "gossip"):  # the gradients Lightning clips (before clipping) are the loop's
            assert ours["norms"] == pytest.approx(ref["grad_norms"], rel=1e-5)
        assert ours["scheduler_drives_it"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.cell("lightning", "resume")
def test_resume_from_the_lightning_checkpoint_equals_the_uninterrupted_run(runs: dict, mode: str) -> None:
    """Saved at step 10 by ``ModelCheckpoint`` (the mode's state in ``<ckpt>.fastreduce``),
    resumed by a new Trainer with ``fit(ckpt_path=...)``: at step 20 bit for bit the run that never stopped
    (the fused mode through a link to the checkpoint, as ``save_last="link"`` makes ``last.ckpt``)."""
    for ours, ref in zip(runs[f"{mode}_resumed"], runs[f"{mode}_lightning"]):
        assert ours["global_step"] == STEPS and ours["lrs"] == ref["lrs"][SAVE:]
        assert torch.equal(ours["params"], ref["params"]), float((ours["params"] - ref["params"]).abs().max())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", COMPILED)
@pytest.mark.cell("lightning", "compile")
def test_the_compiled_module_fits_where_the_eager_one_does(runs: dict, mode: str) -> None:
    """``Trainer.fit(torch.compile(module, backend="aot_eager"))``: Lightning unwrapped it and
    trained it compiled (graphs captured), ending where the eager fit ends, to 1e-6."""
    for ours, ref in zip(runs[f"{mode}_compiled"], runs[f"{mode}_lightning"]):
        assert ours["compiled"] and ours["graphs"] > 0 and ours["global_step"] == STEPS
        _close(ours["params"], ref["params"], 1e-6)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", RESHARDED)
@pytest.mark.cell("lightning", "reshard")
def test_a_lightning_checkpoint_resumes_on_three_ranks(runs: dict, mode: str) -> None:
    """Saved on 2 ranks at step 10, ``fit(ckpt_path=...)`` on 3: the parameters when training
    starts again are those saved (ZeRO's shards gathered and cut again), and it trains on."""
    saved = runs[f"{mode}_lightning"][0]["at_save"]
    for rank in runs[f"{mode}_reshard"]:
        assert rank["world"] == 3 and rank["global_step"] == SAVE + 1
        _close(rank["at_start"], saved, 1e-6)
        assert not torch.equal(rank["params"], rank["at_start"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["fused", "overlap", "zero"])
def test_ranks_identical_where_the_mode_keeps_them_so(runs: dict, mode: str) -> None:
    ranks = runs[f"{mode}_lightning"]
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["localsgd", "diloco", "gossip"])
def test_per_rank_modes_checkpoint_the_mean(runs: dict, mode: str) -> None:
    """Between syncs the ranks hold their own parameters; the Lightning checkpoint's
    ``state_dict`` is their exact mean, and training goes on from each rank's own."""
    ranks = runs[f"{mode}_lightning"]
    assert not torch.equal(ranks[0]["at_save"], ranks[1]["at_save"]), "the ranks held the same parameters at save"
    mean = (ranks[0]["at_save"].double() + ranks[1]["at_save"].double()).div(2).float()
    _close(ranks[0]["checkpoint_state"], mean, 1e-7)


def figures_are_the_stats(rows: list[dict], at: list[tuple[int, int, float]]) -> None:
    """Each row's ``fastreduce/bytes_per_step`` and ``wait_seconds_per_step`` are the mode's
    ``stats`` (``at``: ``(step, bytes, seconds waited)`` when training began and at each log)
    at that log less at the one before, over the steps between, as Lightning logs a float (in
    float32); ``comm_share`` is a share. Every mode moves bytes and waits in every window."""
    def logged(v: float) -> float:
        return float(torch.tensor(v, dtype=torch.float32))

    assert len(rows) == len(at) - 1 > 0, (rows, at)
    for row, (s0, b0, w0), (s1, b1, w1) in zip(rows, at, at[1:]):
        assert float(row["fastreduce/bytes_per_step"]) == logged((b1 - b0) / (s1 - s0)) > 0, (row, at)
        assert float(row["fastreduce/wait_seconds_per_step"]) == logged((w1 - w0) / (s1 - s0)) > 0, (row, at)
        assert 0 < float(row["fastreduce/comm_share"]) < 1, row


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", list(MODES))
def test_the_logged_metrics_hold_the_mode_figures(runs: dict, mode: str) -> None:
    """Every ``log_every_n_steps`` (5) the mode's figures go to the logger: the CSV rows at steps
    5, 10, 15, 20, ``trainer.logged_metrics`` and ``callback_metrics`` hold them, under the same
    keys in every mode, each what the mode's own ``stats`` say at that step (as Lightning logs
    a float: in float32)."""
    rank = runs[f"{mode}_lightning"][0]
    for key in (*FIGURES, COUNT[mode]):
        assert key in rank["logged_metrics"] and key in rank["callback_metrics"], key
    rows = [r for r in rank["csv"] if r.get(FIGURES[0]) not in (None, "")]
    assert [int(r["step"]) for r in rows] == [4, 9, 14, 19], rows  # Lightning's step: batches stepped before
    assert all(r.get(COUNT[mode]) not in (None, "") for r in rows), rows
    figures_are_the_stats(rows, rank["wire_at_logs"])
    if mode in ("fused", "overlap"):
        assert float(rows[-1]["fastreduce/reductions"]) == STEPS == rank["counters"]["reductions"]
    if mode in ("localsgd", "diloco"):
        assert float(rows[-1]["fastreduce/syncs"]) == rank["counters"]["syncs"] > 0
    if mode == "gossip":  # one round a step, the last one's logged after it
        assert float(rows[-1]["fastreduce/rounds"]) == rank["counters"]["rounds"] == STEPS


SNIPPETS = ["zero", "overlap", "gossip", "localsgd", "diloco"]  # docs/trainers.md's order


@pytest.mark.timeout(60)
def test_the_trainers_page_has_a_lightning_block_per_mode() -> None:
    """docs/trainers.md shows each mode's Lightning block, assuming only a user's names."""
    from mode_snippets import mode_blocks

    assert list(mode_blocks("lightning")) == SNIPPETS


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", SNIPPETS)
def test_the_trainers_page_lightning_blocks_run(runs: dict, mode: str) -> None:
    """Each mode's Lightning block, run verbatim on 2 ranks (ranks starting from different
    weights): Lightning fits an epoch in that mode, one optimizer step a batch, and training
    moves rank 0's start; the ranks' parameters are the same where the mode keeps them so."""
    for rank in runs[f"snippet_lightning_{mode}"]:
        assert rank["strategy"] == "FastReduceStrategy" and rank["mode"] == mode, rank
        assert rank["global_step"] == rank["batches"] > 0, rank
        assert rank["started_different"] and rank["moved_from_rank0_start"], rank
        if mode in ("zero", "overlap"):
            assert rank["params_identical_across_ranks"], rank


# ============================================================== the torchrun worker

def _schedule(step: int) -> float:
    """Linear warm-up over WARMUP steps, then cosine to 0 at STEPS (transformers' cosine)."""
    if step < WARMUP:
        return step / max(1, WARMUP)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * (step - WARMUP) / max(1, STEPS - WARMUP))))


def _worker(out: Path, what: str) -> None:  # noqa: C901 (one script: the runs in order)
    import logging
    import warnings

    import torch._dynamo.utils
    import torch.distributed as dist
    from lightning.pytorch import Callback, LightningModule, Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger
    from torch import nn
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from fastreduce import DecentralizedDataParallel, DiLoCo, FusedReducer, LocalSGD, ZeroOptimizer
    from fastreduce.integrations.lightning import FastReduceStrategy

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    g = torch.Generator().manual_seed(1)
    n = SAVE * ACCUM * BATCH * world  # one epoch: SAVE optimizer steps per rank
    x = torch.randn(n, 8, generator=g)
    y = torch.sin(x.sum(1)) + 0.1 * torch.randn(n, generator=g)
    data = TensorDataset(x, y)

    def groups(model: nn.Module) -> list[dict]:
        decay = [p for p in model.parameters() if p.dim() >= 2]
        return [{"params": decay, "weight_decay": WD},
                {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]

    def wire(obj) -> tuple[int, float]:
        """The mode object's ``stats``: bytes handed to its collectives, seconds waited on them."""
        st = obj.stats
        return (st.bytes_reduced if isinstance(obj, FusedReducer) else st.wire_bytes), st.wait_seconds

    class Net(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.wire_at_logs: list[tuple] = []  # (step, *wire(mode object)) at the start, then at each log
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                                     nn.Linear(16, 1))

        def loss(self, batch) -> torch.Tensor:
            xb, yb = batch
            return nn.functional.mse_loss(self.net(xb).squeeze(-1), yb)

        def forward(self, batch) -> torch.Tensor:  # the hand-written gossip loop calls the mode's wrapper
            return self.loss(batch)

        def training_step(self, batch, batch_idx):
            return self(batch)  # (through forward: what a compiled module compiles)

        def on_train_start(self) -> None:  # the mode is built by now
            self.wire_at_logs.append((self.trainer.global_step, *wire(self.trainer.strategy.mode.obj)))

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:  # after every callback's: the figures'
            step = self.trainer.global_step
            if step % 5 == 0 and step > self.wire_at_logs[-1][0]:
                self.wire_at_logs.append((step, *wire(self.trainer.strategy.mode.obj)))

        def configure_optimizers(self):
            opt = torch.optim.AdamW(groups(self), lr=LR)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def flat(model: nn.Module) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()

    def settle(obj) -> None:  # ZeRO: the last step's all-gather, before reading the parameters outside forward
        if isinstance(obj, ZeroOptimizer):
            obj.wait_params()

    class Record(Callback):
        def __init__(self) -> None:
            self.lrs, self.facts, self.norms = [], {}, []

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])
            # ZeRO's averaged gradients are its shards; gossip's were stepped (and zeroed) in backward
            if not isinstance(trainer.strategy.mode.obj, (ZeroOptimizer, DecentralizedDataParallel)):
                self.norms.append(float(torch.cat([p.grad.reshape(-1) for p in pl_module.parameters()]).norm()))

        def on_train_start(self, trainer, pl_module):  # (after a checkpoint's restore)
            settle(trainer.strategy.mode.obj)
            self.facts["at_start"] = flat(pl_module)
            self.facts["compiled"] = pl_module._compiler_ctx is not None  # Lightning unwrapped a compiled module

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == SAVE and "at_save" not in self.facts:
                settle(trainer.strategy.mode.obj)
                self.facts["at_save"] = flat(pl_module)

    def save(run: str, facts: dict) -> None:
        torch.save(facts, out / f"{run}.rank{rank}.pt")

    def lightning_run(run: str, mode: str, config: dict, resume: bool = False, compiled: bool = False,
                      steps: int = STEPS) -> None:
        model, rec = Net(), Record()
        ckpt = out / f"{mode}_lightning" / f"step={SAVE}.ckpt"
        if resume and mode == "fused":  # through a link, as ModelCheckpoint(save_last="link") makes last.ckpt
            with contextlib.suppress(FileExistsError):  # (every rank makes it: the first one's stands)
                os.symlink(ckpt.name, ckpt.with_name("last.ckpt"))
            ckpt = ckpt.with_name("last.ckpt")
        torch._dynamo.reset()  # (each compiled run counts its own graphs)
        trainer = Trainer(
            accelerator="cpu", devices=world, num_nodes=1, max_steps=steps, accumulate_grad_batches=ACCUM,
            strategy=FastReduceStrategy(mode, process_group_backend="gloo", **config),
            gradient_clip_val=CLIP, log_every_n_steps=5, logger=CSVLogger(out / run, name="logs"),
            callbacks=[rec, ModelCheckpoint(dirpath=out / run, filename="{step}", every_n_train_steps=SAVE,
                                            save_top_k=-1)],
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
        trainer.fit(torch.compile(model, backend="aot_eager") if compiled else model,
                    DataLoader(data, batch_size=BATCH, shuffle=False), ckpt_path=str(ckpt) if resume else None)
        strategy = trainer.strategy
        obj = strategy.mode.obj
        settle(obj)
        opt = trainer.optimizers[0]
        facts = {"params": flat(model), "lrs": rec.lrs, "norms": rec.norms, "global_step": trainer.global_step, **rec.facts,
                 "world": world, "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
                 "optimizer": type(opt).__name__,
                 "scheduler_drives_it": all(c.scheduler.optimizer is opt for c in strategy.lr_scheduler_configs),
                 "logged_metrics": {k: float(v) for k, v in trainer.logged_metrics.items()},
                 "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
                 "wire_at_logs": model.wire_at_logs,
                 "counters": ({"reductions": obj.stats.calls} if isinstance(obj, FusedReducer) else
                              {"syncs": obj.syncs} if isinstance(obj, (LocalSGD, DiLoCo)) else
                              {"rounds": obj.step} if isinstance(obj, DecentralizedDataParallel) else {})}
        dist.barrier()
        if rank == 0 and steps == STEPS:  # (one step on after a checkpoint logs nothing)
            with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
                facts["csv"] = list(csv.DictReader(f))
            if not resume and not compiled and steps == STEPS:
                state = torch.load(ckpt, weights_only=False)["state_dict"]
                facts["checkpoint_state"] = torch.cat([state[k].reshape(-1) for k, _ in model.named_parameters()])
        save(run, facts)

    def loop_run(run: str, mode: str, config: dict) -> None:
        """The mode in a hand-written loop: what Lightning does, written out."""
        model = Net()
        start = flat(model)
        sampler = DistributedSampler(data, world, rank, shuffle=True, seed=0)  # Lightning's, for training
        loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
        reducer = None
        if mode == "zero":
            opt = ZeroOptimizer(groups(model), torch.optim.AdamW, lr=LR, module=model, **config)
        else:
            opt = torch.optim.AdamW(groups(model), lr=LR)
        if mode in ("fused", "overlap"):
            reducer = FusedReducer(model, overlap=mode == "overlap", **config)
        elif mode == "localsgd":
            LocalSGD(model, opt, **config)
        elif mode == "diloco":
            outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
            DiLoCo(model, opt, outer, **config)
        net = model
        if mode == "gossip":  # one AdamW per bucket, with its own schedule, stepped and clipped in backward
            def optim_fn(named):
                params = [p for _, p in named]
                return torch.optim.AdamW([g for g in ({"params": [p for p in params if p.dim() >= 2], "weight_decay": WD},
                                                      {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0})
                                          if g["params"]], lr=LR)

            net = DecentralizedDataParallel(model, optim_fn, lambda o: torch.optim.lr_scheduler.LambdaLR(o, _schedule),
                                            grad_clip_norm=CLIP, **config)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule)
        lrs, norms = [], []
        for epoch in range(STEPS // SAVE):
            sampler.set_epoch(epoch)
            batches = iter(loader)
            for _ in range(SAVE):
                for micro in range(ACCUM):
                    quiet = micro < ACCUM - 1 and mode in ("fused", "overlap", "zero", "gossip")
                    with (reducer or (net if mode == "gossip" else opt)).no_sync() if quiet else torch.enable_grad():
                        (net(next(batches)) / ACCUM).backward()
                if reducer is not None:
                    reducer.reduce()
                if mode == "gossip":  # stepped in backward; opt only keeps the schedule's lr for the record
                    norms.append(float(torch.stack(net.grad_norms).square().sum().sqrt()))
                elif mode == "zero":
                    norms.append(float(opt.clip_grad_norm_(CLIP)))
                else:
                    params = [p for g in opt.param_groups for p in g["params"]]  # Lightning's order: the optimizer's
                    norms.append(float(torch.nn.utils.clip_grad_norm_(params, CLIP)))
                lrs.append(opt.param_groups[0]["lr"])
                if mode != "gossip":
                    opt.step()
                sched.step()
                opt.zero_grad()
        settle(opt)
        save(run, {"start": start, "params": flat(model), "lrs": lrs, "grad_norms": norms})

    def snippet_runs() -> None:
        """docs/trainers.md's Lightning block of each mode, verbatim."""
        from mode_snippets import mode_blocks, run_block, users_script
        from test_readme import common_facts, prelude_lightning

        with users_script(out / "snippets"):
            for mode, (first, text) in mode_blocks("lightning").items():
                names, ctx = prelude_lightning()
                trainer = run_block(first, text, names)["trainer"]
                save(f"snippet_lightning_{mode}", {
                    **common_facts(names["model"], ctx["start"]), "strategy": type(trainer.strategy).__name__,
                    "mode": trainer.strategy.mode.name, "global_step": trainer.global_step,
                    "batches": names["model"].batches})

    if what == "reshard":  # 3 ranks: the 2-rank checkpoints whose state loads onto any world size, one step on
        for mode in RESHARDED:
            lightning_run(f"{mode}_reshard", mode, MODES[mode], resume=True, steps=SAVE + 1)
        leave()
        return
    for mode, config in MODES.items():
        lightning_run(f"{mode}_lightning", mode, config)
        lightning_run(f"{mode}_resumed", mode, config, resume=True)
        loop_run(f"{mode}_loop", mode, config)
    snippet_runs()
    for mode in COMPILED:  # (last: nothing of a compiled run's state reaches the runs above)
        lightning_run(f"{mode}_compiled", mode, MODES[mode], compiled=True)
    leave()


if __name__ == "__main__":
    _worker(Path(sys.argv[2]), sys.argv[1])
