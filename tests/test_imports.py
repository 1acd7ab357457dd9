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
