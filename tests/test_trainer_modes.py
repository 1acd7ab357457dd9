"""Every fastreduce mode inside the Hugging Face ``Trainer`` (``FastReduceTrainer(fastreduce_mode=...)``),
on real processes: ``torchrun --standalone --nproc-per-node 2``, Gloo on CPU.

One torchrun launch (this file's ``__main__`` part) trains, per mode, on the same batches
(a sequential sampler, so the reference loop can take the Trainer's own data loader):

- the Trainer: 20 optimizer steps of ``gradient_accumulation_steps=2``, AdamW with weight
  decay (the Trainer's two param groups), clipping at a norm below every step's, a
  cosine schedule with warm-up, saving a checkpoint every 10 steps;
- the same mode in a hand-written loop (its own class, the same optimizer, groups,
  schedule, clipping and accumulation): the reference, equal to 1e-6;
- the Trainer resumed from its step-10 checkpoint to step 20 in a new Trainer (and new
  mode): bit for bit the uninterrupted run.

The same launch runs the stock Trainer (DDP) with AdamW for ZeRO's parity, and both the
stock Trainer and ``localsgd`` at ``sync_every=1`` with plain SGD and no clipping, where
their arithmetic is the same. A second launch, on 3 ranks, resumes the ZeRO checkpoint
saved on 2 and checks the resharded state. Skipped without the ``hf`` extra.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from launching import hf_worker, leave, load_runs, torchrun
from models import TRAINER_MODES, hf_regression, resume_one_step

pytest.importorskip("transformers", reason="the hf extra is not installed: pip install 'fastreduce[hf]'")
pytest.importorskip("accelerate", reason="the hf extra is not installed: pip install 'fastreduce[hf]'")

STEPS, SAVE, ACCUM, BATCH = 20, 10, 2, 4
LR, WD, CLIP, WARMUP = 1e-2, 0.1, 0.05, 4
MODES = TRAINER_MODES  # name: fastreduce_config of the Trainer and of the reference loop's mode
FIGURES = ("fastreduce/bytes_per_step", "fastreduce/wait_seconds_per_step", "fastreduce/comm_share")  # every mode's
MIXED = ["zero", "localsgd", "diloco", "gossip"]  # also trained with bf16=True (autocast)
COMPILED = ["zero", "localsgd", "diloco", "gossip"]  # also trained with torch_compile=True
RESHARDED = ("zero", "fused", "overlap")  # saved on 2 ranks, resumed on 3 (the others' state is each rank's own)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """``{run: [per-rank facts]}`` of the 2-rank launch, then the 3-rank ZeRO resume's."""
    out = tmp_path_factory.mktemp("trainer_modes")
    torchrun(__file__, 2, "train", str(out), timeout=400)
    torchrun(__file__, 3, "reshard", str(out), timeout=300)
    return load_runs(out) | {"dir": out}


def _close(a: torch.Tensor, b: torch.Tensor, atol: float) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=atol)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.cell("hf", "train")
def test_trainer_equals_the_hand_written_loop(runs: dict, mode: str) -> None:
    """The Trainer in each mode ends where the mode's own loop ends, on every rank (1e-6):
    accumulation 2, clipping on every step, cosine schedule with warm-up, AdamW groups."""
    for rank, (ours, ref) in enumerate(zip(runs[f"{mode}_trainer"], runs[f"{mode}_loop"])):
        assert float((ref["params"] - ref["start"]).norm()) > 10 * LR * CLIP, "training did not move the parameters"
        assert ours["grad_norms"] == pytest.approx(ref["grad_norms"][4::5], rel=1e-5)  # logged every 5 steps
        _close(ours["params"], ref["params"], 1e-6)
        norms = ref["grad_norms"][mode == "gossip":]  # gossip's first step closes (clipped) at the next forward
        assert min(norms) > 2 * CLIP, ref["grad_norms"]  # every step clipped
        assert ours["lrs"] == pytest.approx(ref["lrs"], rel=1e-9), (ours["lrs"], ref["lrs"])
        assert ours["lrs"][0] < ours["lrs"][WARMUP] and ours["lrs"][-1] < ours["lrs"][WARMUP]  # warm-up, decay


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.cell("hf", "resume")
def test_resume_from_the_trainer_checkpoint_equals_the_uninterrupted_run(runs: dict, mode: str) -> None:
    """Saved at step 10 through ``save_steps``, resumed by a new Trainer with
    ``train(resume_from_checkpoint=...)``: at step 20 bit for bit the run that never stopped."""
    for ours, ref in zip(runs[f"{mode}_resumed"], runs[f"{mode}_trainer"]):
        assert ours["resumed_at"] == SAVE
        assert torch.equal(ours["params"], ref["params"]), float((ours["params"] - ref["params"]).abs().max())


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["fused", "overlap", "zero"])
def test_ranks_identical_where_the_mode_keeps_them_so(runs: dict, mode: str) -> None:
    ranks = runs[f"{mode}_trainer"]
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", MIXED)
def test_mixed_precision_equals_the_loop_under_autocast(runs: dict, mode: str) -> None:
    """``TrainingArguments(bf16=True)`` (CPU autocast in forward) against the same mode's loop
    with its forward under ``torch.autocast``: equal to 1e-6, and away from the fp32 run."""
    for ours, ref, fp32 in zip(runs[f"{mode}_bf16"], runs[f"{mode}_bf16_loop"], runs[f"{mode}_trainer"]):
        _close(ours["params"], ref["params"], 1e-6)
        assert float((ours["params"] - fp32["params"]).abs().max()) > 1e-4  # bf16 really ran


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", COMPILED)
@pytest.mark.cell("hf", "compile")
def test_compiled_trainer_equals_the_eager_one(runs: dict, mode: str) -> None:
    """``torch_compile=True`` (aot_eager: the same kernels) ends where the eager Trainer ends, to 1e-6."""
    wrappers = ("CalledThrough", "DecentralizedDataParallel") if mode == "gossip" else ("OptimizedModule", "Tiny")
    for ours, ref in zip(runs[f"{mode}_compiled"], runs[f"{mode}_trainer"]):  # (gossip: its wrapper calls the compiled model)
        assert (ours["wrapped"], ref["wrapped"]) == wrappers and ours["compiled"] and not ref["compiled"]
        _close(ours["params"], ref["params"], 1e-6)


