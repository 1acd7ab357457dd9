"""Every ```` ```python ```` block of the README, and each integration's snippet
(docs/trainers.md), run verbatim; and the commands' ``--help`` in plain text.

The snippets are read at test time from the pages that show them: every block of
``README.md``, named by the heading above it (``README_BLOCKS``: the call after backward,
the overlapped mode with accumulation, the Hugging Face and Lightning trainers, the
``Membership``), and every block of ``docs/trainers.md`` ("In the trainers you already
use"), each named by the bold title above it (Hugging Face ``Trainer``, Accelerate,
Lightning, optimum-habana; its "Each mode, ready to copy" blocks run in the mode tests,
tests/mode_snippets.py). An edit that breaks one fails here; a new block on either page
without a harness below fails too.

Each runnable snippet's text, exactly as on its page, is executed (``exec`` of the
block compiled under that file's path and its own line numbers, so a traceback points
at the page and line, e.g. docs/trainers.md line 40) on 2 ranks: this file is the
torchrun script (``torchrun --standalone --nproc-per-node 2``, Gloo on CPU, one torch
thread per rank), launched from a temporary working directory as
tests/test_transformers.py and tests/test_lightning.py launch theirs, once per family of
snippets (``FAMILIES``: the snippets of one library run one after the other in the same
ranks, as a notebook runs two cells; each its own model, trainer and checks). The snippet runs in a namespace that holds
only the names it assumes but does not define (listed per snippet in ``ASSUMED``,
built by the ``prelude_*`` functions below: the user's model, data and optimizer);
``torch``, ``fastreduce``, ``contextlib`` and everything else it uses it must
import itself. A static test checks the same list before anything runs: every free
name of a block (symtable) is in its ``ASSUMED`` set. After the snippet, a
``postlude_*`` function checks what it should have done: every rank ends with
bit-identical parameters that training moved away from rank 0's initial ones (the
integrations start every rank from *different* weights, so rank 0's must have been
broadcast), the reducer ran as often as there were optimizer steps; the call after
backward ends where the same optimizer on the ranks' fp32 mean gradient ends (within
the bf16 wire's rounding), the overlapped example's last gradients are the ranks' mean
of the accumulated local gradients, and the trainers' ``"zero"`` runs train with the
sharded optimizer. The ``Membership`` block runs in 4 plain processes (this file again,
``membership``) joined through a coordinator the test serves: every member reaches the
last step with the same parameters, those of SGD on the members' mean gradient.

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
- The three-line illustration on docs/fused.md (``loss.backward()`` ...) is not one of
  these blocks and is not run.
"""

from __future__ import annotations

import ast
import builtins
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from readme_members import MEMBER_STEPS, MEMBERS, membership_reference_error
from readme_pages import (ASSUMED, EXAMPLES, MODE_BLOCKS, README, README_BLOCKS, ROOT, TITLES,  # noqa: F401
                          TRAINERS_PAGE, WORLD, blocks, free_names, relative, shown, snippets)

HF_REASON = "the hf extra (transformers, accelerate) is not installed: pip install 'fastreduce[hf]'"
LIGHTNING_REASON = "the lightning extra is not installed: pip install 'fastreduce[lightning]'"


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


@pytest.mark.timeout(60)
def test_command_help_is_plain_text() -> None:
    """Every ``fastreduce ... --help`` the README's commands lead to (the top level, each
    subcommand, each bench suite) reads as plain text: no rst roles (``:mod:`x```) or
    double-backquoted literals, which a terminal shows raw."""
    import argparse

    from fastreduce.cli import build_parser

    def helps(parser: argparse.ArgumentParser, name: str) -> list[tuple[str, str]]:
        out = [(name, parser.format_help())]  # (a subcommand's arguments are added here, on first use)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, subparser in action.choices.items():
                    out += helps(subparser, f"{name} {sub}")
        return out

    raw = [(name, line.strip()) for name, text in helps(build_parser(), "fastreduce") for line in text.splitlines()
           if "``" in line or re.search(r":[a-z]+:`", line)]
    assert not raw, "rst markup in --help:\n" + "\n".join(f"{name} --help: {line}" for name, line in raw)


