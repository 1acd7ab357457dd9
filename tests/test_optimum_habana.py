"""optimum-habana: ``install()`` puts fastreduce behind ``GaudiTrainer``'s ``fast_ddp`` path.

What these tests exercise on a CPU machine without Gaudi, and what they do not:

- Exercised, on optimum-habana 1.21.2's real files (``make install`` puts them, with
  ``optimum`` 2.0.0 whose logging they import, in ``.venv/optimum-habana`` by
  ``pip install --no-deps --target``; optimum-habana's dependencies pin
  transformers<4.56, older than the one the ``hf`` extra installs):
  ``optimum/habana/distributed/__init__.py`` and ``fast_ddp.py`` are imported and run
  as they are; ``install()`` and ``uninstall()`` act on them. On two real Gloo ranks,
  the trainer's own ``fast_ddp`` statements, compiled from the real
  ``transformers/trainer.py`` (the ``if`` that runs
  ``from ..distributed import all_reduce_gradients`` and broadcasts rank 0's
  parameters, and the ``if`` that calls ``all_reduce_gradients(model,
  use_hpu_graphs=True)`` on a sync step), run after each micro-step's backward with
  gradient accumulation, and the gradients are checked against a ``dist.all_reduce``
  mean (no collective is mocked). An ``ast`` check on the real ``trainer.py`` and
  ``accelerate/accelerator.py`` pins the import, the broadcast, the call and its
  arguments, and that nothing else in the package imports the function, so an
  optimum-habana that moves any of them fails here. The error ``install()`` raises is
  checked against the real failing ``import optimum.habana`` and against none installed.
- Not exercised here: ``optimum/habana/__init__.py`` (it imports ``GaudiTrainer``,
  which needs that older transformers and Habana's modules, and runs
  ``check_synapse_version()``, which needs ``habana-torch-plugin``): the rank tests put
  a package module object with the real directory as its ``__path__`` in its place,
  and ``__init__.py`` is the only file not run. The trainer's surroundings (its
  ``args``, ``ParallelMode``, logger, data loop, optimizer) are stand-ins. Where
  ``habana_frameworks`` imports, the real ``optimum.habana`` is imported instead. A
  whole ``GaudiTrainer.train()`` (HPU graphs, HCCL, lazy mode): only on Gaudi, not run.

Skipped, with the reason, when optimum-habana's files are not found.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fastreduce.launch import run_ranks

ROOT = Path(__file__).resolve().parents[1]
VERSION = "1.21.2"
SITE_ENV = "FASTREDUCE_OPTIMUM_HABANA_SITE"
pytestmark = pytest.mark.timeout(180)


# ---------------------------------------------------------------------- locating the real files

def _site() -> str | None:
    """A directory to put on ``sys.path`` that holds ``optimum/habana`` (``""`` when the
    venv already finds it), or ``None`` when optimum-habana's files are nowhere."""
    for candidate in (os.environ.get(SITE_ENV), str(Path(sys.prefix) / "optimum-habana"),
                      str(ROOT / ".venv" / "optimum-habana")):
        if candidate and (Path(candidate) / "optimum/habana/distributed/fast_ddp.py").is_file():
            return candidate
    try:
        spec = importlib.util.find_spec("optimum")  # a namespace package: imports nothing of optimum-habana
    except (ImportError, ValueError):
        spec = None
    paths = list(spec.submodule_search_locations or []) if spec is not None else []
    if any((Path(p) / "habana/distributed/fast_ddp.py").is_file() for p in paths):
        return ""
    return None


SITE = _site()
needs_files = pytest.mark.skipif(
    SITE is None, reason=f"optimum-habana's files are not installed: `make install` puts optimum-habana=={VERSION} "
    "in .venv/optimum-habana (pip install --no-deps --target; or set $" + SITE_ENV + ")")


def _package_dir(site: str) -> Path:
    if site:
        return Path(site) / "optimum" / "habana"
    spec = importlib.util.find_spec("optimum")
    return next(Path(p) / "habana" for p in spec.submodule_search_locations
                if (Path(p) / "habana/distributed/fast_ddp.py").is_file())


