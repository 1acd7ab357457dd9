"""Every module of the package imports on a machine without a GPU or a Gaudi (their
device code is imported lazily, inside the functions that need it)."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest
import torch

import fastreduce

MODULES = sorted(m.name for m in pkgutil.walk_packages(fastreduce.__path__, "fastreduce.")
                 if not m.name.endswith("__main__"))  # that one runs the CLI


EXTRAS = {"fastreduce.integrations.lightning": "lightning", "fastreduce.integrations.transformers": "transformers"}
"""Integration modules and the optional package each needs (``fastreduce[lightning]``,
``fastreduce[hf]``): without it the module's import is skipped, not failed."""


@pytest.mark.parametrize("name", MODULES)
def test_module_imports(name: str) -> None:
    if name in EXTRAS:
        pytest.importorskip(EXTRAS[name], reason=f"{name} needs the optional package {EXTRAS[name]}")
    importlib.import_module(name)


def test_public_names_resolve() -> None:
    for name in fastreduce.__all__:
        assert getattr(fastreduce, name) is not None


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` of an attribute chain on a name, else ``None``."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def test_the_device_tests_name_what_exists() -> None:
    """``tests/gpu`` skips here (no GPU, no Gaudi), so a name it reaches through the package
    (``fastreduce.x.y``) that a change moved fails only on the device: every such chain, and
    every ``from fastreduce... import`` in it, resolves here. (An H200 run found two tests
    calling a function of ``fastreduce.modes.zero_shard`` that had moved to ``optim_kernels``.)"""
    missing = []
    for path in sorted((Path(__file__).parent / "gpu").glob("*.py")):
        tree = ast.parse(path.read_text())
        chains = {d for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                  and (d := _dotted(n)) and d.startswith("fastreduce.")}
        chains |= {f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                   and (n.module or "").startswith("fastreduce") for a in n.names}
        for chain in chains:
            parts = chain.split(".")
            obj: object = fastreduce
            for k, part in enumerate(parts[1:], 2):
                if not hasattr(obj, part):
                    try:
                        obj = importlib.import_module(".".join(parts[:k]))
                        continue
                    except ImportError:
                        missing.append(f"{path.name}: {chain}")
                        break
                obj = getattr(obj, part)
    assert not missing, missing


# ---------------------------------------------------------------------- the layers

PACKAGE = Path(fastreduce.__file__).parent
FILE_LINES = 500
"""A module of the library (bench/ apart) past this holds a second concern: split it."""
FACADE_LINES = 250
"""``Membership`` is a facade over parts that own their state (docs/design.md)."""


def _module_name(path: Path) -> str:
    parts = ("fastreduce",) + path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """``{module: the package's modules it imports}``, read from the source (``ast``, nothing
    run): every import statement counts, at module level or inside a function (a lazy import
    that closes a circle is a circle of the design all the same). ``from .pkg import name``
    is an edge to ``pkg`` and, where ``name`` is a submodule, to ``pkg.name``."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        is_pkg = path.name == "__init__.py"
        base = name.split(".") if is_pkg else name.split(".")[:-1]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                root = ".".join(base[:len(base) - node.level + 1]) if node.level else ""
                mod = ".".join(filter(None, [root, node.module or ""]))
                targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
            else:
                continue
            edges.update(t for t in targets if t in files and t != name)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_circle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle() -> None:
    graph = import_graph()
    assert "fastreduce.modes.fused" in graph and graph["fastreduce"], "the graph reader found no modules"
    found = cycles(graph)
    assert not found, "import circles in the package (a module of each imports another, directly or " \
                      f"through others; move the shared piece below both): {found}"


def test_the_library_never_imports_the_bench() -> None:
    """bench/ is a tool over the library (docs/design.md): no module outside it imports it, but
    the command's dispatcher (``fastreduce bench``)."""
    graph = import_graph()
    into = {name: sorted(m for m in edges if m.startswith("fastreduce.bench"))
            for name, edges in graph.items() if not name.startswith("fastreduce.bench") and name != "fastreduce.cli"}
    assert "fastreduce.bench.report" in graph and "fastreduce.cli" in graph
    assert not {k: v for k, v in into.items() if v}, "the library imports the bench"


def test_no_module_holds_two_concerns() -> None:
    """No module of the library over FILE_LINES lines (bench/, a tool over it, apart), and the
    Membership facade under FACADE_LINES: a file near the cap is split by concern."""
    over = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if "bench" not in path.relative_to(PACKAGE).parts:
            lines = len(path.read_text().splitlines())
            if lines > (FACADE_LINES if path == PACKAGE / "membership.py" else FILE_LINES):
                over[str(path.relative_to(PACKAGE))] = lines
    assert len(list(PACKAGE.rglob("*.py"))) > 50, "the package was not found"
    assert not over, f"modules over the cap ({FILE_LINES} lines; membership.py {FACADE_LINES}): {over}"


BLOCKING = {"all_reduce", "all_gather", "broadcast", "barrier", "all_gather_object", "broadcast_object_list",
            "reduce_scatter", "reduce_scatter_tensor", "all_gather_into_tensor", "all_to_all", "all_to_all_single",
            "gather", "scatter", "reduce", "gather_object", "scatter_object_list", "send", "recv"}
UNWATCHED = {  # module -> how many blocking collectives it may run, and why no Membership meets them
    "comm/collectives.py": (1, "the AVG probe of a backend other than Gloo (a Membership's is Gloo)"),
    "comm/shm_sync.py": (1, "the shared-memory channel's own group (a failed rank fails its flags)"),
    "faults_watchdog.py": (2, "torch's own object collectives, where no heartbeat watches the group"),
    "join.py": (4, "torch's Join protocol for uneven inputs, which a Membership does not run"),
    "launch.py": (1, "run_ranks' workers' last barrier (tests and the bench)"),
}


def test_no_collective_a_membership_meets_waits_unwatched() -> None:
    """Every collective of the library (bench/ apart) is launched ``async_op=True`` and waited
    through the watchdog (``faults.wait_watched`` and the helpers over it), but those listed
    in UNWATCHED: a plain one, met by a Membership's member whose peer was lost, waited the
    group's whole timeout on members that had given the epoch up (docs/faults.md)."""
    found: dict[str, int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(PACKAGE))
        if "bench" in path.relative_to(PACKAGE).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in BLOCKING \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "dist" and not any(
                        k.arg == "async_op" and isinstance(k.value, ast.Constant) and k.value.value is True
                        for k in node.keywords):
                found[rel] = found.get(rel, 0) + 1
    assert found == {k: n for k, (n, _) in UNWATCHED.items()}, found


def test_modes_are_thin() -> None:
    """One concern per mode module, and no transport or device code in any (docs/design.md: modes
    stand on the comm and backends layers and pick neither)."""
    graph = import_graph()
    modes = sorted(PACKAGE.joinpath("modes").glob("*.py"))
    assert len(modes) >= 8
    for path in modes:
        name = _module_name(path)
        low_level = {m for m in graph[name]
                     if m.startswith(("fastreduce.comm.shm", "fastreduce.backends.cuda", "fastreduce.backends.hpu"))}
        assert not low_level, f"{name} imports transport or device modules {sorted(low_level)}"
        text = path.read_text()
        assert "habana_frameworks" not in text and "torch.cuda." not in text, f"{name} holds device code"


def test_every_mode_declares_the_contract() -> None:
    """Every mode declares how its steps commit (``commit_style``, :mod:`fastreduce.modes.contract`),
    where its state lives, whose optimizer it steps, its name, what a Membership needs of it,
    and closes with one ``close(drain=True)`` (docs/design.md, "The modes and what they
    share"): what Membership and the trainers ask, with no branch per mode; the trainers'
    side of each mode closes alike."""
    from fastreduce.integrations.modes import MODES
    from fastreduce.modes.contract import (COMMIT_STYLES, OPTIMIZER_ROLES, STATE_SCOPES, commit_style,
                                           membership_settings, optimizer_role, state_scope)

    modes = {m.cls for m in MODES.values()}
    assert {cls.commit_style for cls in modes} == set(COMMIT_STYLES), "a commit style no mode has, or a mode without"
    assert {state_scope(cls) for cls in modes} == set(STATE_SCOPES)
    assert {optimizer_role(cls) for cls in modes} == set(OPTIMIZER_ROLES)
    for cls in modes:  # its name: fixed, or (the reducer's fused / overlap) read from its settings
        assert isinstance(getattr(cls, "mode_name", None), (str, property)), cls
        assert isinstance(membership_settings(cls), dict)
    assert commit_style(torch.nn.Linear(1, 1)) == "" and commit_style(fastreduce.FusedReducer) == "reduce"
    with pytest.raises(TypeError, match="Linear is not a fastreduce mode"):
        state_scope(torch.nn.Linear(1, 1))
    classes = modes | set(MODES.values())
    assert len(classes) >= 10
    for cls in classes:
        params = inspect.signature(cls.close).parameters
        assert list(params) == ["self", "drain"] and params["drain"].default is True, \
            f"{cls.__name__}.close{inspect.signature(cls.close)}: every mode's is close(self, drain=True)"


def test_quick_tier_runs_every_mode() -> None:
    """``make test-quick`` (tests/conftest.py) holds a test of every mode module."""
    from conftest import QUICK

    modes = {p.stem for p in PACKAGE.joinpath("modes").glob("*.py")}
    # pieces of gossip, ZeRO, the local modes, the reducer
    parts = {"__init__", "topology", "zero_shard", "zero_state", "zero_config", "zero_grads", "zero_mirror", "zero_pieces",
             "zero_finite", "zero_join", "local", "local_state", "local_nonfinite", "fused_state", "fused_config",
             "fused_build", "comm_stats", "gossip_average", "gossip_buckets", "gossip_step", "step_undo", "local_scaler"}
    missing = sorted(modes - parts - set(QUICK))
    assert not missing, f"the quick tier (tests/conftest.py QUICK) has no test of {missing}"


# ---------------------------------------------------------------------- private names (docs/design.md)

TORCH_INTERNALS_TOO = {  # module -> why it reaches torch's internals itself, not through torch_internals.py
    "compiling.py": "dynamo's hooks the compiled overlap needs (its DDP optimizer's active module)",
    "hooks.py": "dynamo's hooks the compiled overlap needs (eval_frame's, and its reset)",
}
OTHER_OBJECTS = {  # module -> the private names of another library it reads, writes or imports
    "integrations/transformers_hooks.py": {"_globalstep_last_logged", "_initial_global_step"},  # a joiner's step
    "integrations/lightning_optimizers.py": {"_opt_called", "_wrapped_by_lr_sched"},  # torch's LR scheduler's marks
    "integrations/lightning_membership.py": {"_update_dataloader"},  # a loader given the job's sampler
    "compiling.py": {"_active_ddp_module"},
}
PUBLIC_UNDERSCORED = {"_fields", "_asdict", "_replace", "_make"}  # namedtuple's API


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and not name.startswith("_foreach_")


def _library_files() -> list[tuple[str, ast.Module]]:
    return [(str(p.relative_to(PACKAGE)), ast.parse(p.read_text())) for p in sorted(PACKAGE.rglob("*.py"))
            if "bench" not in p.relative_to(PACKAGE).parts]


def _torch_internals_used(tree: ast.Module) -> list[str]:
    """torch's private modules imported, private names imported from torch, and private
    attributes read off ``torch``, ``dist`` or ``nn`` (its ``_foreach_*`` kernels apart)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "torch":
            found += [f"{node.module} {a.name}" for a in node.names
                      if any(map(_private, node.module.split("."))) or _private(a.name)]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("torch.") and any(map(_private, a.name.split(".")))]
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            root = node
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in ("torch", "dist", "nn"):
                found.append(ast.unparse(node))
    return found


def _foreign_private(tree: ast.Module) -> set[str]:
    """Private attributes this module reads or writes on an object that is not ``self``
    (nor ``cls``), which the module neither keeps on ``self`` nor defines: another
    module's or another library's private state. fastreduce's own marks (``_fastreduce_*``)
    apart."""
    own = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
           and isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")}
    own |= {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    found = set()
    for node in ast.walk(tree):
        name, base = None, None
        if isinstance(node, ast.Attribute):
            name, base = node.attr, node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) > 1 and \
                isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            name, base = node.args[1].value, node.args[0]
        if name is None or not _private(name) or name in own or name in PUBLIC_UNDERSCORED or \
                name.startswith("_fastreduce"):
            continue
        if isinstance(base, ast.Name) and base.id in ("self", "cls", "torch", "dist", "nn"):
            continue  # (torch's: the test above)
        found.add(name)
    return found


def test_torch_internals_are_reached_in_one_module() -> None:
    """Every use of torch's private internals is in torch_internals.py, behind a public
    function (docs/design.md), but in the modules listed with their reason."""
    used = {rel: found for rel, tree in _library_files()
            if rel != "torch_internals.py" and (found := _torch_internals_used(tree))}
    assert _torch_internals_used(ast.parse((PACKAGE / "torch_internals.py").read_text())), "the reader finds none"
    assert set(used) <= set(TORCH_INTERNALS_TOO), {k: v for k, v in used.items() if k not in TORCH_INTERNALS_TOO}


def test_no_private_name_crosses_a_module() -> None:
    """No module imports another's private name (but the one kept for old checkpoints), reads
    or writes another module's private attributes, or another library's beyond those listed
    (docs/design.md, "Other libraries' objects"), or swaps an object's class."""
    imported, foreign, swapped = [], {}, []
    for rel, tree in _library_files():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("fastreduce")):
                imported += [f"{rel}: {node.module}.{a.name}" for a in node.names if _private(a.name)]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] != "torch":
                imported += [f"{rel}: {node.module}.{a.name}" for a in node.names
                             if _private(a.name) and a.name not in OTHER_OBJECTS.get(rel, ())]
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Attribute) and t.attr == "__class__"
                                                    for t in node.targets):
                swapped.append(f"{rel}:{node.lineno}")
        if rel != "torch_internals.py" and (found := _foreign_private(tree) - OTHER_OBJECTS.get(rel, set())):
            foreign[rel] = sorted(found)
    assert imported == ["checkpoint.py: checkpoint_state._TensorAt"], imported  # pickled under checkpoint's name
    assert not foreign, foreign
    assert not swapped, swapped
    planted = ast.parse("def f(opt):\n    opt._template = 1\n    return getattr(opt, '_kwargs')\n")
    assert _foreign_private(planted) == {"_template", "_kwargs"}  # the reader sees a read and a write


MODE_HOOKS = {"communicates_at", "mirror", "mirrors", "local_state_dict", "reduce", "all_arrived", "commit_point",
              "global_avg", "outer_step"}  # what a mode has and another lacks: asked by hasattr, a guess at the mode


def test_no_mode_is_guessed_outside_the_contract() -> None:
    """Membership, the checkpoints, the trainers and plan ask the contract (modes/contract.py, the
    registry in integrations/modes.py) what a mode is: no ``isinstance``/``issubclass`` of a
    mode's class and no ``hasattr`` of a hook only some modes have anywhere else."""
    from fastreduce.integrations.modes import MODES

    classes = {m.cls.__name__ for m in MODES.values()} | {m.__name__ for m in MODES.values()}
    assert {"ZeroOptimizer", "FusedReducer", "DiLoCo"} <= classes
    found = []
    for rel, tree in _library_files():
        if rel in ("modes/contract.py", "integrations/modes.py"):
            continue
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) > 1):
                continue
            if node.func.id in ("isinstance", "issubclass"):
                named = {n.id if isinstance(n, ast.Name) else getattr(n, "attr", "") for n in ast.walk(node.args[1])}
                if named & classes:
                    found.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
            elif node.func.id == "hasattr" and isinstance(node.args[1], ast.Constant) and node.args[1].value in MODE_HOOKS:
                found.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
    assert not found, found