def test_every_status_and_coordinator_command_in_the_docs_parses() -> None:
    """Each ``fastreduce status ...`` and ``fastreduce coordinator ...`` the README and docs/
    show (inline code, or a line of a code block) is a command line the parser takes: the
    coordinator is the status command's positional argument (docs/faults.md once showed
    ``fastreduce status --coordinator etcd://...``, which argparse refuses)."""
    import contextlib
    import io
    import shlex

    from fastreduce.cli import build_parser

    shown = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text()
        found = re.findall(r"`(fastreduce (?:status|coordinator)\b[^`]*)`", text)
        found += re.findall(r"(?m)^\s*(fastreduce (?:status|coordinator)\b[^#\n`]*)", text)
        shown += [(page.name, command.strip()) for command in found]
    assert any("status" in c for _, c in shown) and any("coordinator" in c for _, c in shown), shown
    refused = []
    for page, command in shown:
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                build_parser().parse_args(shlex.split(command.replace("{...}", "1"))[1:])  # (errors.md's blanks)
        except SystemExit:
            refused.append(f"{page}: `{command}`: {err.getvalue().strip().splitlines()[-1]}")
    assert not refused, "commands the parser refuses:\n" + "\n".join(refused)


# ============================================================== the snippets on 2 ranks

FAMILIES = {"plain": ("call", "quickstart"), "hf": ("hf_trainer", "readme_hf"), "accelerate": ("accelerate",),
            "lightning": ("lightning", "readme_lightning")}
"""The snippets launched together: one library's, each after the other in the same two ranks
(the interpreter, imports and process group started once; the Accelerate snippet alone:
its ``Accelerator(cpu=True, ...)`` is a per-process singleton the HF Trainer's would set)."""


def torchrun(names: str, cwd: Path, timeout: float) -> str:
    """Run this file's worker for the snippets ``names`` (comma-separated) on 2 ranks from
    ``cwd``; its output."""
    torchrun_bin = Path(sys.executable).with_name("torchrun")
    launcher = [str(torchrun_bin)] if torchrun_bin.exists() else [sys.executable, "-m", "torch.distributed.run"]
    cmd = [*launcher, "--standalone", "--nproc-per-node", str(WORLD), str(Path(__file__).resolve()), names, str(cwd)]
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
        pytest.fail(f"snippets {names} did not finish in {timeout:.0f}s; output:\n{out[-6000:]}")
    print(f"snippets {names}: torchrun took {time.perf_counter() - t0:.1f}s")
    assert proc.returncode == 0, f"snippets {names} failed (exit {proc.returncode}):\n{out[-8000:]}"
    return out


@pytest.fixture(scope="module")
def run_snippet(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict]:
    """``run_snippet(name)``: the facts its postlude reported, from its family's one launch (the
    launch's failure, if it failed, fails each of its snippets' tests)."""
    launched: dict[str, Path | BaseException] = {}

    def facts(name: str) -> dict:
        family = next(f for f, names in FAMILIES.items() if name in names)
        if family not in launched:
            cwd = tmp_path_factory.mktemp(family)
            try:
                torchrun(",".join(FAMILIES[family]), cwd, timeout=60 + 40 * len(FAMILIES[family]))
                launched[family] = cwd
            except BaseException as failed:  # pytest.fail's outcome too
                launched[family] = failed
        got = launched[family]
        if isinstance(got, BaseException):
            raise got
        return json.loads((got / f"facts-{name}.json").read_text())

    return facts


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


@pytest.mark.timeout(200)
def test_call(run_snippet: Callable[[str], dict]) -> None:
    """The README's first example, ``all_reduce_gradients`` after each backward: one
    reduction per step, and the parameters those of the same optimizer stepped on the
    ranks' mean gradient (computed here in fp32 from every rank's batches; the bf16 wire
    keeps them within 5% of how far training moved them, where a rank's own gradient or a
    sum instead of the mean moves them by about as much again)."""
    facts = run_snippet("call")
    check_common(facts)
    assert facts["reduces"] == facts["batches"] > 0, facts
    assert facts["err_vs_reference"] <= 0.05 * facts["moved"], facts