@pytest.mark.timeout(600)
def test_epochs_early_stopping_and_save_total_limit(runs: dict) -> None:
    """DiLoCo trained for epochs: early stopping ends it before the last of 2 epochs'
    steps, ``save_total_limit=1`` leaves the best checkpoint (and the last one, where
    transformers keeps it), each with the mode's state, and ``load_best_model_at_end`` leaves every rank on the best model
    (the ranks' mean saved there): the same parameters on every rank."""
    ranks = runs["diloco_epochs"]
    full = 2 * STEPS  # the steps of 2 epochs
    for r in ranks:
        assert 0 < r["steps"] < full and r["epoch"] < 2, (r["steps"], r["epoch"])  # stopped early
        assert 1 <= len(r["folders"]) <= 2 and all(r["has_state"]), r["folders"]
        assert r["best"] and r["best"].endswith(tuple(r["folders"]))
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])


@pytest.mark.timeout(600)
def test_fsdp_with_a_mode_is_refused_when_the_trainer_is_built(runs: dict) -> None:
    for rank in runs["fsdp"]:
        assert rank["refused"] and "also asks for FSDP" in rank["refused"], rank["refused"]
        assert "drop the FSDP setting" in rank["refused"]


@pytest.mark.timeout(600)
def test_zero_equals_the_trainer_with_ddp(runs: dict) -> None:
    """ZeRO + AdamW in the Trainer against the stock Trainer (DDP) + AdamW: the same arithmetic."""
    _close(runs["zero_trainer"][0]["params"], runs["ddp_adamw"][0]["params"], 1e-6)
    assert runs["zero_trainer"][0]["grad_norms"] == pytest.approx(runs["ddp_adamw"][0]["grad_norms"], rel=1e-5)


@pytest.mark.timeout(600)
def test_localsgd_every_step_equals_the_trainer_with_ddp(runs: dict) -> None:
    """LocalSGD averaging after every plain SGD step (no clipping) is DDP's step."""
    for ours, ddp in zip(runs["localsgd_h1"], runs["ddp_sgd"]):
        _close(ours["params"], ddp["params"], 1e-6)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["localsgd", "diloco", "gossip"])
def test_per_rank_modes_evaluate_and_save_the_mean(runs: dict, mode: str) -> None:
    """Between syncs the ranks hold their own parameters; ``evaluate()`` and the saved model
    (``from_pretrained`` of a checkpoint's files, no fastreduce involved) see their mean,
    and training then goes on from each rank's own (the resume test above proves it)."""
    ranks = runs[f"{mode}_trainer"]
    assert not torch.equal(ranks[0]["at_save"], ranks[1]["at_save"]), "the ranks held the same parameters at save"
    mean = (ranks[0]["at_save"].double() + ranks[1]["at_save"].double()).div(2).float()
    for r in ranks:
        _close(r["saved_model"], mean, 1e-7)
        assert r["eval_loss"] == pytest.approx(r["mean_loss"], rel=1e-5)
        assert torch.equal(r["after_save"], r["at_save"])