def _load(site: str) -> str:
    """Make ``optimum.habana.distributed`` importable from the real files (run in a
    fresh rank process); return how ``optimum.habana`` itself got there."""
    if site and site not in sys.path:
        sys.path.insert(0, site)
    if importlib.util.find_spec("habana_frameworks") is not None:
        importlib.import_module("optimum.habana")  # Gaudi: the real package, __init__ and all
        return "real package"
    # Without Habana's software the package __init__ cannot import (it imports the
    # trainers and runs check_synapse_version()): register the package from its real
    # directory without executing __init__.py; every submodule is then the real file.
    import optimum

    directory = _package_dir(site)
    spec = importlib.util.spec_from_file_location("optimum.habana", directory / "__init__.py",
                                                  submodule_search_locations=[str(directory)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["optimum.habana"] = module
    optimum.habana = module
    return "package __init__ not run"


# ---------------------------------------------------------------------- the trainer's code, by ast

def _fast_ddp_compare(node: ast.AST) -> bool:
    """``<...>.distribution_strategy == "fast_ddp"`` somewhere in ``node``."""
    return any(isinstance(n, ast.Compare) and isinstance(n.left, ast.Attribute)
               and n.left.attr == "distribution_strategy" and len(n.ops) == 1 and isinstance(n.ops[0], ast.Eq)
               and isinstance(n.comparators[0], ast.Constant) and n.comparators[0].value == "fast_ddp"
               for n in ast.walk(node))


def _trainer_sites(trainer_py: Path) -> dict[str, Any]:
    """The fast_ddp statements of ``GaudiTrainer._inner_training_loop``: the ``if`` that
    imports ``all_reduce_gradients`` (and broadcasts), and the ``if`` that calls it.
    Asserts what ``install()`` relies on; a moved call site fails here."""
    tree = ast.parse(trainer_py.read_text(), filename=str(trainer_py))
    trainer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GaudiTrainer")
    loop = next(n for n in trainer.body if isinstance(n, ast.FunctionDef) and n.name == "_inner_training_loop")

    imports = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
               and any(a.name == "all_reduce_gradients" for a in n.names)]
    assert len(imports) == 1, f"expected one import of all_reduce_gradients in trainer.py, found {len(imports)}"
    imp = imports[0]
    assert (imp.module, imp.level) == ("distributed", 2), ast.unparse(imp)  # optimum.habana.distributed
    assert [(a.name, a.asname) for a in imp.names] == [("all_reduce_gradients", None)], ast.unparse(imp)
    assert any(n is imp for n in ast.walk(loop)), "the import is not inside _inner_training_loop (run per train())"

    ifs = [n for n in ast.walk(loop) if isinstance(n, ast.If)]
    import_if = next(n for n in ifs if imp in n.body)
    assert _fast_ddp_compare(import_if.test), ast.unparse(import_if.test)
    broadcast = [n for n in ast.walk(import_if) if isinstance(n, ast.For)
                 and ast.unparse(n.iter) == "model.parameters()"
                 and "torch.distributed.broadcast(param.data, src=0)" in ast.unparse(n)]
    assert broadcast and broadcast[0].lineno > imp.lineno, "rank 0's parameters are no longer broadcast with the import"

    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id == "all_reduce_gradients"]
    assert len(calls) == 1, f"expected one call of all_reduce_gradients in trainer.py, found {len(calls)}"
    call = calls[0]
    assert [ast.unparse(a) for a in call.args] == ["model"], ast.unparse(call)
    assert [(k.arg, ast.unparse(k.value)) for k in call.keywords] == [("use_hpu_graphs", "True")], ast.unparse(call)
    call_if = next(n for n in ifs if any(isinstance(s, ast.Expr) and s.value is call for s in n.body))
    assert _fast_ddp_compare(call_if.test) and "do_sync_step" in ast.unparse(call_if.test), ast.unparse(call_if.test)
    assert call_if.lineno > import_if.lineno

    # backward comes first: the statement before the call's `if` runs self.training_step
    body = next(n for n in ast.walk(loop) if isinstance(getattr(n, "body", None), list) and call_if in n.body).body
    before = body[body.index(call_if) - 1]
    assert "self.training_step(" in ast.unparse(before), ast.unparse(before)
    return {"import_if": import_if, "call_if": call_if, "call": ast.unparse(call), "import": ast.unparse(imp),
            "import_line": imp.lineno, "call_line": call.lineno}


