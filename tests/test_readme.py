"""The README's quick start and each integration's snippet (docs/trainers.md), run verbatim.

The snippets are read at test time from the pages that show them: the first
```` ```python ```` block under "## Quick start" of ``README.md`` (the quick start), and
every ```` ```python ```` block of ``docs/trainers.md`` ("In the trainers you already
use"), each named by the bold title above it (Hugging Face ``Trainer``, Accelerate,
Lightning, optimum-habana). An edit that breaks one fails here; a new block on the
trainers page without a harness below fails too.

Each runnable snippet's text, exactly as on its page, is executed (``exec`` of the
block compiled under that file's path and its own line numbers, so a traceback points
at the page and line, e.g. docs/trainers.md line 40) on 2 ranks: this file is the
torchrun script (``torchrun --standalone --nproc-per-node 2``, Gloo on CPU, one torch
thread per rank), launched once per snippet from a temporary working directory, as
tests/test_transformers.py and tests/test_lightning.py launch theirs. The snippet runs in a namespace that holds
only the names it assumes but does not define (listed per snippet in ``ASSUMED``,
built by the ``prelude_*`` functions below: the user's model, data and optimizer);
``torch``, ``fastreduce``, ``contextlib`` and everything else it uses it must
import itself. A static test checks the same list before anything runs: every free
name of a block (symtable) is in its ``ASSUMED`` set. After the snippet, a
``postlude_*`` function checks what it should have done: every rank ends with
bit-identical parameters that training moved away from rank 0's initial ones (the
integrations start every rank from *different* weights, so rank 0's must have been
broadcast), the reducer ran as often as there were optimizer steps, and for the quick
start the last gradients are the ranks' mean of the accumulated local gradients.

Not run here, and why:

- optimum-habana's snippet needs ``GaudiTrainer``, i.e. Habana's software
  (``optimum.habana``'s package ``__init__`` runs ``check_synapse_version()``), and
  ``GaudiTrainingArguments(..., distribution_strategy="fast_ddp")`` is a fragment
  (``...`` stands for the user's arguments). What is checked instead: the block
  parses as written (``...`` is Python's Ellipsis, so no placeholder needs replacing),
  its free names are the assumed ones, every name it imports from fastreduce exists,
  ``install()`` accepts the call the snippet's comment shows, and, where
  optimum-habana's files are installed (``make install``), on those real files
  (``ast``, nothing imported): ``optimum.habana`` exports ``GaudiTrainer`` and
  ``GaudiTrainingArguments``, ``GaudiTrainer.__init__`` takes the snippet's keywords,
  and ``distribution_strategy`` offers ``"fast_ddp"``. tests/test_optimum_habana.py
  runs the trainer's ``fast_ddp`` statements on real ranks.
- The three-line illustration at the README's top (``loss.backward()`` ...), repeated
  on docs/fused.md, is not one of these blocks and is not run.
"""

from __future__ import annotations

import ast
import builtins
import json
import os
import re
import signal
import subprocess
import symtable
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TRAINERS_PAGE = ROOT / "docs" / "trainers.md"
EXAMPLES = ROOT / "examples"
WORLD = 2
QUICKSTART = "## Quick start"  # README.md: the first ```python block under this heading
TITLES = {  # bold title above a block of TRAINERS_PAGE -> the snippet's name here
    "**Hugging Face": "hf_trainer", "**Accelerate": "accelerate", "**Lightning": "lightning",
    "**optimum-habana": "optimum_habana",
}
# The names each snippet uses without defining them: what a user's script has already.
ASSUMED: dict[str, set[str]] = {
    "quickstart": {"Net", "batches", "loss_fn", "opt", "x0", "y0", "x1", "y1"},
    "hf_trainer": {"model", "training_args", "ds"},
    "accelerate": {"accelerator", "model", "optimizer", "loader"},
    "lightning": {"model", "train_loader"},
    "optimum_habana": {"model", "gaudi_config", "ds", "GaudiTrainer", "GaudiTrainingArguments"},
}
RUNNABLE = ("quickstart", "hf_trainer", "accelerate", "lightning")
HF_REASON = "the hf extra (transformers, accelerate) is not installed: pip install 'fastreduce[hf]'"
LIGHTNING_REASON = "the lightning extra is not installed: pip install 'fastreduce[lightning]'"


# ============================================================== reading the pages

