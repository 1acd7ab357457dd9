"""A test file's own ``torchrun`` launch (its ``__main__`` part as the worker) and what the
worker leaves: per-rank facts saved as ``RUN.rankR.pt``, read back by :func:`load_runs`; a
Membership coordinator in a process of its own (:func:`coordinator_process`), to kill."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
INDUCTOR = os.environ.get("FASTREDUCE_TEST_INDUCTOR", "1") != "0"
"""Whether the trainers' compile suites (tests/test_transformers.py, tests/test_lightning.py)
run inductor beside aot_eager. ``.ci/run`` sets ``FASTREDUCE_TEST_INDUCTOR=0`` on the Gaudi
stack: its users compile with Habana's backend, for which aot_eager (AOT autograd, then the
same kernels) stands in on a CPU; inductor, the CUDA and CPU users' backend, runs on the
default stack (and the newest, by hand). Read by the torchrun workers too (inherited)."""
TEST_ALL = os.environ.get("FASTREDUCE_TEST_ALL") == "1"
"""make test-all: the product's cells make test leaves out (tests/conftest.py FULL), where a
module fixture's launch, not a test id, holds the cell."""


def members_wrote(out: Path, count: int, what: str, procs: Any = (), timeout: float = 120) -> None:
    """Wait until members ``0..count-1`` each wrote ``out/member<i>.<what>``; the test fails
    after ``timeout`` s, or at once where one of ``procs`` (``multiprocessing`` processes)
    ended first."""
    deadline = time.monotonic() + timeout
    while not all((out / f"member{i}.{what}").exists() for i in range(count)):
        assert time.monotonic() < deadline and all(p.is_alive() for p in procs), f"the members did not get {what}"
        time.sleep(0.1)


@contextlib.contextmanager
def coordinator_process(**popen: Any) -> Iterator[tuple[subprocess.Popen, int]]:
    """``fastreduce coordinator`` on 127.0.0.1, a free port: (its process, the port); killed
    at the end, whatever the test did to it (``popen``: more of ``subprocess.Popen``'s)."""
    proc = subprocess.Popen([sys.executable, "-m", "fastreduce", "coordinator", "--host", "127.0.0.1", "--port", "0"],
                            stdout=subprocess.PIPE, text=True, **popen)
    try:
        yield proc, int(proc.stdout.readline().split("serving on 127.0.0.1:")[1].split(";")[0])
    finally:
        proc.kill()
        proc.communicate()


def torchrun(script: str | Path, world: int, *args: str, timeout: float) -> str:
    """``script`` on ``world`` ranks under ``torchrun --standalone`` (one torch thread each);
    its output, or the test fails with it (a non-zero exit, or killed at ``timeout``)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           str(Path(script).resolve()), *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the torchrun launch did not finish in {timeout:.0f}s; output:\n{out[-6000:]}")
    assert proc.returncode == 0, f"exit code {proc.returncode}; output:\n{out[-8000:]}"
    return out


def load_runs(out: Path) -> dict[str, list[dict]]:
    """``{run: [rank 0's facts, rank 1's, ...]}`` from the ``RUN.rankR.pt`` files in ``out``."""
    facts: dict[str, dict[int, dict]] = {}
    for f in sorted(out.glob("*.rank*.pt")):
        run, rank = f.name.split(".rank")
        facts.setdefault(run, {})[int(rank.split(".")[0])] = torch.load(f, weights_only=False)
    return {run: [ranks[r] for r in sorted(ranks)] for run, ranks in facts.items()}


def leave() -> None:
    """End a worker: wait for the peers, so none tears its connections down while another
    still uses them, and end the group; the process then exits as any does."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def hf_worker() -> tuple[int, int]:
    """Begin an HF-family trainer's worker: one torch thread, transformers' and Python's logs at
    errors and warnings, the Gloo group of the launch; its ``(rank, world)``."""
    import logging

    import torch.distributed as dist
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    logging.basicConfig(level=logging.WARNING)
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()
