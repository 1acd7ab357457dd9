"""A checkpoint's folder on disk (:mod:`fastreduce.checkpoint`): the commit marker, the
committed steps, the damage found before reading, the fingerprints' first difference."""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any

MARKER = "fastreduce.json"
"""The commit marker in a checkpoint folder: written last, it holds the fingerprint."""
FORMAT = 1
STEP_DIR = re.compile(r"step-(\d+)$")


# ---------------------------------------------------------------------- folders


def step_folder(directory: str, step: int) -> str:
    """The folder of step ``step``'s checkpoint in ``directory``."""
    return os.path.join(directory, f"step-{step:08d}")


def step_folders(directory: str) -> list[tuple[int, str]]:
    """``[(step, folder)]`` of every checkpoint folder in ``directory``, complete or not, by step."""
    if not os.path.isdir(directory):
        return []
    return sorted((int(m.group(1)), os.path.join(directory, name)) for name in os.listdir(directory)
                  if (m := STEP_DIR.match(name)))


def complete_steps(directory: str) -> list[tuple[int, str]]:
    """``[(step, folder)]`` of the committed checkpoints in ``directory``, by step."""
    return [(s, p) for s, p in step_folders(directory) if os.path.isfile(os.path.join(p, MARKER))]


def inspect_folder(path: str) -> tuple[dict[str, Any] | None, list[str]]:
    """Checkpoint ``path``'s marker, and what is wrong with its files: the marker or
    DCP's metadata unreadable, a file the metadata points into missing or shorter than
    what is stored in it."""
    try:
        with open(os.path.join(path, MARKER)) as f:
            saved = json.load(f)
    except (OSError, ValueError) as err:
        return None, [f"{os.path.join(path, MARKER)} cannot be read ({type(err).__name__}: {err})"]
    try:
        from torch.distributed.checkpoint import FileSystemReader

        metadata = FileSystemReader(path).read_metadata()
    except Exception as err:  # noqa: BLE001 - any failure to read it is damage
        return saved, [f"its metadata (.metadata) cannot be read ({type(err).__name__}: {err})"]
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is not None:
            needed[rel] = max(needed.get(rel, 0), int(info.offset) + int(info.length))
    problems = []
    for rel, size in sorted(needed.items()):
        file = os.path.join(path, rel)
        if not os.path.isfile(file):
            problems.append(f"{file} is missing")
        elif os.path.getsize(file) < size:
            problems.append(f"{file} is truncated ({os.path.getsize(file)} bytes, {size} expected)")
    return saved, problems


def fresh_folder(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)


def first_difference(saved: list[list[Any]], mine: list[list[Any]]) -> str:
    """The first of the fingerprints' ``[kind, name, shape, dtype]`` entries that differ."""
    def desc(t: list[Any]) -> str:
        return f"{tuple(t[2])} {t[3]}"

    for k, (a, b) in enumerate(zip(saved, mine)):
        if a[:2] == b[:2] and a != b:
            return f"its {_KIND[a[0]]} {a[1]!r} is {desc(a)}, this model's is {desc(b)}"
        if a != b:
            return (f"its {_KIND[a[0]]} #{k} is {a[1]!r} {desc(a)}, this model's is {_KIND[b[0]]} "
                    f"{b[1]!r} {desc(b)}")
    if len(saved) > len(mine):
        a = saved[len(mine)]
        return f"it holds {len(saved)} tensors, this model {len(mine)}: this model lacks {_KIND[a[0]]} {a[1]!r}"
    b = mine[len(saved)]
    return f"it holds {len(saved)} tensors, this model {len(mine)}: the checkpoint lacks {_KIND[b[0]]} {b[1]!r}"


_KIND = {"param": "parameter", "buffer": "buffer"}