def blocks(page: Path) -> list[tuple[str, str, int, str]]:
    """Every ```python block of ``page``: ``(heading above, bold title above, first line's
    number, text)``. Headings and titles inside other code blocks do not count."""
    lines = page.read_text().splitlines()
    found: list[tuple[str, str, int, str]] = []
    heading, title, i = "", "", 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            if line.strip() == "```python":
                found.append((heading, title, i + 2, "\n".join(lines[i + 1:end]) + "\n"))
            i = end
        elif re.match(r"#{1,6} ", line):
            heading, title = line.strip(), ""
        elif line.startswith("**"):
            title = line
        i += 1
    return found


def snippets(readme: Path = README, trainers: Path = TRAINERS_PAGE) -> dict[str, tuple[Path, int, str]]:
    """``{name: (the page it is on, its first line's number there, the block's text)}``."""
    found: dict[str, tuple[Path, int, str]] = {}
    quick = [b for b in blocks(readme) if b[0] == QUICKSTART]
    assert quick, f"no ```python block under {QUICKSTART!r} in {readme}"
    found["quickstart"] = (readme, *quick[0][2:])
    where = relative(trainers)
    for _, title, first, text in blocks(trainers):
        name = next((n for prefix, n in TITLES.items() if title.startswith(prefix)), None)
        assert name is not None, f"{where}:{first}: a ```python block ({title!r}) has no harness here"
        assert name not in found, f"{where}:{first}: a second block for {name}"
        found[name] = (trainers, first, text)
    missing = set(TITLES.values()) - set(found)
    assert not missing, f"no ```python block found in {where} for {sorted(missing)}"
    return found


def relative(path: Path) -> Path:
    """``path`` from the repository's root (as given, if outside it)."""
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def shown(path: Path, first: int) -> str:
    """``README.md:42``, ``docs/trainers.md:17``: where a block is, as a reader finds it."""
    return f"{relative(path)}:{first}"