@pytest.mark.timeout(600)
def test_eval_params_own_evaluates_each_ranks_own_parameters(runs: dict) -> None:
    """``fastreduce_eval_params="own"``: ``evaluate()`` sees each rank's own parameters on
    its share of the evaluation batches (no communication), not their mean; the saved model
    is still the mean, and training is the same run as with ``"mean"``."""
    for own, mean in zip(runs["diloco_own"], runs["diloco_trainer"]):
        assert own["eval_loss"] == pytest.approx(own["own_loss"], rel=1e-5)
        assert own["eval_loss"] != pytest.approx(own["mean_loss"], rel=1e-5)
        _close(own["saved_model"], mean["saved_model"], 0.0)
        assert torch.equal(own["params"], mean["params"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode, eval_params, says", [
    ("zero", "own", "mode 'zero' keeps the same parameters on every rank"),
    ("fused", "own", "pick a mode whose ranks train their own (localsgd, diloco, gossip)"),
    ("diloco", "averaged", "eval_params must be one of 'mean', 'own', got 'averaged'"),
])
def test_a_mode_that_cannot_evaluate_as_asked_fails_when_the_trainer_is_built(
        tmp_path: Path, mode: str, eval_params: str, says: str) -> None:
    from transformers import TrainingArguments

    from fastreduce.integrations.transformers import FastReduceTrainer

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    config = {"sync_every": 4} if mode == "diloco" else None  # (a setting it needs)
    with pytest.raises(ValueError, match=re.escape(says)):
        FastReduceTrainer(model=torch.nn.Linear(2, 2), args=args, fastreduce_mode=mode, fastreduce_config=config,
                          fastreduce_eval_params=eval_params)


def figures_are_the_stats(logs: list[dict], at: list[tuple[int, int, float]]) -> None:
    """Each log's ``fastreduce/bytes_per_step`` and ``wait_seconds_per_step`` are the mode's
    ``stats`` (``at``: ``(step, bytes, seconds waited)`` when training began and at each log)
    at that log less at the one before, over the steps between; ``comm_share`` is a share.
    Every mode moves bytes and waits in every window."""
    assert len(logs) == len(at) - 1 > 0, (logs, at)
    for log, (s0, b0, w0), (s1, b1, w1) in zip(logs, at, at[1:]):
        assert log["fastreduce/bytes_per_step"] == (b1 - b0) / (s1 - s0) > 0, (log, at)
        assert log["fastreduce/wait_seconds_per_step"] == (w1 - w0) / (s1 - s0) > 0, (log, at)
        assert 0 < log["fastreduce/comm_share"] < 1, log


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", list(MODES))
def test_the_log_holds_the_mode_figures(runs: dict, mode: str) -> None:
    """Every training log of ``log_history`` holds the mode's figures under the same keys in
    every mode, each what the mode's own ``stats`` say at that log; and its own counts."""
    rank = runs[f"{mode}_trainer"][0]
    logs = [h for h in rank["log_history"] if "loss" in h]
    assert len(logs) == STEPS // 5
    figures_are_the_stats(logs, rank["wire_at_logs"])
    counts = {"fused": "fastreduce/reductions", "overlap": "fastreduce/reductions", "zero": "fastreduce/buckets",
              "localsgd": "fastreduce/syncs", "diloco": "fastreduce/syncs", "gossip": "fastreduce/rounds"}
    assert all(counts[mode] in h for h in logs), logs[0]
    if mode in ("fused", "overlap"):
        assert logs[-1]["fastreduce/reductions"] == STEPS == rank["counters"]["reductions"]
    if mode in ("localsgd", "diloco"):
        assert logs[-1]["fastreduce/syncs"] == rank["counters"]["syncs"] > 0


SNIPPETS = ["zero", "overlap", "gossip", "localsgd", "diloco"]  # docs/trainers.md's order