@pytest.mark.timeout(200)
def test_quickstart(run_snippet: Callable[[str], dict]) -> None:
    """The README's mode example: the overlapped reducer's loop, and gradient
    accumulation under ``no_sync()``."""
    facts = run_snippet("quickstart")
    check_common(facts)
    assert facts["reduces"] == facts["batches"] + 1, facts      # one per loop step, one after no_sync
    check_overlapped(facts)
    assert facts["grads_identical_across_ranks"], facts
    # the final reduce averaged the two accumulated micro-batches of every rank (bf16 wire)
    assert facts["grad_err_vs_mean"] <= 2e-2 * facts["grad_scale"], facts


@pytest.mark.timeout(200)
def test_readme_hf_trainer_zero(run_snippet: Callable[[str], dict]) -> None:
    """The README's Hugging Face block: ``fastreduce_mode="zero"`` trains with the sharded
    optimizer, every rank from rank 0's weights to the same parameters."""
    pytest.importorskip("transformers", reason=HF_REASON)
    pytest.importorskip("accelerate", reason=HF_REASON)
    facts = run_snippet("readme_hf")
    check_common(facts)
    assert facts["started_different"], facts
    assert facts["mode"] == "ZeroOptimizer" and facts["global_step"] == facts["max_steps"], facts


@pytest.mark.timeout(200)
def test_readme_lightning_zero(run_snippet: Callable[[str], dict]) -> None:
    """The README's Lightning block: ``strategy="fastreduce_zero"`` is known once
    fastreduce is imported and trains with the sharded optimizer."""
    pytest.importorskip("lightning", reason=LIGHTNING_REASON)
    facts = run_snippet("readme_lightning")
    check_common(facts)
    assert facts["started_different"], facts
    assert facts["optimizer"] == "ZeroOptimizer" and facts["global_step"] == facts["batches"] > 0, facts


@pytest.mark.timeout(240)
@pytest.mark.cell("loop", "train", membership=True, modes=("fused",))
def test_membership(tmp_path: Path) -> None:
    """The README's ``Membership`` block, verbatim, in 4 plain processes (not torchrun)
    joined through a coordinator served here: every member reaches the last step with the
    same parameters, those of SGD on the 4 members' mean gradient (fp32 here; the bf16
    wire within 5% of how far training moved them)."""
    from fastreduce.membership import serve

    store = serve(0, "127.0.0.1")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore",
               FASTREDUCE_COORDINATOR=f"127.0.0.1:{store.port}")
    procs = [subprocess.Popen([sys.executable, str(Path(__file__).with_name("readme_members.py")), str(tmp_path), str(i)],
                              cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for i in range(MEMBERS)]
    outs, deadline = [], time.monotonic() + 200
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)
        pytest.fail("the Membership snippet's members did not finish in 200 s:\n" +
                    "\n".join((p.communicate()[0] or "")[-3000:] for p in procs))
    for i, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"member {i} failed (exit {p.returncode}):\n{out[-6000:]}"
    facts = [json.loads((tmp_path / f"member{i}.json").read_text()) for i in range(MEMBERS)]
    assert sorted(f["rank"] for f in facts) == list(range(MEMBERS)) and {f["step"] for f in facts} == {MEMBER_STEPS}
    assert all(f["params"] == facts[0]["params"] for f in facts), "members ended with different parameters"
    err, moved = membership_reference_error(facts[0]["params"])
    assert err <= 0.05 * moved, (err, moved)


@pytest.mark.timeout(200)
def test_hf_trainer(run_snippet: Callable[[str], dict]) -> None:
    pytest.importorskip("transformers", reason=HF_REASON)
    pytest.importorskip("accelerate", reason=HF_REASON)
    facts = run_snippet("hf_trainer")
    check_common(facts)
    assert facts["started_different"], facts
    assert facts["wrapped"] == "GPT2LMHeadModel", facts          # no DDP wrapper
    assert facts["global_step"] == facts["max_steps"] and facts["reduces"] == facts["max_steps"], facts
    check_overlapped(facts)


@pytest.mark.timeout(200)
def test_accelerate(run_snippet: Callable[[str], dict]) -> None:
    pytest.importorskip("transformers", reason=HF_REASON)
    pytest.importorskip("accelerate", reason=HF_REASON)
    facts = run_snippet("accelerate")
    check_common(facts)
    assert facts["started_different"], facts
    assert facts["reduces"] == facts["sync_steps"] > 0, facts   # once per accumulation window
    assert facts["batches"] == 2 * facts["sync_steps"], facts