def _compile_site(trainer_py: Path, node: ast.stmt):
    module = ast.Module(body=[node], type_ignores=[])
    return compile(module, str(trainer_py), "exec")  # keeps trainer.py's line numbers in tracebacks


# ---------------------------------------------------------------------- ranks

def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _rank_fast_ddp(rank: int, world: int, site: str, install_kwargs: dict, steps: int, accumulate: int) -> dict:
    import torch.distributed as dist

    how = _load(site)
    from fastreduce.integrations import optimum_habana as integration

    integration.install(**install_kwargs)
    trainer_py = _package_dir(site) / "transformers" / "trainer.py"
    sites = _trainer_sites(trainer_py)
    import_if = _compile_site(trainer_py, sites["import_if"])
    call_if = _compile_site(trainer_py, sites["call_if"])

    torch.manual_seed(1000 + rank)  # each rank its own weights: the trainer's broadcast must equalise them
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    spread_before = _spread(_flat(model))

    import logging
    args = SimpleNamespace(parallel_mode="distributed", distribution_strategy="fast_ddp", world_size=world)
    ns: dict[str, Any] = {"__name__": "optimum.habana.transformers.trainer",
                          "__package__": "optimum.habana.transformers",  # resolves `from ..distributed import`
                          "torch": torch, "logger": logging.getLogger("optimum.habana.transformers.trainer"),
                          "ParallelMode": SimpleNamespace(DISTRIBUTED="distributed"),
                          "self": SimpleNamespace(args=args), "args": args, "model": model}
    exec(import_if, ns)  # the trainer's: from ..distributed import all_reduce_gradients; broadcast
    package = sys.modules["optimum.habana.distributed"]
    got_ours = ns["all_reduce_gradients"] is package.all_reduce_gradients and integration.installed()
    spread_after = _spread(_flat(model))

    reference = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.zero_grad(set_to_none=False)  # GaudiTrainer._zero_model_grad under fast_ddp
    errors, calls = [], []
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        reference.load_state_dict(model.state_dict())
        reference.zero_grad(set_to_none=True)
        for micro in range(accumulate):
            x, y = torch.randn(8, 12, generator=gen), torch.randint(0, 3, (8,), generator=gen)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            torch.nn.functional.cross_entropy(reference(x), y).backward()
            ns["do_sync_step"] = micro == accumulate - 1
            exec(call_if, ns)  # the trainer's: if ... and do_sync_step: all_reduce_gradients(model, use_hpu_graphs=True)
        for p in reference.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        want = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
        errors.append(((got - want).abs().max() / want.abs().max()).item())
        reducers = list(model.__dict__.get("_fastreduce_reducers", {}).values())
        calls.append(sum(r.stats.calls for r in reducers))
        optimizer.step()
        model.zero_grad(set_to_none=False)
    reducers = list(model.__dict__.get("_fastreduce_reducers", {}).values())
    return {"how": how, "got_ours": got_ours, "spread_before": spread_before, "spread_after": spread_after,
            "errors": errors, "calls": calls, "spread_end": _spread(_flat(model)),
            "wire": [str(r.config.wire_dtype) for r in reducers],
            "graphs": [r.config.use_graphs for r in reducers]}


def _spread(flat: torch.Tensor) -> float:
    """The largest difference of ``flat`` between any rank and rank 0 (collective)."""
    import torch.distributed as dist

    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return max((g - gathered[0]).abs().max().item() for g in gathered)