@pytest.mark.timeout(60)
@pytest.mark.parametrize("trainer", ["hf_trainer", "accelerate"])
def test_the_trainers_page_has_a_block_per_mode(trainer: str) -> None:
    """docs/trainers.md shows each mode's block for the trainer, assuming only a user's names."""
    from mode_snippets import mode_blocks

    assert list(mode_blocks(trainer)) == SNIPPETS


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", SNIPPETS)
def test_the_trainers_page_blocks_run(runs: dict, mode: str) -> None:
    """Each mode's blocks for the HF Trainer and Accelerate, run verbatim on 2 ranks (ranks
    starting from different weights): the Trainer trains its steps in that mode and logs the
    mode's figures; the Accelerate loop ends with every rank on the same parameters, rank 0's
    start moved by training (each block ends with the mode's own last sync)."""
    for rank in runs[f"snippet_hf_trainer_{mode}"]:
        assert rank["mode"] == mode and rank["steps"][0] == rank["steps"][1] > 0, rank
        assert rank["started_different"] and rank["moved_from_rank0_start"], rank
        assert rank["logs"] > 0 and rank["figures"], rank
        if mode in ("zero", "overlap"):
            assert rank["params_identical_across_ranks"], rank
    for rank in runs[f"snippet_accelerate_{mode}"]:
        assert rank["steps"] > 0 and rank["started_different"], rank
        assert rank["params_identical_across_ranks"] and rank["moved_from_rank0_start"], rank


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", RESHARDED)
@pytest.mark.cell("hf", "reshard")
def test_a_checkpoint_resumes_on_three_ranks(runs: dict, mode: str) -> None:
    """The checkpoint saved on 2 ranks (ZeRO's shards; the fused modes' replicated state)
    resumes on 3: right after the load, the parameters and AdamW's state (torch.optim's
    format; ZeRO's gathered) are what was saved, and training goes on."""
    saved, resharded = runs[f"{mode}_trainer"][0], runs[f"{mode}_reshard"]
    for rank in resharded:
        assert rank["world"] == 3
        _close(rank["params"], saved["at_save"], 1e-6)
        for key in ("exp_avg", "exp_avg_sq"):
            _close(rank["optim"][key], saved["optim_at_save"][key], 1e-6)
        assert rank["optim"]["step"] == saved["optim_at_save"]["step"] == SAVE
        assert rank["trained_after"]  # and it trains on


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode, config, error, says", [
    ("zeros", {}, ValueError, "unknown fastreduce mode 'zeros': choose one of fused, overlap, zero"),
    ("zero", {"sync_every": 4}, TypeError, "mode 'zero' (ZeroOptimizer) does not take the setting 'sync_every'"),
    ("localsgd", {"bucket_mb": 1}, TypeError, "mode 'localsgd' (LocalSGD) does not take the setting 'bucket_mb'"),
    ("fused", {"overlap": True}, TypeError, "does not take the setting 'overlap'"),
    ("fused", {"wire_dtype": torch.int8}, ValueError, "wire_dtype"),
    ("diloco", {"sync_every": 4, "outer_optimizer": 0.7}, TypeError, "outer_optimizer must be a torch optimizer"),
])
def test_bad_settings_fail_when_the_trainer_is_built(tmp_path: Path, mode: str, config: dict, error: type,
                                                      says: str) -> None:
    """Each rank checks the mode and its settings alone, when the Trainer is built: before
    any process group exists, so every rank raises the same error and none waits."""
    from transformers import TrainingArguments

    from fastreduce.integrations.transformers import FastReduceTrainer

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with pytest.raises(error, match=re.escape(says)):
        FastReduceTrainer(model=torch.nn.Linear(2, 2), args=args, fastreduce_mode=mode, fastreduce_config=config)


@pytest.mark.timeout(600)
def test_gossip_follows_a_scheduler_of_the_users(runs: dict) -> None:
    """optimizers=(opt, StepLR(opt)) under gossip: each bucket's optimizer steps with the lr the
    user's scheduler set (it crashed on transformers 5, remade the scheduler as the Trainer's
    default one before)."""
    for rank in runs["users_sched"]:
        assert rank["scheduler_kept"]
        assert rank["used"] == [[LR * 0.5 ** k] * len(rank["used"][0]) for k in range(3)], rank["used"]


@pytest.mark.timeout(600)
def test_a_second_train_logs_its_own_figures(runs: dict) -> None:
    """A second train() of the same trainer: the bytes per step of its first log are its own
    (they were two runs' bytes over one step: the figures' mark stayed at the first run's end)."""
    for rank in runs["users_sched"]:
        first, second = rank["bytes_per_step"]
        assert first and second == first and len(set(first)) == 1, rank["bytes_per_step"]


@pytest.mark.timeout(120)
def test_a_checkpoint_of_several_ranks_resumed_in_one_process_is_refused(runs: dict, tmp_path: Path) -> None:
    """A fused-mode checkpoint holds its optimizer in fastreduce's form; one process runs no
    mode, and the Trainer's own loader, finding no optimizer.pt, loaded nothing and said
    nothing (the LR schedule from its warm-up again, AdamW's moments empty)."""
    from transformers import Trainer, TrainingArguments

    from fastreduce.integrations.transformers import FastReduceMixin

    class Plain(FastReduceMixin, Trainer):
        pass

    TinyConfig, Tiny, Data = hf_regression()
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=STEPS,
                             per_device_train_batch_size=BATCH, disable_tqdm=True, save_strategy="no")
    trainer = Plain(model=Tiny(TinyConfig()), args=args, train_dataset=Data(64, 1), fastreduce_mode="fused")
    with pytest.raises(ValueError, match="resume on several ranks"):
        trainer.train(resume_from_checkpoint=str(runs["dir"] / "fused_trainer" / f"checkpoint-{SAVE}"))


