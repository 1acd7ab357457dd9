"""A lost member and its replacement with CUDA tensors: ``fastreduce.Membership`` on one GPU.

The members' loop is ``examples/keep_training.py``'s (tests/test_membership.py runs it on
CPU tensors), here with ``device="cuda"``: three members and a replacement, every one's
model, batches and optimizer state on the one GPU, their collectives over Gloo. Member 2
SIGKILLs itself mid-step (after its backward, before the reduction) at step 15; the
survivors name the loss, discard that step and go on; the replacement is admitted and
healed from a live member (the state sent as CUDA tensors). What is asserted: training
reaches the last step, every final member holds the same parameters and AdamW state bit for
bit, on the GPU; the fused mode, and ZeRO with each shard's copy on the next rank
(``redundant=True``: the survivors step the lost shard from it).

``FASTREDUCE_GPU_TESTS_DEVICE=cpu`` runs the file with CPU tensors; otherwise it needs CUDA
and is skipped without it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from keep_training import STEPS, launch  # noqa: E402  (examples/keep_training.py: the members' loop)

DEVICE = os.environ.get("FASTREDUCE_GPU_TESTS_DEVICE", "cuda")
pytestmark = [pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                 reason="needs a CUDA GPU (FASTREDUCE_GPU_TESTS_DEVICE=cpu runs it on CPU)"),
              pytest.mark.timeout(240)]


@pytest.mark.parametrize("mode", ["fused", "zero"])
def test_a_member_lost_mid_step_with_cuda_tensors_is_replaced_and_training_goes_on(tmp_path: Path, mode: str) -> None:
    found = launch(tmp_path, "process_group", {2: ("mid-step", 15)}, mode=mode, device=DEVICE)
    for i, f in found.items():
        assert "error" not in f, f"member {i} failed:\n{f['error']}"
    assert 2 not in found  # it died
    final = [found[i] for i in (0, 1, 3)]  # the replacement is member 3
    for f in final:
        assert f["devices"] == [f"{DEVICE}:0" if DEVICE == "cuda" else DEVICE], f["devices"]
        assert f["steps"][-1][:2] == (STEPS, True) and f["world"] == 3, f["steps"][-3:]
        committed = [s for s, ok, _, _ in f["steps"] if ok]
        assert committed == list(range(f["joined_at"] + 1, STEPS + 1))  # every step once, none skipped
    for f in final[:2]:
        c = f["counters"]
        assert c["losses"] == 1 and c["discarded_steps"] <= 1 and c["joins"] == 1, c
        assert [s for s, ok, _, _ in f["steps"] if not ok] == [15] * c["discarded_steps"]
    first = final[0]
    for f in final[1:]:  # the replacement took the whole state from a live peer, as CUDA tensors
        assert torch.equal(f["params"], first["params"]), (f["index"], float((f["params"] - first["params"]).abs().max()))
        assert torch.equal(f["adam"], first["adam"]) and f["adam_step"] == first["adam_step"], f["index"]
