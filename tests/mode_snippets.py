"""The blocks of docs/trainers.md's "Each mode, ready to copy": one per mode and trainer, run verbatim.

The bold title above a block names its mode (``**ZeRO**``, ...), its first line the trainer
(``# Hugging Face Trainer``, ``# Lightning``, ``# Accelerate``). The workers of
tests/test_trainer_modes.py (HF Trainer, Accelerate) and tests/test_lightning_modes.py
(Lightning) run each block in the 2 Gloo ranks they start anyway (no launch of their own),
as tests/test_readme.py runs the page's other blocks: compiled under the page's path and its
own line numbers (a traceback names docs/trainers.md and the line), in a namespace that holds
only the names the block assumes (tests/readme_pages.py's ``ASSUMED`` for that trainer),
built by tests/test_readme.py's preludes (a user's model, data and arguments, from the examples).
"""

from __future__ import annotations

import builtins
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from readme_pages import ASSUMED, EXAMPLES, MODE_BLOCKS, TRAINERS_PAGE, blocks, free_names

SECTION = MODE_BLOCKS
MODES = {"**ZeRO**": "zero", "**Fused or overlapped**": "overlap", "**Gossip**": "gossip",
         "**LocalSGD**": "localsgd", "**DiLoCo**": "diloco"}
"""Each mode's bold title on the page -> its name; the page shows them in this order."""
TRAINERS = {"# Hugging Face Trainer": "hf_trainer", "# Lightning": "lightning", "# Accelerate": "accelerate"}
"""A block's first line -> the trainer (test_readme's snippet names, and so its ``ASSUMED`` names)."""


def mode_blocks(trainer: str, page: Path = TRAINERS_PAGE) -> dict[str, tuple[int, str]]:
    """``{mode: (its first line's number on the page, its text)}`` of ``trainer``'s blocks, in
    the page's order; every mode has one, and each assumes only the user's names."""
    found: dict[str, tuple[int, str]] = {}
    for heading, title, first, text in blocks(page):
        if heading != SECTION:
            continue
        where = f"docs/trainers.md:{first}"
        mode = next((m for prefix, m in MODES.items() if title.startswith(prefix)), None)
        kind = TRAINERS.get(text.splitlines()[0].strip())
        assert mode is not None and kind is not None, \
            f"{where}: a block under {SECTION!r} names no mode (bold title above: {title!r}) or no trainer " \
            f"(its first line: one of {sorted(TRAINERS)})"
        if kind != trainer:
            continue
        assert mode not in found, f"{where}: a second {trainer} block for {mode}"
        extra = free_names(text) - ASSUMED[trainer]
        assert not extra, f"{where}: uses {sorted(extra)} without importing or defining them"
        found[mode] = (first, text)
    assert list(found) == list(MODES.values()), f"{trainer}'s blocks under {SECTION!r}: {list(found)}"
    return found


def run_block(first: int, text: str, names: dict) -> dict:
    """Run a block as it stands on the page, in a namespace of ``names``; the namespace after."""
    code = compile("\n" * (first - 1) + text, str(TRAINERS_PAGE), "exec")
    ns = {"__name__": "__main__", "__builtins__": builtins, **names}
    exec(code, ns)
    return ns


@contextmanager
def users_script(folder: Path) -> Iterator[None]:
    """Inside: the examples importable (the preludes' models and data) and ``folder`` the
    working directory (what the trainers write by default lands there)."""
    folder.mkdir(parents=True, exist_ok=True)
    before = os.getcwd()
    sys.path.insert(0, str(EXAMPLES))
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)
        sys.path.remove(str(EXAMPLES))