def _rank_install_uninstall(rank: int, world: int, site: str) -> dict:
    _load(site)
    import optimum.habana.distributed as package
    import optimum.habana.distributed.fast_ddp as fast_ddp

    from fastreduce.integrations import optimum_habana as integration

    original = package.all_reduce_gradients
    out: dict[str, Any] = {
        "original_file": Path(original.__code__.co_filename).name,
        "original_is_fast_ddp": original is fast_ddp.all_reduce_gradients,
        "installed_before": integration.installed(),
    }
    integration.uninstall()  # not installed: nothing to do
    first = integration.install()
    second = integration.install(fusion_buffer_dtype=torch.float32, use_hpu_graphs=False, unused_grads="zero")
    from optimum.habana.distributed import all_reduce_gradients  # the trainer's import, per train()

    out.update(
        same_in_both=package.all_reduce_gradients is fast_ddp.all_reduce_gradients is second,
        trainer_import_gets_ours=all_reduce_gradients is second and first is not second,
        installed=integration.installed())

    # The installed function is fastreduce's, with install()'s settings under the trainer's call.
    model = torch.nn.Linear(4, 2)
    model(torch.randn(3, 4)).sum().backward()
    all_reduce_gradients(model, use_hpu_graphs=True)
    (reducer,) = model.__dict__["_fastreduce_reducers"].values()
    out.update(wire=str(reducer.config.wire_dtype), graphs=reducer.config.use_graphs,
               unused=reducer.config.unused_grads, calls=reducer.stats.calls)
    try:
        integration.install(fusion_dtype=torch.float32)
        out["typo"] = None
    except TypeError as exc:
        out["typo"] = str(exc)

    integration.uninstall()
    integration.uninstall()
    out.update(restored=package.all_reduce_gradients is original and fast_ddp.all_reduce_gradients is original,
               installed_after=integration.installed())
    return out


# ---------------------------------------------------------------------- tests

@needs_files
def test_trainer_imports_and_calls_what_install_patches() -> None:
    package = _package_dir(SITE)
    sites = _trainer_sites(package / "transformers" / "trainer.py")
    assert sites["import"] == "from ..distributed import all_reduce_gradients"
    assert sites["call"] == "all_reduce_gradients(model, use_hpu_graphs=True)"
    assert "from .fast_ddp import all_reduce_gradients" in (package / "distributed" / "__init__.py").read_text()

    # Nothing else in optimum-habana refers to the function, so install() misses no copy.
    referring = set()
    for path in package.rglob("*.py"):
        text = path.read_text(errors="replace")
        if "all_reduce_gradients" in text:
            tree = ast.parse(text)
            if any(isinstance(n, ast.ImportFrom) and any(a.name == "all_reduce_gradients" for a in n.names)
                   or isinstance(n, ast.FunctionDef) and n.name == "all_reduce_gradients"
                   or isinstance(n, ast.Name) and n.id == "all_reduce_gradients"
                   or isinstance(n, ast.Attribute) and n.attr == "all_reduce_gradients" for n in ast.walk(tree)):
                referring.add(path.relative_to(package).as_posix())
    assert referring == {"distributed/__init__.py", "distributed/fast_ddp.py", "transformers/trainer.py"}, referring

    # Under fast_ddp the accelerator does not wrap the model in DDP (no second reduce).
    accel = ast.parse((package / "accelerate" / "accelerator.py").read_text())
    assert any(isinstance(n, ast.Compare) and ast.unparse(n) == "self.distribution_strategy != 'fast_ddp'"
               for n in ast.walk(accel)), "GaudiAccelerator no longer skips DDP under fast_ddp"


