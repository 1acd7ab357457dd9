"""``FastReduceGaudiTrainer``: optimum-habana's ``GaudiTrainer`` in every fastreduce mode, its
whole ``train()`` run on CPU (``use_habana=False``, ``use_cpu=True``: optimum-habana's own CPU
path) on 2 Gloo ranks under ``torchrun``.

``GaudiTrainer`` is a fork of the HF ``Trainer``'s training loop (its own
``_inner_training_loop``, ``_maybe_log_save_evaluate``, checkpointing), so the mixin's hooks
are checked on that loop, not assumed from the Trainer's. One launch trains, per mode, on the
same data with the same arguments (accumulation 2, clipping on every step, a cosine schedule
with warm-up, AdamW with the two param groups, a checkpoint every 6 steps):

- ``FastReduceTrainer`` (the HF Trainer in that mode: the reference; tests/test_trainer_modes.py
  checks it against the mode's hand-written loop) and ``FastReduceGaudiTrainer``: equal to 1e-6;
- the ``GaudiTrainer`` resumed from its step-6 checkpoint by a new trainer: bit for bit the run
  that never stopped.

A second launch, on 3 ranks, resumes the fused, overlapped and ZeRO checkpoints saved on 2.

What is not run here: Habana's software. The run needs two things of it, neither on the training
path: ``import optimum.habana`` checks Habana's plugin's version in ``pip list``
(``check_synapse_version``: the stack installs ``tests/stand_ins/habana-torch-plugin``, a
distribution of that name with a version and no code), and ``GaudiTrainer.log`` adds the HPU's
memory figures to every log (``get_hpu_memory_stats``, which imports ``habana_frameworks``: the
worker makes it return none). HPU graphs, lazy mode, HCCL, Habana's fused AdamW and clipping
are Gaudi's alone. Skipped where optimum-habana does not import (it pins transformers 4.55:
the Gaudi 1.23 stack installs it, ``stacks/gaudi-1.23.txt``).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from launching import hf_worker, leave, load_runs, torchrun
from models import TRAINER_MODES, hf_regression, resume_one_step

STEPS, SAVE, ACCUM, BATCH = 12, 6, 2, 4
LR, WD, CLIP, WARMUP = 1e-2, 0.1, 0.05, 3
MODES = TRAINER_MODES  # name: fastreduce_config
RESHARDED = ("fused", "overlap", "zero")  # their state loads onto any world size
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))  # (keep_training_trainers.gaudi_on_cpu)


def _importable() -> bool:
    try:  # (a namespace package: finding optimum.habana runs none of its code)
        return importlib.util.find_spec("optimum.habana") is not None
    except (ImportError, ValueError):
        return False


pytestmark = [pytest.mark.timeout(600), pytest.mark.skipif(
    not _importable(), reason="optimum-habana is not installed (it pins transformers 4.55: the Gaudi 1.23 stack, "
    "make stack-gaudi-1.23, has it)")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("gaudi_trainer")
    torchrun(__file__, 2, "train", str(out), timeout=500)
    torchrun(__file__, 3, "reshard", str(out), timeout=300)
    return load_runs(out)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.cell("gaudi", "train")
def test_the_gaudi_trainer_equals_the_hf_trainer_in_the_same_mode(runs: dict, mode: str) -> None:
    """Every rank ends where the HF Trainer in that mode ends (1e-6), with the same learning
    rate at every step; the mode's figures are in its logs, the HPU's memory figures are not."""
    for ours, ref in zip(runs[f"{mode}_gaudi"], runs[f"{mode}_hf"]):
        assert ours["trainer"] == "FastReduceGaudiTrainer" and ref["trainer"] == "FastReduceTrainer"
        assert float((ref["params"] - ref["start"]).norm()) > 10 * LR * CLIP, "training did not move the parameters"
        torch.testing.assert_close(ours["params"], ref["params"], rtol=0, atol=1e-6)
        assert ours["lrs"] == pytest.approx(ref["lrs"], rel=1e-9) and len(ours["lrs"]) == STEPS
        assert ours["figures"] and ref["figures"], (ours["figures"], ref["figures"])


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.cell("gaudi", "resume")
def test_the_gaudi_trainer_resumed_from_its_checkpoint_equals_the_uninterrupted_run(runs: dict, mode: str) -> None:
    for ours, ref in zip(runs[f"{mode}_resumed"], runs[f"{mode}_gaudi"]):
        assert ours["resumed_at"] == SAVE
        assert torch.equal(ours["params"], ref["params"]), float((ours["params"] - ref["params"]).abs().max())


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.cell("gaudi", "compile")
def test_the_compiled_gaudi_trainer_equals_the_eager_one(runs: dict, mode: str) -> None:
    """``torch_compile=True`` with ``torch_compile_backend="aot_eager"`` (the same kernels;
    optimum-habana's default backend is Habana's ``hpu_backend``) ends where the eager
    ``GaudiTrainer`` ends, to 1e-6."""
    for ours, ref in zip(runs[f"{mode}_compiled"], runs[f"{mode}_gaudi"]):
        assert ours["compiled"] and not ref["compiled"], (ours["wrapped"], ref["wrapped"])
        torch.testing.assert_close(ours["params"], ref["params"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode", RESHARDED)
@pytest.mark.cell("gaudi", "reshard")
def test_a_gaudi_checkpoint_resumes_on_three_ranks(runs: dict, mode: str) -> None:
    """Saved on 2 ranks, resumed on 3: the parameters right after the load are those saved
    (ZeRO's shards gathered and cut again), every rank the same, and training goes on."""
    saved = runs[f"{mode}_gaudi"][0]["at_save"]
    for rank in runs[f"{mode}_reshard"]:
        assert rank["world"] == 3
        torch.testing.assert_close(rank["params"], saved, rtol=0, atol=1e-6)
        assert rank["trained_after"]


def test_fast_ddp_beside_a_mode_is_refused_when_the_trainer_is_built(runs: dict) -> None:
    """``distribution_strategy="fast_ddp"`` averages the gradients again after every backward:
    beside a mode (here LocalSGD, which would silently become DDP) it is refused, on every rank."""
    for rank in runs["fast_ddp"]:
        assert rank["refused"] and "also asks for optimum-habana's fast_ddp" in rank["refused"], rank["refused"]


# ============================================================== the torchrun worker

def _worker(out: Path, what: str) -> None:
    from keep_training_trainers import gaudi_on_cpu

    gaudi_on_cpu()  # optimum-habana's CPU path: its pip found, no HPU asked for memory figures
    from optimum.habana import GaudiConfig, GaudiTrainingArguments
    from transformers import TrainerCallback, TrainingArguments

    from fastreduce.integrations.optimum_habana import FastReduceGaudiTrainer
    from fastreduce.integrations.transformers import FastReduceTrainer
    rank, world = hf_worker()

    TinyConfig, Tiny, Data = hf_regression()
    data = Data(STEPS * ACCUM * BATCH * world, 1)

    def flat(model) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()

    def build(run: str, mode: str, gaudi: bool, steps: int = STEPS, compiled: bool = False):
        torch.manual_seed(0)
        model = Tiny(TinyConfig())
        common = dict(output_dir=str(out / run), use_cpu=True, report_to="none", per_device_train_batch_size=BATCH,
                      gradient_accumulation_steps=ACCUM, max_steps=steps, learning_rate=LR, weight_decay=WD,
                      optim="adamw_torch", adam_epsilon=1e-8, max_grad_norm=CLIP, lr_scheduler_type="cosine",
                      warmup_steps=WARMUP, logging_steps=SAVE, save_strategy="steps", save_steps=SAVE,
                      disable_tqdm=True, seed=0, dataloader_num_workers=0,
                      **({"torch_compile": True, "torch_compile_backend": "aot_eager"} if compiled else {}))
        kwargs = dict(model=model, train_dataset=data, fastreduce_mode=mode, fastreduce_config=MODES[mode])
        if gaudi:  # (GaudiTrainingArguments' own defaults differ: adam_epsilon 1e-6; given above)
            trainer = FastReduceGaudiTrainer(args=GaudiTrainingArguments(use_habana=False, use_lazy_mode=False,
                                                                          **common),
                                             gaudi_config=GaudiConfig(), **kwargs)
        else:
            trainer = FastReduceTrainer(args=TrainingArguments(**common), **kwargs)
        return model, trainer

    def save(run: str, facts: dict) -> None:
        torch.save(facts, out / f"{run}.rank{rank}.pt")

    if what == "train":
        # (the compiled runs last: a compiled run's arguments leave its backend in the process's
        # environment, ACCELERATE_DYNAMO_BACKEND, and every trainer built after it compiles too)
        eager = [(m, f"{m}_{r}", r != "hf") for m in MODES for r in ("hf", "gaudi", "resumed")]
        for mode, run, gaudi in eager + [(m, f"{m}_compiled", True) for m in MODES]:
            model, trainer = build(run, mode, gaudi, compiled=run.endswith("_compiled"))
            facts: dict = {"trainer": type(trainer).__name__, "start": flat(model), "lrs": []}

            class Watch(TrainerCallback):
                def on_step_end(self, args, state, control, **kw):
                    facts["lrs"].append(trainer.lr_scheduler.get_last_lr()[0])

                def on_save(self, args, state, control, **kw):
                    facts.setdefault("at_save", flat(model))

            trainer.add_callback(Watch())
            resumed = run.endswith("_resumed")
            trainer.train(resume_from_checkpoint=str(out / f"{mode}_gaudi" / f"checkpoint-{SAVE}")
                          if resumed else None)
            logs = [h for h in trainer.state.log_history if "loss" in h]
            compiled = any(type(m).__name__ == "OptimizedModule" for m in trainer.model_wrapped.modules())
            facts.update(params=flat(model), compiled=compiled, wrapped=type(trainer.model_wrapped).__name__,
                         resumed_at=STEPS - len(facts["lrs"]) if resumed else 0,
                         figures=bool(logs) and all("fastreduce/bytes_per_step" in h for h in logs))
            save(run, facts)
        try:  # fast_ddp's own reduction beside the mode's: refused when the trainer is built
            FastReduceGaudiTrainer(model=Tiny(TinyConfig()), gaudi_config=GaudiConfig(), fastreduce_mode="localsgd",
                                   fastreduce_config={"sync_every": 4}, args=GaudiTrainingArguments(
                                       output_dir=str(out / "fast_ddp"), use_habana=False, use_lazy_mode=False,
                                       use_cpu=True, report_to="none", distribution_strategy="fast_ddp"))
            save("fast_ddp", {"refused": None})
        except ValueError as err:
            save("fast_ddp", {"refused": str(err)})
    else:  # 3 ranks: the 2-rank checkpoints whose state loads onto any world size, one step on
        for mode in RESHARDED:
            model, trainer = build(f"{mode}_reshard", mode, True, steps=SAVE + 1)
            facts = resume_one_step(trainer, str(out / f"{mode}_gaudi" / f"checkpoint-{SAVE}"), lambda: flat(model))
            facts["world"] = world
            save(f"{mode}_reshard", facts)
    leave()


if __name__ == "__main__":
    _worker(Path(sys.argv[2]), sys.argv[1])