@pytest.mark.timeout(200)
def test_lightning(run_snippet: Callable[[str], dict]) -> None:
    pytest.importorskip("lightning", reason=LIGHTNING_REASON)
    facts = run_snippet("lightning")
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
          "batches": mine[:3], "loss_fn": nn.CrossEntropyLoss(),
          "x0": x0, "y0": y0, "x1": x1, "y1": y1}
    return ns, {"start": flat_params(net), "make_model": make_model}


def shards(world: int = WORLD, batches: int = 3) -> list[list[tuple[Any, Any]]]:
    """Every rank's batches of 4 (rank ``r``: ``shards()[r]``), from the example's data."""
    from train import make_data

    x, y = make_data(world * 4 * batches, 16, 4)
    return [[(x[i:i + 4], y[i:i + 4]) for i in range(r * 4, len(x), world * 4)] for r in range(world)]


def prelude_call() -> tuple[dict, dict]:
    import torch
    import torch.nn as nn
    from train import make_model

    torch.manual_seed(0)
    net = make_model(dim=16, hidden=32, classes=4, depth=1)
    start = {k: v.clone() for k, v in net.state_dict().items()}
    ns = {"Net": lambda: net, "batches": shards()[RANK], "loss_fn": nn.CrossEntropyLoss()}
    return ns, {"start": flat_params(net), "start_state": start, "make_model": make_model}


def postlude_call(ns: dict, ctx: dict) -> dict:
    """The same optimizer, from the same start, stepped on the fp32 mean of every rank's
    gradient: how far the snippet's parameters are from it, and how far training moved."""
    import torch

    import fastreduce

    model, opt = ns["model"], ns["opt"]
    ref = ctx["make_model"](dim=16, hidden=32, classes=4, depth=1)
    ref.load_state_dict(ctx["start_state"])
    ref_opt = type(opt)(ref.parameters(), **opt.defaults)
    for step in range(len(ns["batches"])):
        grads = []
        for rank_batches in shards():
            ref.zero_grad()
            x, y = rank_batches[step]
            ns["loss_fn"](ref(x), y).backward()
            grads.append([p.grad.clone() for p in ref.parameters()])
        for p, *gs in zip(ref.parameters(), *grads):
            p.grad = torch.stack(gs).mean(0)
        ref_opt.step()
    want = flat_params(ref)
    facts = common_facts(model, ctx["start"])
    facts.update(reduces=fastreduce.gradient_reducer(model).stats.calls, batches=len(ns["batches"]),
                 err_vs_reference=(flat_params(model) - want).abs().max().item(),
                 moved=(want - ctx["start"]).abs().max().item())
    return facts


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


def prelude_readme_hf() -> tuple[dict, dict]:
    return prelude_hf_trainer()


def postlude_readme_hf(ns: dict, ctx: dict) -> dict:
    trainer = ns["trainer"]
    facts = common_facts(ns["model"], ctx["start"])
    facts.update(mode=type(trainer.fastreduce_mode.obj).__name__, global_step=trainer.state.global_step,
                 max_steps=trainer.args.max_steps)
    return facts


def prelude_readme_lightning() -> tuple[dict, dict]:
    return prelude_lightning()


def postlude_readme_lightning(ns: dict, ctx: dict) -> dict:
    model, trainer = ns["model"], ns["trainer"]
    facts = common_facts(model, ctx["start"])
    facts.update(optimizer=type(trainer.optimizers[0]).__name__, global_step=trainer.global_step,
                 batches=model.batches)
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


def worker(names: str, out: Path) -> None:
    """One rank: for each snippet of ``names`` in turn, build the assumed names, run the page's
    block verbatim, check, report."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    sys.path.insert(0, str(EXAMPLES))  # the examples' models and data
    for name in names.split(","):
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
            (out / f"facts-{name}.json").write_text(json.dumps(facts, indent=1))
            print(f"snippet {name} ({shown(path, first)}): {facts}", flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    worker(sys.argv[1], Path(sys.argv[2]))
