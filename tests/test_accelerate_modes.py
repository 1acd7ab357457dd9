"""Every fastreduce mode in an Accelerate loop (docs/trainers.md's recipe: ``prepare_model(model,
evaluation_mode=True)``, the mode built by ``make_mode(name, settings).build(model, optimizer)``,
the optimizer then prepared, ``accelerator.accumulate`` and ``accelerator.backward``), on 2 Gloo
ranks under ``torchrun``.

One launch trains, per mode, on the same batches (each rank its own), accumulation 2, clipping
on every step, AdamW with weight decay:

- the Accelerate loop against the same mode in a hand-written loop without Accelerate (its
  loss divided by the accumulation steps by hand): equal to 1e-6;
- the Accelerate loop saved at step 6 (``mode.checkpointer``: the model, the optimizer inside
  Accelerate's wrapper, the mode's state) and resumed by fresh objects from other weights:
  at step 12 bit for bit the run that never stopped;
- ``Accelerator(dynamo_backend="aot_eager")`` (``prepare_model`` compiles the model) against
  the eager Accelerate loop: equal to 1e-6.

The compiled runs have a launch of their own (Accelerate's process-wide state keeps the first
``Accelerator``'s compile backend). A last launch, on 3 ranks, resumes the fused, overlapped and ZeRO checkpoints saved on 2.
Skipped without the ``hf`` extra.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from launching import leave, load_runs, torchrun
from models import TRAINER_MODES

pytest.importorskip("accelerate", reason="the hf extra is not installed: pip install 'fastreduce[hf]'")

STEPS, SAVE, ACCUM, BATCH = 12, 6, 2, 4
LR, WD, CLIP = 1e-2, 0.1, 0.05
MODES = TRAINER_MODES  # name: the mode's settings (make_mode)
RESHARDED = ("fused", "overlap", "zero")  # their state loads onto any world size
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("accelerate_modes")
    torchrun(__file__, 2, "train", str(out), timeout=500)
    torchrun(__file__, 2, "compiled", str(out), timeout=500)  # (Accelerate's state keeps the first backend asked)
    torchrun(__file__, 3, "reshard", str(out), timeout=300)
    return load_runs(out)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_closed_mode_leaves_no_hook_on_the_model_or_the_optimizer(runs: dict, mode: str) -> None:
    """``TrainerMode.close()`` (a trainer's end, a second ``fit``, a Membership's epoch change)
    takes off every hook the mode put on the model, its parameters and the optimizer."""
    for run in (f"{mode}_loop", f"{mode}_accelerate"):
        for r in runs[run]:
            assert r["hooks_left"] == 0, (run, r["built_hooks"], r["hooks_left"])
    if mode != "gossip":  # (gossip's hooks are on its wrapper module, not on the model)
        assert all(r["built_hooks"] > 0 for r in runs[f"{mode}_loop"]), "the count sees no hook of the mode"


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.cell("accelerate", "train")
def test_the_accelerate_loop_equals_the_hand_written_loop(runs: dict, mode: str) -> None:
    for ours, ref in zip(runs[f"{mode}_accelerate"], runs[f"{mode}_loop"]):
        assert float((ref["params"] - ref["start"]).norm()) > 10 * LR * CLIP, "training did not move the parameters"
        if mode != "gossip":  # (gossip's gradients are spent in backward, each bucket clipped there)
            assert min(ref["norms"]) > 2 * CLIP, ref["norms"]  # clipped at every step
        torch.testing.assert_close(ours["params"], ref["params"], rtol=0, atol=1e-6)
    if mode in ("fused", "overlap", "zero"):
        assert torch.equal(runs[f"{mode}_accelerate"][0]["params"], runs[f"{mode}_accelerate"][1]["params"])


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.cell("accelerate", "resume")
def test_the_accelerate_loop_resumed_equals_the_uninterrupted_run(runs: dict, mode: str) -> None:
    for ours, ref in zip(runs[f"{mode}_resumed"], runs[f"{mode}_accelerate"]):
        assert ours["loaded"] == SAVE and not torch.equal(ours["start"], ref["start"])  # from other weights
        assert torch.equal(ours["params"], ref["params"]), float((ours["params"] - ref["params"]).abs().max())


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.cell("accelerate", "compile")
def test_the_compiled_accelerate_loop_equals_the_eager_one(runs: dict, mode: str) -> None:
    for ours, ref in zip(runs[f"{mode}_compiled"], runs[f"{mode}_accelerate"]):
        assert ours["compiled"] and not ref["compiled"]
        torch.testing.assert_close(ours["params"], ref["params"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode", RESHARDED)
@pytest.mark.cell("accelerate", "reshard")
def test_an_accelerate_checkpoint_resumes_on_three_ranks(runs: dict, mode: str) -> None:
    """Saved on 2 ranks, loaded on 3: the parameters are those saved, and training goes on."""
    saved = runs[f"{mode}_accelerate"][0]["at_save"]
    for rank in runs[f"{mode}_reshard"]:
        assert rank["world"] == 3 and rank["loaded"] == SAVE
        torch.testing.assert_close(rank["at_load"], saved, rtol=0, atol=1e-6)
        assert not torch.equal(rank["params"], rank["at_load"])


# ============================================================== the torchrun worker

def _worker(out: Path, what: str) -> None:
    import contextlib

    import torch.distributed as dist
    from accelerate import Accelerator

    from fastreduce.integrations.modes import make_mode
    from fastreduce.integrations.transformers import broadcast_parameters

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Tanh(),
                                           torch.nn.Linear(16, 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x).squeeze(-1)

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's micro-batch ``i``: the same in every run."""
        g = torch.Generator().manual_seed(1000 * rank + i)
        x = torch.randn(BATCH, 8, generator=g)
        return x, torch.sin(x.sum(1))

    def flat(model: torch.nn.Module) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()

    def hooks(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
        """The hooks on ``module``, its parameters and ``optimizer`` (torch's registries, read)."""
        on_modules = sum(len(d) for m in module.modules() for d in (m._forward_pre_hooks, m._forward_hooks,
                                                                     m._backward_hooks, m._backward_pre_hooks))
        on_params = sum(len(getattr(p, a, None) or {}) for p in module.parameters()
                        for a in ("_post_accumulate_grad_hooks", "_backward_hooks"))
        return on_modules + on_params + len(optimizer._optimizer_step_pre_hooks) + \
            len(optimizer._optimizer_step_post_hooks)

    def train(name: str, accelerate: bool, run: str, seed: int = 0, compiled: bool = False,
              resume: str | None = None, steps: int = STEPS) -> None:
        torch.manual_seed(seed)
        model = Tiny()
        accelerator = None
        if accelerate:
            accelerator = Accelerator(gradient_accumulation_steps=ACCUM, cpu=True,
                                      dynamo_backend="aot_eager" if compiled else "no")
            model = accelerator.prepare_model(model, evaluation_mode=True)  # placement, compile; no DDP
        inner = getattr(model, "_orig_mod", model)  # the module the compiled one runs
        broadcast_parameters(model)
        mode = make_mode(name, MODES[name])
        # (max_grad_norm: gossip steps each bucket in backward and clips it there; the others clip below)
        adamw = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
        unhooked = hooks(inner, adamw)
        optimizer = mode.build(model, adamw, max_grad_norm=CLIP)
        stepped = accelerator.prepare(optimizer) if accelerate else optimizer
        forward = mode.module_to_call(model)
        ckpt = mode.checkpointer(str(out / f"{name}_ckpt"), model, optimizer)  # (the module the mode is over)
        facts: dict = {"start": flat(inner), "norms": [], "loaded": 0, "built_hooks": hooks(inner, adamw) - unhooked,
                       "compiled": type(model).__name__ == "OptimizedModule"}
        start = 0
        if resume is not None:
            start = facts["loaded"] = ckpt.load_latest()
            facts["at_load"] = flat(inner)
        for step in range(start, steps):
            for micro in range(ACCUM):
                x, y = batch(step * ACCUM + micro)
                last = micro == ACCUM - 1
                if accelerate:
                    with accelerator.accumulate(model):
                        with contextlib.nullcontext() if accelerator.sync_gradients else mode.no_sync():
                            accelerator.backward(torch.nn.functional.mse_loss(forward(x), y))
                        if accelerator.sync_gradients:
                            mode.after_backward()
                            norm = mode.clip_grad_norm_(CLIP)
                            if norm is None:
                                norm = accelerator.clip_grad_norm_(model.parameters(), CLIP)
                            facts["norms"].append(float(norm))
                            stepped.step()
                            stepped.zero_grad()
                else:  # the reference: no Accelerate
                    with contextlib.nullcontext() if last else mode.no_sync():
                        (torch.nn.functional.mse_loss(forward(x), y) / ACCUM).backward()
                    if last:
                        mode.after_backward()
                        norm = mode.clip_grad_norm_(CLIP)
                        if norm is None:
                            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
                        facts["norms"].append(float(norm))
                        optimizer.step()
                        optimizer.zero_grad()
            if step + 1 == SAVE and run.endswith("_accelerate"):
                ckpt.save(SAVE)
                facts["at_save"] = flat(inner)
        mode.finish()
        facts["params"] = flat(inner)
        mode.close()
        facts["hooks_left"] = hooks(inner, adamw) - unhooked
        torch.save(facts, out / f"{run}.rank{rank}.pt")

    if what == "train":
        for name in MODES:
            train(name, False, f"{name}_loop")
            train(name, True, f"{name}_accelerate")
            train(name, True, f"{name}_resumed", seed=1, resume="latest")
    elif what == "compiled":  # a process of its own: AcceleratorState keeps the first Accelerator's backend
        for name in MODES:
            torch._dynamo.reset()  # each mode's compiled run from a clean dynamo (torch 2.6 crashed in the 4th)
            train(name, True, f"{name}_compiled", compiled=True)
    else:  # 3 ranks: the checkpoints whose state loads onto any world size, one step on
        for name in RESHARDED:
            train(name, True, f"{name}_reshard", seed=1, resume="latest", steps=SAVE + 1)
            facts = torch.load(out / f"{name}_reshard.rank{rank}.pt", weights_only=False)
            facts["world"] = world
            torch.save(facts, out / f"{name}_reshard.rank{rank}.pt")
    leave()


if __name__ == "__main__":
    _worker(Path(sys.argv[2]), sys.argv[1])
