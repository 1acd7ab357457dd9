"""Which ```` ```python ```` block of README.md and docs/trainers.md is which snippet, and
the names each assumes (a user's script has them); read at test time by tests/test_readme.py,
which runs the blocks, and by tests/mode_snippets.py."""

from __future__ import annotations

import builtins
import re
import symtable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TRAINERS_PAGE = ROOT / "docs" / "trainers.md"
EXAMPLES = ROOT / "examples"
WORLD = 2
README_BLOCKS = {  # a heading of README.md -> the names of the ```python blocks under it, in order
    "### One call after backward": ("call",),
    "### A mode: overlapped": ("quickstart",),
    "### In your trainer": ("readme_hf", "readme_lightning"),
    "### Training that goes on": ("membership",),
}
MODE_BLOCKS = "## Each mode, ready to copy"  # docs/trainers.md: its blocks run in tests/mode_snippets.py
TITLES = {  # bold title above a block of TRAINERS_PAGE -> the snippet's name here
    "**Hugging Face": "hf_trainer", "**Accelerate": "accelerate", "**Lightning": "lightning",
    "**optimum-habana": "optimum_habana",
}
# The names each snippet uses without defining them: what a user's script has already.
ASSUMED: dict[str, set[str]] = {
    "call": {"Net", "batches", "loss_fn"},
    "quickstart": {"Net", "batches", "loss_fn", "x0", "y0", "x1", "y1"},
    "readme_hf": {"model", "training_args", "ds"},
    "readme_lightning": {"model", "train_loader"},
    "membership": {"model", "opt", "loss_fn", "batch_for", "steps"},
    "hf_trainer": {"model", "training_args", "ds"},
    "accelerate": {"accelerator", "model", "optimizer", "loader"},
    "lightning": {"model", "train_loader"},
    "optimum_habana": {"model", "gaudi_config", "ds", "GaudiTrainer", "GaudiTrainingArguments"},
}


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
    under: dict[str, list[tuple[int, str]]] = {}
    for heading, _, first, text in blocks(readme):
        prefix = next((h for h in README_BLOCKS if heading.startswith(h)), None)
        assert prefix is not None, (f"{shown(readme, first)}: a ```python block under {heading!r} has no harness in "
                                    f"tests/test_readme.py (README_BLOCKS)")
        under.setdefault(prefix, []).append((first, text))
    for prefix, names in README_BLOCKS.items():
        got = under.get(prefix, [])
        assert len(got) == len(names), f"README.md: {len(got)} ```python blocks under {prefix!r}, expected {names}"
        found.update({name: (readme, first, text) for name, (first, text) in zip(names, got)})
    where = relative(trainers)
    for heading, title, first, text in blocks(trainers):
        if heading == MODE_BLOCKS:  # one per mode and trainer, run by the trainers' mode tests
            continue
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