def free_names(text: str) -> set[str]:
    """Names the block reads but neither assigns, imports nor gets from builtins."""
    top = symtable.symtable(text, "<snippet>", "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    used: set[str] = set()

    def walk(table: symtable.SymbolTable) -> None:
        for s in table.get_symbols():
            if s.is_referenced() and (table is top or s.is_global()):
                used.add(s.get_name())
        for child in table.get_children():
            walk(child)

    walk(top)
    return used - bound - set(dir(builtins))


# ============================================================== static checks (no ranks)

@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", sorted(ASSUMED))
def test_snippet_parses_and_assumes_only_the_listed_names(name: str) -> None:
    """A name the block uses and nobody defines (a missing ``import torch``) fails here,
    before any rank starts, with the page and line."""
    path, first, text = snippets()[name]
    ast.parse(text, filename=shown(path, first))
    extra = free_names(text) - ASSUMED[name]
    assert not extra, (f"the block at {shown(path, first)} ({name}) uses {sorted(extra)} without defining or "
                       f"importing them; a user's script assumed to provide only {sorted(ASSUMED[name])}")


@pytest.mark.timeout(60)
def test_optimum_habana_snippet_statically() -> None:
    """What can be checked of optimum-habana's snippet without Habana's software (see the
    module docstring): fastreduce's side exists and takes the call, and optimum-habana's
    real files offer the class, keywords and strategy value it names."""
    import importlib
    import importlib.util
    import inspect

    import torch

    path, first, text = snippets()["optimum_habana"]
    where = shown(path, first)
    tree = ast.parse(text)
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("fastreduce")]
    assert imports, f"{where}: the optimum-habana block imports nothing from fastreduce"
    for node in imports:
        module = importlib.import_module(node.module)
        for alias in node.names:
            assert hasattr(module, alias.name) or importlib.util.find_spec(f"{node.module}.{alias.name}"), \
                f"{where}: from {node.module} import {alias.name}: no such name"
    from fastreduce.integrations import optimum_habana

    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    assert any(isinstance(c.func, ast.Attribute) and c.func.attr == "install" for c in calls)
    sig = inspect.signature(optimum_habana.install)
    sig.bind()                                          # the snippet's call
    sig.bind(fusion_buffer_dtype=torch.float32)         # the call its comment shows
    assert callable(optimum_habana.uninstall)

    # the trainer call's keywords and the strategy value, against optimum-habana's real files
    trainer_kw = {k.arg for c in calls if getattr(c.func, "id", "") == "GaudiTrainer" for k in c.keywords}
    args_kw = {k.arg: ast.literal_eval(k.value) for c in calls if getattr(c.func, "id", "") == "GaudiTrainingArguments"
               for k in c.keywords}
    assert args_kw == {"distribution_strategy": "fast_ddp"} and {"model", "args"} <= trainer_kw, (trainer_kw, args_kw)
    from test_optimum_habana import SITE  # locates optimum-habana's files (make install puts them in .venv)

    if SITE is None:
        pytest.skip("optimum-habana's files are not installed (`make install`): fastreduce's side checked only")
    spec = None if SITE else importlib.util.find_spec("optimum")  # "": the venv's own optimum namespace
    roots = [Path(SITE) / "optimum"] if SITE else [Path(p) for p in spec.submodule_search_locations]
    base = next(r / "habana" for r in roots if (r / "habana" / "transformers" / "trainer.py").is_file())
    exported = {a.asname or a.name for n in ast.walk(ast.parse((base / "__init__.py").read_text()))
                if isinstance(n, ast.ImportFrom) for a in n.names}
    assert {"GaudiTrainer", "GaudiTrainingArguments"} <= exported
    trainer_init = next(f for c in ast.walk(ast.parse((base / "transformers" / "trainer.py").read_text()))
                        if isinstance(c, ast.ClassDef) and c.name == "GaudiTrainer"
                        for f in c.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
    assert trainer_kw <= {a.arg for a in trainer_init.args.args + trainer_init.args.kwonlyargs}
    args_src = (base / "transformers" / "training_args.py").read_text()
    field = next(n for n in ast.walk(ast.parse(args_src))
                 if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "distribution_strategy")
    assert "fast_ddp" in ast.literal_eval(next(k.value for k in field.value.keywords if k.arg == "metadata"))["choices"]


# ============================================================== the snippets on 2 ranks

def torchrun(name: str, cwd: Path, timeout: float) -> str:
    """Run this file's worker for snippet ``name`` on 2 ranks from ``cwd``; its output."""
    torchrun_bin = Path(sys.executable).with_name("torchrun")
    launcher = [str(torchrun_bin)] if torchrun_bin.exists() else [sys.executable, "-m", "torch.distributed.run"]
    cmd = [*launcher, "--standalone", "--nproc-per-node", str(WORLD), str(Path(__file__).resolve()), name, str(cwd)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"snippet {name} did not finish in {timeout:.0f}s; output:\n{out[-6000:]}")
    print(f"snippet {name}: torchrun took {time.perf_counter() - t0:.1f}s")
    assert proc.returncode == 0, f"snippet {name} failed (exit {proc.returncode}):\n{out[-8000:]}"
    return out


def run_snippet(name: str, tmp_path: Path, timeout: float = 100) -> dict:
    torchrun(name, tmp_path, timeout)
    return json.loads((tmp_path / "facts.json").read_text())


def check_common(facts: dict) -> None:
    assert facts["params_identical_across_ranks"], "ranks ended with different parameters"
    assert facts["moved_from_rank0_start"], "training did not move the parameters"


def check_overlapped(facts: dict) -> None:
    """overlap=True at bucket_mb="auto": over a process group the buckets went out in backward;
    on shared memory one bucket, sent after backward as the fused mode does."""
    if "shared memory" in facts["sizing"]:
        assert facts["launched_in_backward"] == 0 and "one bucket" in facts["sizing"], facts
    else:
        assert facts["launched_in_backward"] > 0, facts


@pytest.mark.timeout(120)
def test_quickstart(tmp_path: Path) -> None:
    """The API quick start: both drop-in calls, the overlapped object form's loop, and
    gradient accumulation under ``no_sync()``."""
    facts = run_snippet("quickstart", tmp_path)
    check_common(facts)
    assert facts["reduces"] == facts["batches"] + 1, facts      # one per loop step, one after no_sync
    check_overlapped(facts)
    assert facts["grads_identical_across_ranks"], facts
    # the final reduce averaged the two accumulated micro-batches of every rank (bf16 wire)
    assert facts["grad_err_vs_mean"] <= 2e-2 * facts["grad_scale"], facts


@pytest.mark.timeout(120)
def test_hf_trainer(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason=HF_REASON)
    pytest.importorskip("accelerate", reason=HF_REASON)
    facts = run_snippet("hf_trainer", tmp_path)
    check_common(facts)
    assert facts["started_different"], facts
    assert facts["wrapped"] == "GPT2LMHeadModel", facts          # no DDP wrapper
    assert facts["global_step"] == facts["max_steps"] and facts["reduces"] == facts["max_steps"], facts
    check_overlapped(facts)


@pytest.mark.timeout(120)
def test_accelerate(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason=HF_REASON)
    pytest.importorskip("accelerate", reason=HF_REASON)
    facts = run_snippet("accelerate", tmp_path)
    check_common(facts)
    assert facts["started_different"], facts
    assert facts["reduces"] == facts["sync_steps"] > 0, facts   # once per accumulation window
    assert facts["batches"] == 2 * facts["sync_steps"], facts


@pytest.mark.timeout(120)
def test_lightning(tmp_path: Path) -> None:
    pytest.importorskip("lightning", reason=LIGHTNING_REASON)
    facts = run_snippet("lightning", tmp_path)
    check_common(facts)
    assert facts["started_different"], facts
    assert facts["not_wrapped"], facts
    assert facts["global_step"] > 0 and facts["reduces"] == facts["global_step"], facts
    assert facts["batches"] == 2 * facts["global_step"], facts   # accumulate_grad_batches=2


# ============================================================== the torchrun worker
# Each prelude returns (the namespace the snippet runs in: exactly its ASSUMED names,
# context for the postlude); each postlude returns the facts the test checks. Models
# and data come from the examples (tiny sizes), as a user's script would have them.

RANK = int(os.environ.get("RANK", "0"))


def flat_params(model: Any) -> Any:
    import torch

    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])