@needs_files
@pytest.mark.parametrize("wire", ["default (bf16)", "fp32"])
def test_gaudi_trainer_fast_ddp_statements_reduce_through_fastreduce(wire: str) -> None:
    steps, accumulate = 3, 2
    install_kwargs = {} if wire.startswith("default") else {"fusion_buffer_dtype": torch.float32}
    results = run_ranks(_rank_fast_ddp, 2, SITE, install_kwargs, steps, accumulate, timeout=120)
    for r in results:
        assert r["how"] in ("package __init__ not run", "real package")
        assert r["got_ours"], "the trainer's import did not get fastreduce's function"
        assert r["spread_before"] > 0.1 and r["spread_after"] == 0.0  # the trainer's broadcast ran
        assert r["calls"] == list(range(1, steps + 1)), r["calls"]  # one reduce per sync step, none in between
        assert r["graphs"] == [True]
        assert r["spread_end"] == 0.0  # every rank steps on the same average
    if wire.startswith("default"):
        assert all(w == ["torch.bfloat16"] for w in (r["wire"] for r in results))
        assert max(max(r["errors"]) for r in results) < 2e-2  # bf16 wire: a few units of 2**-8
    else:
        assert all(w == ["torch.float32"] for w in (r["wire"] for r in results))
        assert max(max(r["errors"]) for r in results) < 1e-6


@needs_files
def test_install_is_idempotent_and_uninstall_restores() -> None:
    for r in run_ranks(_rank_install_uninstall, 2, SITE, timeout=120):
        _check_install_uninstall(r)


def _check_install_uninstall(r: dict) -> None:
    assert r["original_file"] == "fast_ddp.py" and r["original_is_fast_ddp"]
    assert not r["installed_before"]
    assert r["same_in_both"] and r["trainer_import_gets_ours"] and r["installed"]
    assert (r["wire"], r["graphs"], r["unused"], r["calls"]) == ("torch.float32", False, "zero", 1)
    assert r["typo"] is not None and "fusion_dtype" in r["typo"]
    assert r["restored"] and not r["installed_after"]


def _found(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # (its parent package is not there)
        return False


def _plugin_listed() -> bool:
    """Whether a distribution named habana-torch-plugin is installed (what optimum.habana's
    version check looks for in ``pip list``)."""
    import importlib.metadata

    try:
        importlib.metadata.version("habana-torch-plugin")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def _install_in_subprocess(pythonpath: list[str]) -> subprocess.CompletedProcess:
    code = ("import sys\n"
            "import fastreduce.integrations.optimum_habana as m\n"
            "assert not any(k == 'optimum' or k.startswith('optimum.') for k in sys.modules), 'imported early'\n"
            "try:\n"
            "    m.install()\n"
            "except ImportError as exc:\n"
            "    print('MESSAGE', exc)\n"
            "    print('CAUSE', type(exc.__cause__).__name__, exc.__cause__)\n"
            "else:\n"
            "    print('INSTALLED')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(pythonpath),  # (PATH: as in an activated venv, whose pip
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}  # lists Habana's plugin)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=150)


@needs_files
def test_install_error_passes_on_the_real_import_failure() -> None:
    """The real ``import optimum.habana.distributed``, package ``__init__`` included."""
    if importlib.util.find_spec("habana_frameworks") is not None or _plugin_listed():
        pytest.skip("Habana's plugin (or tests/stand_ins' stand-in) is installed here: optimum.habana imports")
    proc = _install_in_subprocess([str(ROOT)] + ([SITE] if SITE else []))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "INSTALLED" not in proc.stdout, "optimum.habana imported without Habana's software?"
    message = proc.stdout.split("MESSAGE", 1)[1]
    assert "pip install optimum-habana" in message and "habana_frameworks" in message
    assert "`import optimum.habana.distributed` failed with" in message
    cause = proc.stdout.split("CAUSE", 1)[1].strip()
    assert cause and not cause.startswith("NoneType"), proc.stdout  # e.g. IndexError from check_synapse_version


def test_install_error_without_optimum_habana() -> None:
    if SITE == "" or _found("optimum.habana"):
        pytest.skip("optimum-habana is installed in this environment")
    proc = _install_in_subprocess([str(ROOT)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "pip install optimum-habana" in proc.stdout
    assert "CAUSE ModuleNotFoundError" in proc.stdout, proc.stdout