@pytest.mark.timeout(60)
def test_zero_refuses_a_scheduler_built_over_the_optimizer_it_replaces(tmp_path: Path) -> None:
    from transformers import TrainingArguments

    from fastreduce.integrations.transformers import FastReduceTrainer

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match=r"optimizers=\(optimizer, None\)"):
        FastReduceTrainer(model=model, args=args, optimizers=(opt, sched), fastreduce_mode="zero")


@pytest.mark.timeout(180)  # a subprocess importing optimum-habana (it asks pip): 60 s on a loaded 2-core machine
def test_the_gaudi_trainer_says_what_it_needs() -> None:
    """``FastReduceGaudiTrainer`` is built on first use; where ``optimum.habana`` does not
    import, it says so, naming the import's own error (tests/test_gaudi_trainer.py trains it)."""
    import subprocess

    code = ("import fastreduce.integrations.optimum_habana as m\n"
            "try:\n    import optimum.habana\nexcept Exception as e:\n    print('NO', type(e).__name__)\n"
            "try:\n    print('CLASS', [c.__name__ for c in m.FastReduceGaudiTrainer.__mro__[1:3]])\n"
            "except ImportError as e:\n    print('ERROR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))).stdout
    if out.startswith("NO "):
        cause = out.split()[1]
        assert "ERROR fastreduce.integrations.optimum_habana.FastReduceGaudiTrainer needs optimum-habana" in out, out
        assert f"`import optimum.habana` failed ({cause}" in out, out
    else:
        assert "CLASS ['FastReduceMixin', 'GaudiTrainer']" in out, out


# ============================================================== the torchrun worker

def _worker(out: Path, what: str) -> None:  # noqa: C901 (one script: the runs in order)
    from functools import partial

    import torch._dynamo

    import torch.distributed as dist
    from torch.utils.data import SequentialSampler
    from transformers import (Trainer, TrainerCallback, TrainingArguments,
                              get_scheduler)

    from fastreduce import DecentralizedDataParallel, DiLoCo, FusedReducer, LocalSGD, ZeroOptimizer
    from fastreduce.integrations.transformers import FastReduceMixin

    rank, world = hf_worker()

    TinyConfig, Tiny, Data = hf_regression()

    class Ordered(FastReduceMixin, Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    class Stock(Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    train_data, eval_data = Data(STEPS * ACCUM * BATCH * world, 1), Data(64, 2)

    def flat(model) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()

    def fresh() -> Tiny:
        torch.manual_seed(0)
        return Tiny(TinyConfig())

    def arguments(run: str, steps: int = STEPS, optim: str = "adamw_torch", clip: float = CLIP,
                  sched: str = "cosine", warmup: int = WARMUP, **more: Any) -> TrainingArguments:
        return TrainingArguments(**more,
            output_dir=str(out / run), use_cpu=True, report_to="none", per_device_train_batch_size=BATCH,
            gradient_accumulation_steps=ACCUM, max_steps=steps, learning_rate=LR, weight_decay=WD if
            optim.startswith("adamw") else 0.0, optim=optim, max_grad_norm=clip, lr_scheduler_type=sched,
            warmup_steps=warmup, logging_steps=5, save_strategy="steps", save_steps=SAVE, disable_tqdm=True,
            eval_strategy="steps", eval_steps=SAVE,
            seed=0, dataloader_num_workers=0, per_device_eval_batch_size=16)

    def wire(obj) -> tuple[int, float]:
        """The mode object's ``stats``: bytes handed to its collectives, seconds waited on them."""
        st = obj.stats
        return (st.bytes_reduced if isinstance(obj, FusedReducer) else st.wire_bytes), st.wait_seconds

    class Record(TrainerCallback):
        def __init__(self, trainer, mode: str | None):
            self.trainer, self.mode, self.lrs, self.facts = trainer, mode, [], {}
            self.wire_at_logs: list[tuple] = []  # (step, *wire(mode object)) at the start, then at each training log

        def on_train_begin(self, args, state, control, **kw):
            if self.mode is not None:  # the mode is built by now
                self.wire_at_logs.append((state.global_step, *wire(self.trainer.fastreduce_mode.obj)))

        def on_log(self, args, state, control, logs=None, **kw):
            if self.mode is not None and "loss" in (logs or {}):  # right after the figures were read
                self.wire_at_logs.append((state.global_step, *wire(self.trainer.fastreduce_mode.obj)))

        def on_optimizer_step(self, args, state, control, **kw):
            self.lrs.append(self.trainer.optimizer.param_groups[0]["lr"])

        def on_step_end(self, args, state, control, **kw):
            if state.global_step != SAVE or self.mode is None:
                return
            model = self.trainer.model
            if self.mode == "zero":  # a callback reads the parameters outside forward: wait for the gather
                self.trainer.fastreduce_mode.obj.wait_params()
            self.facts["at_save"] = flat(model)
            if self.mode in RESHARDED:  # (zero: collective, torch.optim's format)
                sd = getattr(self.trainer.optimizer, "optimizer", self.trainer.optimizer).state_dict()
                self.facts["optim_at_save"] = optim_facts(sd)

        def on_save(self, args, state, control, **kw):
            if state.global_step == SAVE and self.mode is not None:
                self.facts["after_save"] = flat(self.trainer.model)  # evaluated and saved: own parameters back

    def optim_facts(sd: dict) -> dict:
        states = [sd["state"][i] for i in sorted(sd["state"])]
        return {"exp_avg": torch.cat([s["exp_avg"].reshape(-1) for s in states]),
                "exp_avg_sq": torch.cat([s["exp_avg_sq"].reshape(-1) for s in states]),
                "step": int(states[0]["step"])}

    def save(run: str, facts: dict) -> None:
        torch.save(facts, out / f"{run}.rank{rank}.pt")

    def trainer_run(run: str, mode: str | None, config: dict | None, resume: bool = False, eval_params: str = "mean",
                    **kw) -> dict:
        before = set(os.environ)  # (TrainingArguments of transformers < 5 sets some)
        model = fresh()
        start = flat(model)
        args = arguments(run, **kw)
        cls = Stock if mode is None else Ordered
        extra = {} if mode is None else {"fastreduce_mode": mode, "fastreduce_config": dict(config),
                                         "fastreduce_eval_params": eval_params}
        trainer = cls(model=model, args=args, train_dataset=train_data, eval_dataset=eval_data, **extra)
        rec = Record(trainer, mode)
        trainer.add_callback(rec)
        ckpt = out / run.replace("_resumed", "_trainer") / f"checkpoint-{SAVE}"
        torch._dynamo.reset()  # each compiled run compiles afresh
        try:
            trainer.train(resume_from_checkpoint=str(ckpt) if resume else None)
        finally:
            for var in set(os.environ) - before:  # transformers < 5 leaves compile to later runs through these
                if var.startswith("ACCELERATE_"):
                    del os.environ[var]
        facts = {"start": start, "params": flat(model), "lrs": rec.lrs, **rec.facts,
                 "wrapped": type(trainer.model_wrapped).__name__,
                 "compiled": any(type(m).__name__ == "OptimizedModule" for m in trainer.model_wrapped.modules()),
                 "grad_norms": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h],
                 "log_history": trainer.state.log_history, "resumed_at": SAVE if resume else None}
        if mode is not None and not resume:
            m = trainer.fastreduce_mode.obj
            facts["counters"] = ({"reductions": m.stats.calls} if isinstance(m, FusedReducer) else
                                 {"syncs": m.syncs} if isinstance(m, (LocalSGD, DiLoCo)) else {})
            facts["wire_at_logs"] = rec.wire_at_logs
            if mode in ("localsgd", "diloco", "gossip"):
                saved = Tiny.from_pretrained(str(ckpt))  # the checkpoint's model files, as a user loads them
                facts["saved_model"] = flat(saved)
                facts["eval_loss"] = next(h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h)
                with torch.no_grad():  # the loss of the ranks' mean parameters at step 10, by hand
                    mean = rec.facts["at_save"].double()
                    dist.all_reduce(mean)
                    probe = fresh()
                    torch.nn.utils.vector_to_parameters(mean.div(world).float(), probe.parameters())
                    facts["mean_loss"] = float(probe(eval_data.x, eval_data.y)["loss"])
                    # each rank's own parameters on its share of the Trainer's evaluation batches
                    torch.nn.utils.vector_to_parameters(rec.facts["at_save"], probe.parameters())
                    own = torch.tensor([0.0, 0.0], dtype=torch.float64)
                    for batch in trainer.get_eval_dataloader():
                        own += torch.tensor([float(probe(**batch)["loss"]), 1.0], dtype=torch.float64)
                    dist.all_reduce(own)
                    facts["own_loss"] = float(own[0] / own[1])
        save(run, facts)
        return facts

    def loop_run(run: str, mode: str, config: dict, bf16: bool = False) -> None:
        """The mode in a hand-written loop: what the Trainer does, written out (``bf16``:
        the forward under CPU autocast, as the Trainer's ``bf16=True`` runs it)."""
        model = fresh()
        start = flat(model)
        probe = Stock(model=model, args=arguments(run), train_dataset=train_data, eval_dataset=eval_data)
        loader = probe.get_train_dataloader()  # the Trainer's own batches, in its order
        decay = probe.get_decay_parameter_names(model)
        groups = [{"params": [p for n, p in model.named_parameters() if n in decay], "weight_decay": WD},
                  {"params": [p for n, p in model.named_parameters() if n not in decay], "weight_decay": 0.0}]
        config = dict(config)
        reducer = None
        if mode == "zero":
            opt = ZeroOptimizer(groups, torch.optim.AdamW, lr=LR, module=model, **config)
        else:
            opt = torch.optim.AdamW(groups, lr=LR)
        if mode in ("fused", "overlap"):
            reducer = FusedReducer(model, overlap=mode == "overlap", **config)
        elif mode == "localsgd":
            LocalSGD(model, opt, **config)
        elif mode == "diloco":
            outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
            DiLoCo(model, opt, outer, **config)
        net = model
        if mode == "gossip":  # one AdamW per bucket, with its own cosine schedule, stepped and clipped in backward
            def optim_fn(named):
                return torch.optim.AdamW([g for g in (
                    {"params": [p for n, p in named if n in decay], "weight_decay": WD},
                    {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}) if g["params"]], lr=LR)

            net = DecentralizedDataParallel(model, optim_fn, partial(get_scheduler, "cosine", num_warmup_steps=WARMUP,
                                                                     num_training_steps=STEPS),
                                            grad_clip_norm=CLIP, **config)
        sched = get_scheduler("cosine", opt, num_warmup_steps=WARMUP, num_training_steps=STEPS)
        lrs, norms, batches = [], [], iter(loader)
        for _ in range(STEPS):
            for micro in range(ACCUM):
                batch = next(batches)
                quiet = micro < ACCUM - 1 and mode in ("fused", "overlap", "zero", "gossip")
                with (reducer or (net if mode == "gossip" else opt)).no_sync() if quiet else torch.enable_grad():
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                        loss = net(**batch)["loss"]
                    (loss.float() / ACCUM).backward()
            if reducer is not None:
                reducer.reduce()
            if mode == "gossip":  # stepped in backward; opt only keeps the schedule's lr for the record
                bucket_norms = getattr(net, "grad_norms", [])  # the first step closes at the next forward
                norms.append(float(torch.stack(bucket_norms).square().sum().sqrt()) if bucket_norms else 0.0)
            else:
                clip = opt.clip_grad_norm_ if mode == "zero" else partial(torch.nn.utils.clip_grad_norm_,
                                                                          model.parameters())
                norms.append(float(clip(CLIP)))
                opt.step()
            lrs.append(opt.param_groups[0]["lr"])
            sched.step()
            model.zero_grad()
        if mode == "zero":
            opt.wait_params()  # the last step's all-gather, before reading the parameters outside forward
        save(run, {"start": start, "params": flat(model), "lrs": lrs, "grad_norms": norms})

    def epochs_run(out: Path) -> None:
        """DiLoCo for epochs (no max_steps), evaluated and saved every 5 steps, keeping one
        checkpoint, stopped early and ending on the best model."""
        from transformers import EarlyStoppingCallback

        model = fresh()
        args = arguments("diloco_epochs", steps=-1, num_train_epochs=2, save_total_limit=1,
                         load_best_model_at_end=True, metric_for_best_model="eval_loss")
        args.save_steps = args.eval_steps = 5
        trainer = Ordered(model=model, args=args, train_dataset=train_data, eval_dataset=eval_data,
                          fastreduce_mode="diloco", fastreduce_config=MODES["diloco"],
                          callbacks=[EarlyStoppingCallback(early_stopping_patience=1, early_stopping_threshold=0.05)])
        trainer.train()
        torch.distributed.barrier()  # rank 0 removes the last checkpoint at the end of train() when it is not the
        # best (save_total_limit=1): the other rank lists the folders after that
        folders = sorted(p.name for p in (out / "diloco_epochs").glob("checkpoint-*"))
        save("diloco_epochs", {"params": flat(model), "folders": folders, "epoch": trainer.state.epoch,
                               "steps": trainer.state.global_step, "best": trainer.state.best_model_checkpoint,
                               "has_state": [(out / "diloco_epochs" / f / "fastreduce").is_dir() for f in folders]})

    def snippet_runs(out: Path) -> None:
        """docs/trainers.md's block of each mode for the HF Trainer and for Accelerate, verbatim."""
        from mode_snippets import mode_blocks, run_block, users_script
        from test_readme import common_facts, prelude_accelerate, prelude_hf_trainer

        with users_script(out / "snippets"):
            for mode, (first, text) in mode_blocks("hf_trainer").items():
                names, ctx = prelude_hf_trainer()
                trainer = run_block(first, text, names)["trainer"]
                logs = [h for h in trainer.state.log_history if "loss" in h]
                save(f"snippet_hf_trainer_{mode}", {
                    **common_facts(names["model"], ctx["start"]), "mode": trainer.fastreduce_mode.name,
                    "steps": (trainer.state.global_step, trainer.args.max_steps),
                    "logs": len(logs), "figures": all(k in h for h in logs for k in FIGURES)})
            for mode, (first, text) in mode_blocks("accelerate").items():
                names, ctx = prelude_accelerate()
                ns = run_block(first, text, names)
                save(f"snippet_accelerate_{mode}", {**common_facts(ns["model"], ctx["start"]), "steps":
                                                    len(ns["loader"]) // names["accelerator"].gradient_accumulation_steps})

    def users_scheduler_and_second_train() -> None:
        """Gossip under a scheduler of the user's (``optimizers=(opt, sched)``): the lr each
        bucket's optimizer stepped with, per step; and a second ``train()`` of a fused trainer:
        its logged bytes per step (the fp32 wire: the same at every step)."""
        model = fresh()
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        trainer = Ordered(model=model, args=arguments("gossip_users_sched", steps=3), train_dataset=train_data,
                          eval_dataset=eval_data,
                          optimizers=(opt, sched), fastreduce_mode="gossip", fastreduce_config=MODES["gossip"])
        used: list[list[float]] = []

        class Lrs(TrainerCallback):
            def on_step_end(self, args, state, control, **kw):
                state = trainer.fastreduce_mode.obj.local_state_dict()
                used.append([o["param_groups"][0]["lr"] for o in state["optimizers"]])

        trainer.add_callback(Lrs())
        trainer.train()
        twice = Ordered(model=fresh(), args=arguments("fused_twice", steps=10, sched="constant", warmup=0,
                                                      clip=0.0), train_dataset=train_data, eval_dataset=eval_data,
                        fastreduce_mode="fused", fastreduce_config={"wire_dtype": torch.float32})
        bytes_per_step = []
        for _ in range(2):
            twice.train()
            bytes_per_step.append([h["fastreduce/bytes_per_step"] for h in twice.state.log_history
                                   if "fastreduce/bytes_per_step" in h])
        save("users_sched", {"used": used, "scheduler_kept": trainer.lr_scheduler is sched or
                             getattr(trainer.lr_scheduler, "scheduler", None) is sched,
                             "bytes_per_step": bytes_per_step})

    if what == "train":
        users_scheduler_and_second_train()
        for mode, config in MODES.items():
            trainer_run(f"{mode}_trainer", mode, config)
            trainer_run(f"{mode}_resumed", mode, config, resume=True)
            loop_run(f"{mode}_loop", mode, config)
        trainer_run("ddp_adamw", None, None)
        plain = {"optim": "sgd", "clip": 0.0, "sched": "constant", "warmup": 0}
        trainer_run("ddp_sgd", None, None, **plain)
        trainer_run("localsgd_h1", "localsgd", {"sync_every": 1}, **plain)
        trainer_run("diloco_own", "diloco", MODES["diloco"], eval_params="own")
        epochs_run(out)
        before = set(os.environ)  # transformers < 5: fsdp= sets ACCELERATE_USE_FSDP for every later Trainer
        try:  # FSDP (made only in a distributed run) with a fastreduce mode: refused when the Trainer is built
            Ordered(model=fresh(), args=arguments("fsdp", fsdp="full_shard"), train_dataset=train_data,
                    eval_dataset=eval_data, fastreduce_mode="zero")
            save("fsdp", {"refused": None})
        except ValueError as exc:
            save("fsdp", {"refused": str(exc)})
        for var in set(os.environ) - before:
            del os.environ[var]
        for mode in COMPILED:  # the Trainer's torch_compile, against the same mode's eager run above
            trainer_run(f"{mode}_compiled", mode, MODES[mode], torch_compile=True, torch_compile_backend="aot_eager")
        # bf16 last: accelerate < 1.14 (transformers < 5) keeps an earlier Trainer's mixed precision in its
        # shared state, so a run after these would train in bf16 too
        for mode in MIXED:  # the Trainer's bf16 autocast
            trainer_run(f"{mode}_bf16", mode, MODES[mode], bf16=True)
            loop_run(f"{mode}_bf16_loop", mode, MODES[mode], bf16=True)
        snippet_runs(out)  # (after bf16: accelerate < 1.14 runs them in bf16 too, which they do not mind)
    elif what == "reshard":  # 3 ranks: each 2-rank checkpoint whose state loads onto any world size, trained one step on
        for mode in RESHARDED:
            model = fresh()
            trainer = Ordered(model=model, args=arguments(f"{mode}_reshard", steps=SAVE + 1), train_dataset=train_data,
                              eval_dataset=eval_data, fastreduce_mode=mode, fastreduce_config=MODES[mode])

            def optim_at_load(facts: dict) -> None:
                opt = trainer.fastreduce_mode.obj if mode == "zero" else trainer.optimizer.optimizer
                facts["optim"] = optim_facts(opt.state_dict())

            facts = resume_one_step(trainer, str(out / f"{mode}_trainer" / f"checkpoint-{SAVE}"), lambda: flat(model),
                                    optim_at_load)
            facts["world"] = world
            save(f"{mode}_reshard", facts)
    leave()


if __name__ == "__main__":
    _worker(Path(sys.argv[2]), sys.argv[1])