def same_across_ranks(t: Any) -> bool:
    import torch
    import torch.distributed as dist

    ref = t.clone()
    dist.broadcast(ref, src=0)
    same = torch.tensor([float(torch.equal(t, ref))])
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same.item())


def common_facts(model: Any, start: Any) -> dict:
    """Parameters identical on every rank; moved away from rank 0's start; each rank's
    own start differed from rank 0's (so rank 0's were broadcast)."""
    import torch
    import torch.distributed as dist

    start0 = start.clone()
    dist.broadcast(start0, src=0)
    own = torch.tensor([float(not torch.equal(start, start0))])
    dist.all_reduce(own, op=dist.ReduceOp.MAX)
    params = flat_params(model)
    return {"params_identical_across_ranks": same_across_ranks(params),
            "moved_from_rank0_start": not torch.allclose(params, start0),
            "started_different": bool(own.item())}


def prelude_quickstart() -> tuple[dict, dict]:
    import torch
    import torch.nn as nn
    from train import make_data, make_model

    torch.manual_seed(0)  # Net(): the same weights on every rank, as a user seeds them (nothing here broadcasts)
    net = make_model(dim=16, hidden=32, classes=4, depth=1)
    x, y = make_data(WORLD * 4 * 5, 16, 4)
    mine = [(x[i:i + 4], y[i:i + 4]) for i in range(RANK * 4, len(x), WORLD * 4)]  # this rank's shard, 5 batches
    (x0, y0), (x1, y1) = mine[3], mine[4]
    ns = {"Net": lambda: net,                                    # Net().to(device) is this model
          "opt": torch.optim.SGD(net.parameters(), lr=0.1),      # an optimizer over its parameters
          "batches": mine[:3], "loss_fn": nn.CrossEntropyLoss(),
          "x0": x0, "y0": y0, "x1": x1, "y1": y1}
    return ns, {"start": flat_params(net), "make_model": make_model}


def postlude_quickstart(ns: dict, ctx: dict) -> dict:
    import torch
    import torch.distributed as dist

    model, reducer = ns["model"], ns["reducer"]
    assert ns["opt"].param_groups[0]["params"][0] is next(model.parameters())
    # reference: this rank's grads of the two micro-batches at the final parameters, averaged in fp32
    ref = ctx["make_model"](dim=16, hidden=32, classes=4, depth=1)
    ref.load_state_dict(model.state_dict())
    (ns["loss_fn"](ref(ns["x0"]), ns["y0"]) + ns["loss_fn"](ref(ns["x1"]), ns["y1"])).backward()
    mean = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
    dist.all_reduce(mean)
    mean /= dist.get_world_size()
    grads = torch.cat([p.grad.reshape(-1).float() for p in model.parameters()])
    facts = common_facts(model, ctx["start"])
    facts.update(reduces=reducer.stats.calls, batches=len(ns["batches"]),
                 launched_in_backward=reducer.stats.launched_in_backward, sizing=reducer.stats.sizing.describe(),
                 copied_in=reducer.stats.reattached, preattached=reducer.stats.preattached,  # reported, not checked
                 grads_identical_across_ranks=same_across_ranks(grads),
                 grad_err_vs_mean=(grads - mean).abs().max().item(), grad_scale=mean.abs().max().item())
    return facts


