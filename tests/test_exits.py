"""Every finished run exits 0, as torchrun, Slurm and Kubernetes read it.

The users' scripts of ``fastreduce bench exits`` (``fastreduce/bench/user/``: no
``fastreduce.shutdown()``, no ``destroy_process_group()``, no ``os._exit``), launched the way
users launch them: every mode once under ``torchrun --standalone --nproc-per-node 2``
(checkpoints saved mid-run), three of them in the HF Trainer and three in Lightning
(:data:`TRAINER_OF`), and a ``Membership`` job of plain processes with a member SIGKILLed and
a replacement started. Any exit code other than 0 fails (the killed member's -9 apart), with
the process's last lines. One launch a cell shows an exit that always fails, not a race:
``fastreduce bench exits`` runs every mode in both trainers 20 and 50 times (docs/bench.md).
"""

from __future__ import annotations

import pytest

from fastreduce.bench.exits import MODES, launch_member_job, launch_trainer

pytestmark = pytest.mark.slow  # on the default stack only (tests/conftest.py spreads its launches over the workers)

TIMEOUT = 400.0


# Each trainer in three modes, the reducing and the local ones spread over both.
TRAINER_OF = {"fused": "hf", "overlap": "lightning", "zero": "hf", "gossip": "lightning", "localsgd": "lightning",
              "diloco": "hf"}


@pytest.mark.parametrize("mode", MODES)
def test_a_users_trainer_script_exits_0(mode: str) -> None:
    trainer = TRAINER_OF[mode]
    pytest.importorskip("transformers" if trainer == "hf" else "lightning")
    run = launch_trainer(trainer, mode, TIMEOUT)
    assert run["rc"] == 0, f"{trainer} {mode}: exit {run['rc']}\n{run['tail']}"


def test_a_membership_job_with_a_loss_and_a_replacement_exits_0() -> None:
    job = launch_member_job(timeout=TIMEOUT)
    codes = job["codes"]
    assert codes["member2"] == -9, codes  # the one SIGKILLed, by design
    bad = {k: rc for k, rc in codes.items() if k != "member2" and rc != 0}
    assert not bad, f"exits {codes}\n" + "\n".join(f"--- {k}\n{t}" for k, t in job["tails"].items())
    assert len(job["digests"]) == 3 and len(set(job["digests"].values())) == 1, job["digests"]
