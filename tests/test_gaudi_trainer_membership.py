"""``FastReduceGaudiTrainer`` (optimum-habana's ``GaudiTrainer`` on its CPU path, as in
tests/test_gaudi_trainer.py) under a ``fastreduce.Membership``, in every mode: through a loss
and a join with the model compiled, and resumed from the job's checkpoints (on 3 members, and
on 2 where the mode's state loads onto another world size). The members are
``examples/keep_training_trainers.py``'s: plain processes and a coordinator, not torchrun.
A file of its own so that its cases spread over CI's workers (tests/conftest.py: ``INDEPENDENT``);
skipped where optimum-habana does not import (the Gaudi 1.23 stack installs it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_gaudi_trainer import MODES, RESHARDED, pytestmark  # noqa: F401 - pytest reads pytestmark: the same skip

JOB_KILL_AT = 10  # member 2 dies in the forward of the step after the 10th committed one


def _job(trainer_dir: Path, mode: str, kill_at: int | None, saves: str = "", compiled: str = "",
         members: int = 3) -> list[dict]:
    from keep_training_trainers import launch

    found = launch("gaudi", trainer_dir, mode, kill_at, timeout=150, saves=saves, compiled=compiled, members=members)
    for i, f in found.items():
        assert "error" not in f, f"member {i} failed:\n{f['error']}"
    return [found[i] for i in sorted(found)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.cell("gaudi", "train", "compile", membership=True, against="equal")
def test_the_gaudi_trainer_under_a_membership_goes_on_through_a_loss_and_a_join(tmp_path: Path, mode: str) -> None:
    """3 members through ``FastReduceGaudiTrainer(..., fastreduce_membership=m)``, compiled
    (``torch_compile=True``, ``torch_compile_backend="aot_eager"``); member 2 killed in the
    forward of step 11 and a replacement joins: every final member reaches the last step with
    the failure-free run's lr at every step it trained, all bit for bit equal, graphs captured."""
    from keep_training_trainers import STEPS as JOB_STEPS, expected_lrs

    final = _job(tmp_path, mode, JOB_KILL_AT, compiled="aot_eager")
    assert all(f["graphs"] > 0 for f in final), [f["graphs"] for f in final]
    assert [f["index"] for f in final] == [0, 1, 3], [f["index"] for f in final]  # member 2 died
    lrs = expected_lrs(JOB_STEPS)
    for f in final:
        assert f["global_step"] == JOB_STEPS and f["world"] == 3, (f["index"], f["global_step"], f["world"])
        assert all(lr == lrs[s - 1] for s, lr in f["lrs"]), f["lrs"][:3]
        assert torch.equal(f["params"], final[0]["params"]), float((f["params"] - final[0]["params"]).abs().max())
    assert all(f["counters"]["losses"] == 1 and f["counters"]["joins"] == 1 for f in final[:2])
    assert JOB_KILL_AT <= final[2]["joined_at"] < JOB_STEPS, final[2]["joined_at"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("mode", [pytest.param(m, marks=pytest.mark.cell("gaudi", "reshard", membership=True,
                                                                          against="equal"))
                                  if m in RESHARDED else m for m in MODES])
@pytest.mark.cell("gaudi", "resume", membership=True)
def test_the_gaudi_trainer_under_a_membership_resumes_the_jobs_checkpoint(tmp_path: Path, mode: str) -> None:
    """The Membership saves the job every 16 steps (``JobCheckpoints``); a new job of 3 on the
    same directory starts at step 16 and ends where the uninterrupted job ended, bit for bit.
    The fused, overlapped and ZeRO saves resume on 2 members too: both train to the end at the
    schedule's lr, ending equal."""
    from keep_training_trainers import SAVE_EVERY, STEPS as JOB_STEPS, expected_lrs

    saves = str(tmp_path / "saves")
    first, again = (_job(tmp_path / out, mode, None, saves) for out in ("first", "again"))
    assert len(first) == len(again) == 3
    for f in again:
        assert f["global_step"] == JOB_STEPS and f["joined_at"] == SAVE_EVERY, (f["global_step"], f["joined_at"])
        assert torch.equal(f["params"], first[0]["params"]), float((f["params"] - first[0]["params"]).abs().max())
    if mode in RESHARDED:
        fewer = _job(tmp_path / "fewer", mode, None, saves, members=2)
        lrs = expected_lrs(JOB_STEPS)
        assert [f["world"] for f in fewer] == [2, 2], [f["world"] for f in fewer]
        for f in fewer:
            assert f["global_step"] == JOB_STEPS and f["joined_at"] == SAVE_EVERY, (f["global_step"], f["joined_at"])
            assert all(lr == lrs[s - 1] for s, lr in f["lrs"]), f["lrs"][:3]
            assert torch.equal(f["params"], fewer[0]["params"]), float((f["params"] - fewer[0]["params"]).abs().max())
        assert not torch.equal(fewer[0]["params"], first[0]["params"])