def prelude_hf_trainer() -> tuple[dict, dict]:
    import torch
    from hf_trainer import Progressions
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(RANK)  # ranks differ on purpose: the trainer must broadcast rank 0's weights
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64,
                                       bos_token_id=0, eos_token_id=0))
    training_args = TrainingArguments(output_dir="hf-out", use_cpu=True, max_steps=4, per_device_train_batch_size=4,
                                      gradient_accumulation_steps=2, learning_rate=3e-3, max_grad_norm=1.0,
                                      save_strategy="no", report_to="none", logging_steps=2, seed=0,
                                      dataloader_num_workers=0)
    return ({"model": model, "training_args": training_args, "ds": Progressions(128)},
            {"start": flat_params(model)})


def postlude_hf_trainer(ns: dict, ctx: dict) -> dict:
    trainer = ns["trainer"]
    reducer = trainer.fastreduce_reducer
    facts = common_facts(ns["model"], ctx["start"])
    facts.update(wrapped=type(trainer.model_wrapped).__name__, global_step=trainer.state.global_step,
                 max_steps=trainer.args.max_steps, reduces=reducer.stats.calls,
                 launched_in_backward=reducer.stats.launched_in_backward, sizing=reducer.stats.sizing.describe())
    return facts


def prelude_accelerate() -> tuple[dict, dict]:
    import torch
    from accelerate import Accelerator
    from hf_trainer import Progressions
    from torch.utils.data import DataLoader
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)  # CPU ranks run together only with cpu=True
    torch.manual_seed(RANK)  # ranks differ on purpose: broadcast_parameters gives them rank 0's
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64,
                                       bos_token_id=0, eos_token_id=0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = DataLoader(Progressions(WORLD * 8 * 4), batch_size=4)  # prepared: 8 micro-batches per rank
    return ({"accelerator": accelerator, "model": model, "optimizer": optimizer, "loader": loader},
            {"start": flat_params(model)})


def postlude_accelerate(ns: dict, ctx: dict) -> dict:
    facts = common_facts(ns["model"], ctx["start"])
    batches = len(ns["loader"])
    facts.update(reduces=ns["reducer"].stats.calls, batches=batches, sync_steps=batches // 2)
    return facts


def prelude_lightning() -> tuple[dict, dict]:
    import torch
    from lightning_train import Classifier, make_data
    from torch.utils.data import DataLoader, TensorDataset

    class OneEpoch(Classifier):
        """The example's classifier, stopping after one epoch (the snippet sets no
        max_epochs, and Lightning's default is 1000) and counting its batches."""

        batches = 0

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.batches += 1

        def on_train_epoch_end(self):
            self.trainer.should_stop = True

    torch.manual_seed(RANK)  # ranks differ on purpose: the strategy must broadcast rank 0's weights
    model = OneEpoch(dim=16, hidden=32, classes=4, depth=1)
    train_loader = DataLoader(TensorDataset(*make_data(WORLD * 8 * 8, 16, 4)), batch_size=8)  # 8 per rank (its sampler)
    return {"model": model, "train_loader": train_loader}, {"start": flat_params(model)}


def postlude_lightning(ns: dict, ctx: dict) -> dict:
    model, trainer = ns["model"], ns["trainer"]
    facts = common_facts(model, ctx["start"])
    facts.update(not_wrapped=trainer.strategy.model is model, global_step=trainer.global_step,
                 reduces=trainer.strategy.reducer.stats.calls, batches=model.batches)
    return facts


def worker(name: str, out: Path) -> None:
    """One rank: build the assumed names, run the page's block verbatim, check, report."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    sys.path.insert(0, str(EXAMPLES))  # the examples' models and data
    prelude: Callable[[], tuple[dict, dict]] = globals()[f"prelude_{name}"]
    postlude: Callable[[dict, dict], dict] = globals()[f"postlude_{name}"]
    ns, ctx = prelude()
    assert set(ns) == ASSUMED[name], (sorted(ns), sorted(ASSUMED[name]))
    path, first, text = snippets()[name]
    code = compile("\n" * (first - 1) + text, str(path), "exec")  # tracebacks name the page and its lines
    ns = {"__name__": "__main__", "__builtins__": builtins, **ns}
    exec(code, ns)
    facts = postlude(ns, ctx)
    if dist.get_rank() == 0:
        (out / "facts.json").write_text(json.dumps(facts, indent=1))
        print(f"snippet {name} ({shown(path, first)}): {facts}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown, as the examples do


if __name__ == "__main__":
    worker(sys.argv[1], Path(sys.argv[2]))
