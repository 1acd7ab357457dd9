"""fastreduce.Membership: training goes on when a member is lost or joins (issue 49).

Real processes (forked from a server that imported torch once: fastreduce.launch.rank_context;
the coordinator-lost test's spawned), a real coordinator (a ``TCPStore``
server in this test's process), real Gloo groups made again at each epoch, both
transports (``FASTREDUCE_TRANSPORT``: Gloo's collectives, or shared memory). Each member
trains a small MLP with AdamW in the fused mode (fp32 wire), one seeded batch per
(step, rank), and records every step it commits. Faults are real: a member SIGKILLs itself
mid-step (after its backward, before the reduction) or between steps, a replacement as it
is admitted, healed or in its first step; a replacement process, started beforehand and
waiting with torch imported, joins when told. The
members' loop is ``examples/keep_training.py``'s (``make demo`` runs it).

What is asserted, per scenario: training never stops (every final member commits the
last step); every final member holds the same parameters and AdamW state, bit for bit
(the joiners' included: they took the state from a live peer, not from disk); at most one
step is discarded per loss; the epochs and world sizes are as the faults make them; a
joiner with another layout is refused with an error naming the difference while the
members train on undisturbed.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import fastreduce

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from keep_training import STEPS, launch, make_model  # noqa: E402  (examples/keep_training.py: the members' loop)

pytestmark = pytest.mark.timeout(240)


def run(tmp_path: Path, transport: str, kills: dict[int, tuple[str, int]], joiners: int = 1,
        joiner_width: int = 16, mode: str = "fused", **settings: Any) -> dict[int, dict]:
    found = launch(tmp_path, transport, kills, joiners, joiner_width, mode=mode, **settings)
    for i, f in found.items():
        assert "error" not in f, f"member {i} failed:\n{f['error']}"
        assert "not confirmed" not in f.get("refused", ""), f"member {i}'s close() raised: {f['refused']}"
    return found


def _same(members: list[dict]) -> None:
    first = members[0]
    for m in members[1:]:
        assert torch.equal(m["params"], first["params"]), (m["index"], float((m["params"] - first["params"]).abs().max()))
        assert torch.equal(m["adam"], first["adam"]) and m["adam_step"] == first["adam_step"]


SLOW = pytest.mark.slow  # the default stack runs them all; the Gaudi stack one case of each kind


@pytest.mark.parametrize("transport, where, overlap", [
    ("process_group", "mid-step", False), pytest.param("shm", "mid-step", False, marks=SLOW),
    pytest.param("process_group", "in-backward", True, marks=SLOW),
    pytest.param("process_group", "after-reduce", False, marks=SLOW),
    pytest.param("shm", "in-backward", True, marks=SLOW), pytest.param("process_group", "between", False, marks=SLOW)])
# (also passed at stop 53, left out for CI's time: after-reduce and between on shared memory)
@pytest.mark.cell("loop", "train", membership=True, modes=("fused", "overlap"), against="equal")
def test_a_lost_member_is_replaced_and_training_goes_on(tmp_path: Path, transport: str, where: str,
                                                        overlap: bool) -> None:
    """Killed mid-step (after backward), inside backward with the overlapped reducer's
    later buckets in flight, or between steps: the survivors discard that step and go on;
    killed after its reduction completed on every member (before its optimizer step), the
    survivors commit that step and discard the next, whose reduction fails (none if that
    step was a poll: its vote sees the member silent). The replacement heals from a live
    member. The job saves itself as it goes (``JobCheckpoints``, every 16 steps): step 32's
    checkpoint is complete, its parts written by the survivors and the replacement, each the
    parameters every member committed at that step."""
    found = run(tmp_path, transport, {2: (where, 10)}, mode="overlap" if overlap else "fused",
                checkpoints=str(tmp_path / "saves"))
    final = [found[i] for i in (0, 1, 3)]
    assert 2 not in found  # it died
    for f in final:
        assert f["steps"][-1][:2] == (STEPS, True), f["steps"][-3:]
        # the replacement joins the epoch that drops the lost member (1) if it is waiting by
        # then, else the next one (2)
        assert f["world"] == 3 and f["epoch"] in (1, 2), (f["epoch"], f["world"])
        committed = [s for s, ok, _, _ in f["steps"] if ok]
        assert committed == list(range(f["joined_at"] + 1, STEPS + 1))  # every step once, none skipped
    survivors = final[:2]
    for f in survivors:
        c = f["counters"]
        assert c["losses"] == 1 and c["discarded_steps"] <= 1 and c["joins"] == 1, c
        died = 11 if where == "after-reduce" else 10  # the first step whose reduction lacks it
        assert [s for s, ok, _, _ in f["steps"] if not ok] == [died] * c["discarded_steps"]
    for f in final:  # the heartbeat of every epoch left ends with it (its store thread and connection too): at
        # most the current epoch's store thread runs (none where it made no read since it last stopped)
        assert f["store_threads"] <= 1, (f["index"], f["store_threads"], f["epoch"])
    joiner = final[2]
    assert 10 <= joiner["joined_at"] < STEPS, joiner["joined_at"]
    assert joiner["counters"]["stalls"][0][0] == "joined"
    _same(final)  # the joiner took the whole state from a live peer: bit for bit after 20+ more steps
    _saved_as_committed(tmp_path / "saves", final, 32)


def _saved_as_committed(saves: Path, final: list[dict], step: int) -> None:
    """The job's checkpoint of ``step`` is complete, every part of that step, and rank 0's
    holds the parameters every member committed at that step (the others' hold no copy)."""
    from keep_training import digest

    from fastreduce.job_checkpoints import JobCheckpoints

    found = JobCheckpoints(saves, every=16).newest()
    assert found is not None and (found.step, found.world) == (step, len(final)), found
    parts = [torch.load(path, weights_only=False) for path in found.parts]
    assert [p["step"] for p in parts] == [step] * len(parts) and all(p["state"] is None for p in parts[1:])
    model = make_model(16)
    model.load_state_dict(parts[0]["state"]["model"])
    assert all(digest(model) == f["digests"][step] for f in final), [f["digests"][step] for f in final]


@pytest.mark.parametrize("mode", [pytest.param("fused", marks=SLOW), "zero"])
def test_a_member_whose_reduction_failed_where_the_others_completed_it_is_healed_forward(tmp_path: Path,
                                                                                         mode: str) -> None:
    """Member 1's reduction completes on every member, then fails on member 1 alone (a
    transport error: its link flapped). The others committed that step; member 1 takes
    their state in the next epoch (as a joiner would) and goes on from the same step: no
    process lost, none of member 1's steps discarded, every member bit-identical. ZeRO
    (``redundant=True``): the members' meeting before the shards step completes everywhere,
    then fails on member 1 alone; the others step their shards, member 1 steps the gradients
    it holds as the next epoch forms: the same run as torch.optim.AdamW on the mean (1e-6).
    One stall, as at a kill: member 1 names itself on the epoch's heartbeat as it leaves, where
    the others, waiting on it in their next collective, saw it silent and waited 10 loss
    windows for a process of their host (10.7 s); every step's parameters equal on all."""
    found = run(tmp_path, "process_group", {1: ("flaps", 10)}, joiners=0, mode=mode)
    final = [found[i] for i in (0, 1, 2)]
    for f in final:
        assert f["steps"][-1][:2] == (STEPS, True) and f["world"] == 3 and f["epoch"] == 1, (f["epoch"], f["world"])
        assert f["counters"]["losses"] == 1 and f["counters"]["joins"] == 0, f["counters"]  # healed forward: no joiner
        # the loss window is 1 s here (keep_training's heartbeat of 0.25 s: 3 beats, at least 1 s)
        assert max(s for why, s in f["counters"]["stalls"] if why == "loss") < 4.0, f["counters"]["stalls"]
    for s in range(1, STEPS + 1):  # no two members committed different parameters at any step
        digests = [f["digests"].get(s) for f in final]
        assert len(set(digests) - {None}) == 1, (s, digests)
    flapped = found[1]
    assert flapped["counters"]["discarded_steps"] == 0 and all(ok for _, ok, _, _ in flapped["steps"])
    assert [s for s, _, _, _ in flapped["steps"]] == list(range(1, STEPS + 1))  # step 11 healed forward, not skipped
    for f in (found[0], found[2]):  # they committed step 10; their step 11 failed as member 1 left the group
        assert [s for s, ok, _, _ in f["steps"] if not ok] == [11] * f["counters"]["discarded_steps"]
    _same(final)
    if mode == "zero":
        want = adamw_on_the_mean([3] * STEPS)
        assert torch.allclose(final[0]["params"], want, rtol=0, atol=1e-6), float((final[0]["params"] - want).abs().max())


def test_a_last_step_that_failed_on_one_member_alone_is_settled_at_the_others_close(tmp_path: Path) -> None:
    """As above, at the last step: member 1's reduction completes on every member, then fails on
    member 1 alone. Members 0 and 2 committed it and close(); no later collective fails for
    them, so their close() settles it (fastreduce/ending.py): it finds member 1 gone on to
    the next epoch with one step fewer, joins that epoch and sends it the step, as a survivor
    holding a step does mid-run. Every close() returns, every member ends at the last step in
    epoch 1, none discarded a step, and every step's parameters are equal on all three
    (before: members 0 and 2 closed with the step, member 1 formed epoch 1 alone, below
    min_ranks=2, and raised; with min_ranks=1 it would have taken that step again alone,
    a second final model and no error)."""
    found = run(tmp_path, "process_group", {1: ("flaps", STEPS - 1)}, joiners=0)
    final = [found[i] for i in (0, 1, 2)]
    assert found[1]["epoch"] == 1 and found[1]["counters"]["losses"] == 1, found[1]["counters"]  # healed forward
    for f in final:
        assert f["steps"][-1][:2] == (STEPS, True) and f["world"] == 3 and f["closed_in"] == 1, (f["closed_in"], f)
        assert f["counters"]["discarded_steps"] == 0 and f["counters"]["joins"] == 0, f["counters"]
        assert [s for s, _, _, _ in f["steps"]] == list(range(1, STEPS + 1)), f["steps"][-3:]
    for s in range(1, STEPS + 1):
        digests = [f["digests"].get(s) for f in final]
        assert len(set(digests) - {None}) == 1, (s, digests)
    _same(final)


@SLOW
@pytest.mark.parametrize("mode", ["overlap"])  # (fused passed too at stop 53; left out for CI's time)
@pytest.mark.cell("loop", "compile", membership=True, against="equal")
def test_a_compiled_model_keeps_training_through_a_loss_and_a_join(tmp_path: Path, mode: str) -> None:
    """The forward through torch.compile(model) (compiled once per process; each epoch's
    mode hooks the same parameters, the overlapped one's buckets in the compiled
    backward): a member lost mid-step and replaced, every final member bit-identical."""
    found = run(tmp_path, "process_group", {2: ("mid-step", 10)}, mode=mode, compiled="inductor")
    final = [found[i] for i in (0, 1, 3)]
    for f in final:
        assert f["steps"][-1][:2] == (STEPS, True) and f["world"] == 3, (f["steps"][-3:], f["world"])
    assert all(f["counters"]["losses"] == 1 for f in final[:2])
    _same(final)


@pytest.mark.parametrize("mode, transport, compiled", [
    ("diloco", "process_group", ""),
    pytest.param("localsgd", "shm", "aot_eager",
                 marks=[SLOW, pytest.mark.cell("loop", "compile", membership=True, against="equal")])])
@pytest.mark.cell("loop", "train", membership=True, against="equal")
def test_a_local_update_mode_syncs_again_over_the_survivors(tmp_path: Path, mode: str, transport: str,
                                                           compiled: str) -> None:
    """LocalSGD and DiLoCo (a sync every 4 steps, DiLoCo's in 2 fragments): a member lost
    before a sync fails it; every survivor puts its parameters, anchor, outer and inner
    optimizer state back as before that step and runs it again over the next epoch. No
    step is discarded, and after a last sync every member (the joiner too) holds the
    same parameters, bit for bit (LocalSGD: its model compiled, aot_eager)."""
    found = run(tmp_path, transport, {2: ("mid-step", 10)}, mode=mode, compiled=compiled)
    assert all(f["graphs"] > 0 for f in found.values() if "params" in f) or not compiled
    final = [found[i] for i in (0, 1, 3)]
    for f in final:
        assert f["steps"][-1][:2] == (STEPS, True) and f["world"] == 3
        assert all(ok for _, ok, _, _ in f["steps"])
    for f in final[:2]:
        c = f["counters"]
        assert c["losses"] == 1 and c["resyncs"] == 1 and c["discarded_steps"] == 0, c
    for f in final[1:]:
        assert torch.equal(f["params"], final[0]["params"]), float((f["params"] - final[0]["params"]).abs().max())


def adamw_on_the_mean(worlds: list[int]) -> torch.Tensor:
    """The reference: torch.optim.AdamW on the mean gradient of the members' batches
    (examples/keep_training.py's), ``worlds[s]`` members at step ``s``; the parameters."""
    model = make_model(16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for s, w in enumerate(worlds):
        grads = []
        for r in range(w):
            x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1000 * s + r))
            loss = torch.nn.functional.mse_loss(model(x).squeeze(-1), x.sum(1).sin())
            grads.append(torch.autograd.grad(loss, list(model.parameters())))
        for p, *gs in zip(model.parameters(), *grads):
            p.grad = torch.stack(gs).mean(0)
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("where, transport, joiners", [("after-vote", "process_group", 0),
                                                       pytest.param("mid-step", "process_group", 0, marks=SLOW),
                                                       pytest.param("mid-step", "shm", 1, marks=SLOW)])
@pytest.mark.cell("loop", "train", membership=True, modes=("zero",))
def test_zero_trains_on_with_the_lost_ranks_shard_from_its_copy(tmp_path: Path, where: str, transport: str,
                                                               joiners: int) -> None:
    """ZeRO (AdamW, ``redundant=True``, a bucket per layer): member 2 dies after the
    members' vote at step 10, before its shard steps: the step stands, its shard steps on
    the next rank from the copy kept there, and the survivors' pieces are joined and
    resharded at 2. Against torch.optim.AdamW on the mean gradient (11 steps of 3 members,
    then 2): the same run, to float rounding (a discarded step would move it 1.6e-2).
    Killed mid-step: that step discarded (10 steps of 3, then 2), each survivor receiving its
    new shard and copy point to point; with a replacement, the joiner takes its shard and
    the parameters, every member bit-identical."""
    found = run(tmp_path, transport, {2: (where, 10)}, joiners=joiners, mode="zero")
    final = [found[i] for i in (0, 1, *([3] if joiners else []))]
    for f in final:
        assert f["steps"][-1][:2] == (STEPS, True) and f["world"] == 2 + joiners, (f["steps"][-3:], f["world"])
    for f in final[:2]:
        assert f["counters"]["losses"] == 1, f["counters"]
        assert f["counters"]["discarded_steps"] == (where == "mid-step"), f["counters"]
    _same(final)
    if not joiners:
        three = 11 if where == "after-vote" else 10
        want = adamw_on_the_mean([3] * three + [2] * (STEPS - three))
        assert torch.allclose(final[0]["params"], want, rtol=0, atol=1e-6), float((final[0]["params"] - want).abs().max())


@pytest.mark.parametrize("members, transport", [(4, "process_group"), (6, "process_group"), (6, "shm")])
@pytest.mark.cell("loop", "train", membership=True, modes=("zero",))
def test_a_zero_member_lost_as_the_survivors_reshard_leaves_their_kept_shards_whole(tmp_path: Path, members: int,
                                                                                    transport: str) -> None:
    """ZeRO (AdamW, ``redundant=True``) on 4 (6) members: rank 1 killed mid-step at step 10; as
    the survivors' new optimizers take their shards, the last rank dies too. The others form
    the next epoch from the shards they kept (not from the half-resharded ones), every one of
    them, and train on equal to torch.optim.AdamW on the mean gradient (10 steps of 4 (6), then
    2 (4)). At 6, until 2026-12-06, the survivors not next to the dead one waited in the
    reshard's first gather the group's whole timeout (on live members that had given the epoch
    up), and the others formed the next epoch without them: the job ended, shards lost. On
    shared memory too (its segment set up over the new epoch's group, its buckets moved there)."""
    found = run(tmp_path, transport, {i: ("ranks-mid-step", 10, (1,), (members - 1,)) for i in range(members)},
                joiners=0, mode="zero", members=members)
    final = [f for f in found.values() if "params" in f]
    assert len(final) == members - 2, sorted(found)
    for f in final:
        assert f["steps"][-1][:2] == (STEPS, True) and f["world"] == members - 2, (f["steps"][-3:], f["world"])
        assert f["counters"]["losses"] == 2, f["counters"]
    _same(final)
    want = adamw_on_the_mean([members] * 10 + [members - 2] * (STEPS - 10))
    assert torch.allclose(final[0]["params"], want, rtol=0, atol=1e-6), float((final[0]["params"] - want).abs().max())


@pytest.mark.parametrize("mode", ["gossip", "localsgd"])
def test_a_member_lost_as_the_survivors_build_their_modes_leaves_every_other_survivor_in(tmp_path: Path,
                                                                                       mode: str) -> None:
    """6 members: rank 1 killed mid-step at step 10; as the 5 survivors build their modes for
    the next epoch (``m.at("build")``), the last rank dies too. Every one of the 4 left goes on
    to the last step, in one epoch of 4, bit-identical. Until 2026-12-06 the mode's layout
    check (a plain gather) kept the survivors not next to the dead one for the group's whole
    timeout on live members that had given the epoch up, and those formed the next epoch
    without them (two live members left out)."""
    found = run(tmp_path, "process_group", {i: ("ranks-mid-step", 10, (1,), (5,)) for i in range(6)},
                joiners=0, mode=mode, members=6)
    final = [f for f in found.values() if "params" in f]
    assert len(final) == 4, sorted(found)
    for f in final:
        assert f["steps"][-1][:2] == (STEPS, True) and f["world"] == 4, (f["steps"][-3:], f["world"])
        assert f["counters"]["losses"] == 2, f["counters"]
    for f in final[1:]:  # (their parameters after a last sync, or the exact mean)
        assert torch.equal(f["params"], final[0]["params"]), float((f["params"] - final[0]["params"]).abs().max())


@pytest.mark.parametrize("copies", [2, 1])
@pytest.mark.cell("loop", "train", membership=True, modes=("zero",))
def test_zero_with_k_copies_trains_on_through_k_ranks_lost_at_once(tmp_path: Path, copies: int) -> None:
    """ZeRO (AdamW, a bucket per layer) on 5 members, ranks 1 and 2 killed in the same step
    (mid-step, step 10: neighbours, rank 2 holding rank 1's first copy). ``redundant=2``: rank
    1's shard goes on from its second copy on rank 3, that step is discarded, the 3 survivors
    train on, bit-identical and equal to torch.optim.AdamW on the mean gradient (10 steps of 5,
    then 3) within 1e-6. ``redundant=True`` (one copy): the two lose rank 1's shard; every
    survivor stops with a MembershipError naming it, and no two members ever committed
    different parameters at one step."""
    found = launch(tmp_path, "process_group", {i: ("ranks-mid-step", 10, (1, 2)) for i in range(5)}, joiners=0,
                   mode="zero", members=5, redundant=copies)
    assert not [f["error"] for f in found.values() if "error" in f]
    assert len(found) == 3, sorted(found)  # the two killed saved nothing
    for step in {s for f in found.values() for s in f["digests"]}:
        assert len({f["digests"][step] for f in found.values() if step in f["digests"]}) == 1, step
    final = list(found.values())
    if copies == 1:
        for f in final:
            assert "old rank(s) [1]" in f.get("refused", ""), f.get("refused")
            assert max(f["digests"]) == 10  # 10 steps committed; the one the two died in, discarded
        return
    for f in final:
        assert f["steps"][-1][:2] == (STEPS, True) and f["world"] == 3, (f["steps"][-3:], f["world"])
        assert f["counters"]["discarded_steps"] == 1, f["counters"]
    _same(final)
    want = adamw_on_the_mean([5] * 10 + [3] * (STEPS - 10))
    assert torch.allclose(final[0]["params"], want, rtol=0, atol=1e-6), float((final[0]["params"] - want).abs().max())


def _by_hand(rank: int, world: int, transport: str, mode_name: str) -> torch.Tensor:
    """A mode in a hand-written loop on a plain group: the model, batches and settings of
    the members' (examples/keep_training.py), no Membership; the final parameters."""
    import os

    os.environ["FASTREDUCE_TRANSPORT"] = transport
    from keep_training import build

    torch.set_num_threads(1)
    model = make_model(16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mode = build(mode_name, model, opt)
    net = mode if mode_name == "gossip" else model  # gossip steps and exchanges inside forward and backward
    for s in range(STEPS):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1000 * s + rank))
        torch.nn.functional.mse_loss(net(x).squeeze(-1), x.sum(1).sin()).backward()
        stepper = mode if mode_name == "zero" else opt
        if mode_name in ("fused", "overlap"):
            mode.reduce()
        if mode_name != "gossip":
            stepper.step()
        stepper.zero_grad()
    if mode_name in ("localsgd", "diloco", "diloco-streaming"):
        mode.sync()
    if mode_name == "gossip":
        mode.global_avg()
    mode.close()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("mode", ["fused", "zero", "gossip", "diloco-streaming"])  # (overlap, localsgd: passed at stop 67)
@pytest.mark.cell("loop", "train", "compile", membership=True, modes=("fused", "zero", "gossip", "diloco"))
def test_a_mode_under_a_membership_equals_it_in_a_hand_written_loop(tmp_path: Path, mode: str) -> None:
    """No fault: 3 members through a Membership (its polls and votes, each mode's commit
    style), their model compiled (``torch.compile(model, backend="aot_eager")``; gossip's
    wrapping the compiled model), end where the same mode in a hand-written loop on a plain
    group of 3 with the eager model ends, on the same batches (1e-6; DiLoCo streaming: each
    fragment's all-reduce over the next step). The fused mode's commit of step 10 raises on
    every member (its optimizer step: a ValueError, the user's): it counts no step (``m.step``
    stays 10, the optimizer's count), and each member takes step 10 again: the job still ends
    where the hand-written loop does, every step committed once, AdamW's count 40."""
    from fastreduce.launch import run_ranks

    raises = {i: ("step-raises", 10) for i in range(3)} if mode == "fused" else {}
    found = run(tmp_path, "process_group", raises, joiners=0, mode=mode, compiled="aot_eager")
    final = [found[i] for i in sorted(found)]
    for f in final:
        assert f["steps"][-1][:2] == (STEPS, True) and f["world"] == 3 and f["counters"]["losses"] == 0
        assert f["graphs"] > 0, f["graphs"]  # (compiled, graphs captured)
        if raises:  # m.step before and after the commit that raised; then every step committed once
            assert f.get("raised") == (10, 10), f"the commit that raised moved m.step: {f.get('raised')}"
            assert [s for s, ok, _, _ in f["steps"] if ok] == list(range(1, STEPS + 1))
            assert f["adam_step"] == [float(STEPS)] * len(f["adam_step"]), f["adam_step"]
    want = run_ranks(_by_hand, 3, "process_group", mode, timeout=120)[0]  # (every rank's the same at the end)
    for f in final:
        assert torch.allclose(f["params"], want, rtol=0, atol=1e-6), (mode, float((f["params"] - want).abs().max()))


RESHARDED = ("fused", "overlap", "zero")  # the modes whose state loads onto another world size


@pytest.mark.parametrize("mode", [
    *[pytest.param(m, marks=pytest.mark.cell("loop", "resume", "reshard", membership=True)) for m in RESHARDED],
    *[pytest.param(m, marks=pytest.mark.cell("loop", "resume", membership=True, modes=(m.split("-")[0],)))
      for m in ("localsgd", "diloco-streaming", "gossip")]])
def test_a_job_saved_as_it_trains_resumes_as_if_it_had_never_stopped(tmp_path: Path, mode: str) -> None:
    """``Membership(checkpoints=JobCheckpoints(dir, every=16))``: each member writes its part
    of the job after committing steps 16 and 32 (no collective). A new job (a new coordinator,
    new processes) started on the same directory resumes at step 32: on 3 members it ends
    where the uninterrupted job ends, bit for bit (parameters and AdamW's state; the local
    modes and gossip: after their last sync); on 2, the modes whose state loads onto another
    world size end where ``torch.optim.AdamW`` on the mean gradient of 3 ranks for 32 steps,
    then of 2, ends (1e-6), and the per-rank modes are refused on every first member with
    nothing loaded."""
    from fastreduce.job_checkpoints import JobCheckpoints
    from fastreduce.modes.contract import PER_RANK_ONLY_AT_ITS_WORLD

    saves = tmp_path / "saves"
    for out in ("first", "again", "fewer"):
        (tmp_path / out).mkdir()
    first = run(tmp_path / "first", "process_group", {}, joiners=0, mode=mode, checkpoints=str(saves))
    assert sorted(first) == [0, 1, 2], sorted(first)
    found = JobCheckpoints(saves, every=16).newest()
    assert found is not None and (found.step, found.world) == (32, 3), found
    assert sorted(p.name for p in saves.iterdir()) == ["step-00000016", "step-00000032"]
    per_rank = mode not in RESHARDED
    for members, out in ((3, "again"), (2, "fewer")):
        found = launch(tmp_path / out, "process_group", {}, 0, mode=mode, checkpoints=str(saves), members=members)
        final = [found[i] for i in sorted(found)]
        assert len(final) == members, sorted(found)
        if per_rank and members == 2:
            for f in final:
                assert PER_RANK_ONLY_AT_ITS_WORLD in f.get("refused", "") and "start it with world_size=3" in f["refused"], f
            continue
        for f in final:
            assert "error" not in f, f["error"]
            assert f["joined_at"] == 32 and f["steps"][0][0] == 33 and f["steps"][-1][:2] == (STEPS, True), f["steps"][:2]
            assert f["world"] == members and f["counters"]["losses"] == 0
        for f in final:  # (a local mode's AdamW state is each rank's own: each equals one rank's of the first job)
            assert torch.equal(f["params"], final[0]["params"])
            if members == 3:
                assert any(torch.equal(f["adam"], g["adam"]) and f["adam_step"] == g["adam_step"] for g in first.values())
        if members == 3:
            assert torch.equal(final[0]["params"], first[0]["params"])
        else:
            _same(final)
            want = adamw_on_the_mean([3] * 32 + [2] * (STEPS - 32))
            assert torch.allclose(final[0]["params"], want, rtol=0, atol=1e-6), float((final[0]["params"] - want).abs().max())


@pytest.mark.parametrize("mode", [
    pytest.param(m, marks=pytest.mark.cell("accelerate", "train", "resume", "compile",
                                           *(("reshard",) if m in RESHARDED else ()), membership=True,
                                           modes=(m.split("-")[0],)))
    for m in ("fused", "overlap", "zero", "localsgd", "diloco-streaming", "gossip")])
def test_an_accelerate_loop_under_a_membership_equals_the_hand_written_one_and_resumes(tmp_path: Path, mode: str) -> None:
    """The loop an Accelerate user writes (the model prepared by an ``Accelerator``, which sees
    one process and adds no DDP, and compiled by it: ``dynamo_backend="aot_eager"``;
    ``accelerator.backward``; the optimizer it wraps stepped in the commit), 3 members
    through a Membership that saves the job every 16 steps: ends where the same mode in a
    hand-written loop on a plain group with the eager model ends (1e-6); a new job on the
    same directory resumes at step 32 and ends where the first ended, bit for bit. The
    fused, overlapped and ZeRO modes resume on 2 members too, ending where
    ``torch.optim.AdamW`` on the mean gradient of 3 ranks for 32 steps, then of 2, ends (1e-6)."""
    pytest.importorskip("accelerate", reason="the hf extra is not installed: pip install 'fastreduce[hf]'")
    from fastreduce.launch import run_ranks

    saves = str(tmp_path / "saves")
    runs = []
    for out, members in (("first", 3), ("again", 3), ("fewer", 2)):
        if members == 2 and mode not in RESHARDED:
            continue
        (tmp_path / out).mkdir()
        found = run(tmp_path / out, "process_group", {}, joiners=0, mode=mode, accelerate=True, checkpoints=saves,
                    compiled="aot_eager", members=members)
        assert sorted(found) == list(range(members)), sorted(found)
        runs.append([found[i] for i in sorted(found)])
    first, again, *fewer = runs
    for run_ in fewer:
        for f in run_:
            assert f["joined_at"] == 32 and f["steps"][-1][:2] == (STEPS, True) and f["world"] == 2, f["steps"][:2]
        _same(run_)
        want = adamw_on_the_mean([3] * 32 + [2] * (STEPS - 32))
        assert torch.allclose(run_[0]["params"], want, rtol=0, atol=1e-6), float((run_[0]["params"] - want).abs().max())
    want = run_ranks(_by_hand, 3, "process_group", mode, timeout=120)[0]
    for f in first:
        assert f["steps"][-1][:2] == (STEPS, True) and f["counters"]["losses"] == 0 and f["graphs"] > 0
        assert torch.allclose(f["params"], want, rtol=0, atol=1e-6), (mode, float((f["params"] - want).abs().max()))
    for f in again:
        assert f["joined_at"] == 32 and f["steps"][-1][:2] == (STEPS, True), f["steps"][:2]
        assert torch.equal(f["params"], first[0]["params"]), float((f["params"] - first[0]["params"]).abs().max())


@pytest.mark.parametrize("kills, transport", [({2: ("between", 11)}, "process_group")])  # (mid-step, shm: stop 67)
@pytest.mark.cell("loop", "train", membership=True, modes=("diloco",), against="equal")
def test_streaming_diloco_sends_a_fragment_in_flight_again_over_the_survivors(
        tmp_path: Path, kills: dict, transport: str) -> None:
    """DiLoCo with ``fragment_delay=1`` (2 fragments, a sync every 4 steps): each fragment's
    all-reduce runs over the next inner step. Member 2 lost with fragment 1 in flight
    (launched at step 11, due at 12; it dies after step 11, or inside step 12's backward):
    every survivor puts back its state as before step 12 and sends its own payload of
    fragment 1 again, over the survivors, at step 12 redone; a replacement joins afterwards;
    nothing is discarded, every final member bit-identical."""
    found = run(tmp_path, transport, kills, joiners=1, mode="diloco-streaming")
    final = [found[i] for i in sorted(found) if i not in kills]
    for f in final:
        assert f["steps"][-1][:2] == (STEPS, True) and f["world"] == 3, (f["steps"][-3:], f["world"])
        assert all(ok for _, ok, _, _ in f["steps"])
    for f in final[1:]:
        assert torch.equal(f["params"], final[0]["params"]), float((f["params"] - final[0]["params"]).abs().max())
    for f in final[:2]:
        c = f["counters"]
        assert c["losses"] == 1 and c["resyncs"] == 1 and c["discarded_steps"] == 0, c


def _by_parameter(mode: Any, k: int, wire: torch.Tensor) -> dict[str, torch.Tensor]:
    """Fragment ``k``'s ``wire`` read per parameter, through the mode's own layout."""
    out, at = {}, 0
    for j in mode._frag_segments[k]:
        seg = mode.layout.segments[j]
        out.update({slot.name: wire[at + slot.offset:at + slot.offset + slot.numel].clone() for slot in seg.slots})
        at += seg.numel
    return out


def _saved_in_flight(rank: int, world: int, states: list | None) -> Any:
    """Streaming DiLoCo with the wire summed in fp32 (its segments padded to a multiple of the
    world size). ``states`` None: one step (fragment 0 launched, in flight), then its state
    without waiting (the payload) and with (the average), each read per parameter. Else:
    each state loaded at this world size, read back per parameter."""
    from keep_training import make_model as make

    model = make(16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outer = torch.optim.SGD(model.parameters(), lr=0.7)
    mode = fastreduce.DiLoCo(model, opt, outer, sync_every=4, fragments=2, fragment_delay=1,
                             accumulate_dtype=torch.float32)
    mode.keep_sent()
    if states is None:
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(rank))
        torch.nn.functional.mse_loss(model(x).squeeze(-1), x.sum(1).sin()).backward()
        opt.step()
        sent, averaged = mode.local_state_dict(), mode.state_dict()
        return (sent, _by_parameter(mode, 0, sent["to_send"][0]), averaged,
                _by_parameter(mode, 0, averaged["in_flight"][0]), mode.layout.segments[0].numel)
    mode.load_state_dict(states[rank][0])
    sent = _by_parameter(mode, 0, mode._sent)
    mode.load_state_dict(states[rank][2])
    return sent, _by_parameter(mode, 0, mode._frag_wire[0]), mode.layout.segments[0].numel


def test_a_fragment_in_flight_loads_at_another_world_size() -> None:
    """What a Membership keeps of streaming DiLoCo across an epoch of another size: the
    fragment in flight, as this rank's payload (after a loss) or as its average (at a
    join), saved at 3 ranks and loaded at 2, where the segments are padded otherwise:
    every parameter's part the same, bit for bit."""
    from fastreduce.launch import run_ranks

    saved = run_ranks(_saved_in_flight, 3, None, timeout=120)
    loaded = run_ranks(_saved_in_flight, 2, saved, timeout=120)
    assert saved[0][4] != loaded[0][2], "the layouts must differ for this test to mean anything"
    for (_, sent, _, averaged, _), (sent_at_2, averaged_at_2, _) in zip(saved, loaded):
        assert sent.keys() == sent_at_2.keys() and averaged.keys() == averaged_at_2.keys()
        assert all(torch.equal(sent[n], sent_at_2[n]) for n in sent)
        assert all(torch.equal(averaged[n], averaged_at_2[n]) for n in averaged)
        assert any(t.abs().sum() > 0 for t in sent.values())


@pytest.mark.parametrize("mode", ["diloco"])  # (LocalSGD, the same _load, passed at stop 53)
def test_a_local_update_mode_goes_on_at_a_smaller_world(tmp_path: Path, mode: str) -> None:
    """No replacement: the sync is redone over 2 members, whose mode's state, kept at 3
    (its blocks padded to a multiple of the world size), loads at 2; they train on to
    the end with the same parameters after a last sync."""
    found = run(tmp_path, "process_group", {2: ("mid-step", 10)}, joiners=0, mode=mode)
    final = [found[0], found[1]]
    for f in final:
        assert f["steps"][-1][:2] == (STEPS, True) and f["world"] == 2, (f["steps"][-3:], f["world"])
        assert f["counters"]["resyncs"] == 1 and f["counters"]["discarded_steps"] == 0, f["counters"]
    assert torch.equal(final[0]["params"], final[1]["params"])


@pytest.mark.parametrize("transport, where", [("process_group", "mid-step"),
                                             pytest.param("shm", "between", marks=SLOW)])
@pytest.mark.cell("loop", "train", membership=True, modes=("gossip",), against="equal")
def test_gossip_goes_on_over_the_survivors_ring(tmp_path: Path, transport: str, where: str) -> None:
    """Gossip (a ring, each bucket's AdamW inside the mode, commit() running the step's
    forward and backward): a member lost; the survivors drop the exchanges in flight, keep
    their own parameters and optimizer state, and rebuild the ring over themselves at one
    agreed round; the replacement takes rank 0's parameters, optimizers and round. Every
    step is committed once on each final member, and their exact mean (global_avg) is the
    same on all, bit for bit."""
    found = run(tmp_path, transport, {2: (where, 10)}, mode="gossip")
    final = [found[i] for i in (0, 1, 3)]
    for f in final:
        assert f["steps"][-1][:2] == (STEPS, True) and f["world"] == 3, (f["steps"][-3:], f["world"])
        committed = [s for s, ok, _, _ in f["steps"] if ok]
        assert committed == list(range(f["joined_at"] + 1, STEPS + 1))
    for f in final[:2]:
        assert f["counters"]["losses"] == 1 and f["counters"]["joins"] == 1, f["counters"]
    for f in final[1:]:
        assert torch.equal(f["params"], final[0]["params"]), float((f["params"] - final[0]["params"]).abs().max())


@SLOW
@pytest.mark.parametrize("transport", ["process_group"])  # (shm passed too at stop 53)
def test_the_joiners_source_lost_while_it_heals_it_heals_from_another(tmp_path: Path, transport: str) -> None:
    """Member 2 dies at step 10; its replacement is admitted, and the member sending it the
    state dies as it starts: the survivor and the joiner form the next epoch, where the
    survivor (the one member holding the state) heals the joiner; they train on to the end,
    bit-identical."""
    found = launch(tmp_path, transport, {0: ("in-heal", 0), 1: ("in-heal", 0), 2: ("mid-step", 10)},
                   release_after=[2])
    final = [f for f in found.values() if "params" in f]
    assert len(final) == 2 and 3 in found and "params" in found[3], {i: f.get("error") for i, f in found.items()}
    for f in final:
        assert "error" not in f, f["error"]
        assert f["steps"][-1][:2] == (STEPS, True) and f["world"] == 2
    survivor = next(f for f in final if f["index"] != 3)
    assert survivor["counters"]["losses"] == 2, survivor["counters"]
    _same(final)


@pytest.mark.parametrize("mode", ["fused", "zero", pytest.param("diloco", marks=SLOW)])  # (gossip passed at stop 53)
def test_a_member_that_leaves_is_out_at_the_next_poll_with_nothing_discarded(tmp_path: Path, mode: str) -> None:
    """Member 2 asks to leave at step 10 (a spot instance's notice): it trains on until the
    members' next poll (DiLoCo: its next sync), then is out; the others go on at 2 without
    a loss, no step discarded, within a fraction of a second. ZeRO (``redundant=True``, 4
    members): ranks 1 and 2 ask at the same step, rank 2 holding the only copy of rank 1's
    shard: rank 1 is out at the poll, rank 2 at the next one (the next epoch's first, its
    copies placed again), nothing lost; the 2 left bit-identical and equal to
    torch.optim.AdamW on the mean gradient (4 members, then 3, then 2)."""
    if mode == "zero":  # (both at once, the 2 left lost rank 1's shard: MembershipError)
        found = run(tmp_path, "process_group", {i: ("ranks-leave", 10, (1, 2)) for i in range(4)}, joiners=0,
                    mode=mode, members=4)
        leavers = [f for f in found.values() if "left_at" in f]
        final = [f for f in found.values() if "left_at" not in f]
        assert len(leavers) == 2 and len(final) == 2, sorted(found)
    else:
        found = run(tmp_path, "process_group", {2: ("leaves", 10)}, joiners=0, mode=mode)
        leavers, final = [found[2]], [found[0], found[1]]
    for leaver in leavers:
        assert leaver["left_at"] >= 10 and leaver["counters"]["leaves"] >= 1, leaver
    for f in final:
        assert "refused" not in f, f["refused"]
        assert f["steps"][-1][:2] == (STEPS, True) and f["world"] == 2, (f["steps"][-3:], f["world"])
        assert all(ok for _, ok, _, _ in f["steps"])
        c = f["counters"]
        assert c["losses"] == 0 and c["discarded_steps"] == 0 and c["leaves"] == len(leavers), c
        assert max(sec for why, sec in c["stalls"] if why == "leave") < 1.0, c["stalls"]
        # an epoch change opens no connection to the coordinator: its server looks up the name of
        # each client that connects, on the thread that answers every member (a slow resolver
        # stalled the whole job: 5 s, a dropped query's wait, in CI)
        assert f["connections_end"] and f["connections_end"] <= f["connections"], (f["connections"], f["connections_end"])
    if mode == "fused":
        _same(final)
    elif mode == "zero":
        _same(final)
        a, b = sorted(f["left_at"] for f in leavers)
        assert a < b, (a, b)  # one poll apart
        want = adamw_on_the_mean([4] * a + [3] * (b - a) + [2] * (STEPS - b))
        assert torch.allclose(final[0]["params"], want, rtol=0, atol=1e-6), float((final[0]["params"] - want).abs().max())
    else:
        assert torch.equal(final[0]["params"], final[1]["params"])


def test_a_member_that_leaves_as_another_is_lost_counts_one_leave_and_one_loss(tmp_path: Path) -> None:
    """Of 4 members, member 1 asks to leave at step 10 and member 2 dies between steps at the
    same step: the survivors count 1 loss (member 2's, named) and 1 leave, never the leaver
    as lost; member 1 is out, the replacement in, every final member bit-identical."""
    found = run(tmp_path, "process_group", {1: ("leaves", 10), 2: ("between", 10)}, joiners=1, members=4)
    assert 2 not in found and found[1]["left_at"] >= 10, sorted(found)
    final = [found[i] for i in (0, 3, 4)]
    for f in final:
        assert f["steps"][-1][:2] == (STEPS, True) and f["world"] == 3, (f["steps"][-3:], f["world"])
    for f in final[:2]:
        c = f["counters"]
        assert (c["losses"], c["leaves"], c["joins"]) == (1, 1, 1), c
        assert len(c["lost"]) == 1 and found[1]["name"] not in c["lost"][0], c["lost"]
    _same(final)


@SLOW
def test_an_extra_process_joins_a_running_job_and_the_world_grows(tmp_path: Path) -> None:
    """No loss: a fourth process joins the 3 members mid-run (started with them: whichever
    takes the last ticket is the extra one), is admitted at a poll, takes the state from
    rank 0 and trains on with them at world 4, bit-identical."""
    found = launch(tmp_path, "process_group", {}, joiners=1, release_after=[-1])
    final = [found[i] for i in (0, 1, 2, 3)]
    for f in final:
        assert "error" not in f, f["error"]
        assert f["steps"][-1][:2] == (STEPS, True) and f["world"] == 4 and f["epoch"] == 1, (f["world"], f["epoch"])
        assert all(ok for _, ok, _, _ in f["steps"])
    late = [f for f in final if f["joined_at"] > 0]  # the last to take a ticket (the extra one, as a rule)
    assert len(late) == 1 and late[0]["joined_at"] < STEPS, [f["joined_at"] for f in final]
    assert all(f["counters"]["joins"] == 1 and f["counters"]["losses"] == 0 for f in final if f is not late[0]), \
        [f["counters"] for f in final]
    _same(final)


@SLOW
def test_a_survivor_slow_to_see_the_loss_is_waited_for_while_it_beats(tmp_path: Path) -> None:
    """Member 2 dies at step 10 while member 1 is in a 3 s step: member 0 registers for the
    next epoch at once, and waits past the loss window for member 1, whose heartbeat still
    beats in the old epoch, instead of leaving it out (the job would have lost a live
    member); the replacement joins, all three bit-identical."""
    found = launch(tmp_path, "process_group", {1: ("slow", 10), 2: ("mid-step", 10)}, release_after=[2])
    final = [found[0], found[1], found[3]]
    for f in final:
        assert "error" not in f and "refused" not in f, f.get("error") or f.get("refused")
        assert f["steps"][-1][:2] == (STEPS, True) and f["world"] == 3, (f["steps"][-3:], f["world"])
    assert found[0]["counters"]["losses"] == 1 and found[1]["counters"]["losses"] == 1
    _same(final)


@SLOW
def test_a_member_lost_as_the_next_epoch_forms_is_named_in_seconds_not_the_groups_timeout(tmp_path: Path) -> None:
    """Member 2 dies at step 10; member 1 dies as it enters the epoch that drops member 2,
    before that epoch's group exists. Member 0 (and the replacement, if admitted there)
    name it at the coordinator's rendezvous within seconds (the group's own rendezvous
    would wait its 600 s timeout), form the next epoch and train on with the replacement."""
    found = launch(tmp_path, "process_group", {1: ("in-enter", 1), 2: ("mid-step", 10)}, release_after=[2])
    final = [found[0], found[3]]
    for f in final:
        assert "error" not in f, f["error"]
        assert f["steps"][-1][:2] == (STEPS, True) and f["world"] == 2, (f["steps"][-3:], f["world"])
    assert found[0]["counters"]["losses"] == 2, found[0]["counters"]
    assert max(s for why, s in found[0]["counters"]["stalls"] if why == "loss") < 30, found[0]["counters"]["stalls"]
    _same(final)


@pytest.mark.parametrize("mode", ["fused", pytest.param("zero", marks=SLOW)])
def test_a_first_member_lost_as_the_job_forms_leaves_the_others_to_found_it_again(tmp_path: Path, mode: str) -> None:
    """Member 2 dies as it enters epoch 0, before its group exists: nobody holds a committed
    state yet, so members 0 and 1 (who hold the job's start) found it again as epoch 1,
    rank 0's state sent to the other as at epoch 0, and train on; the replacement joins them
    (it used to be 60 s of waiting for a member holding the state, then every process refused)."""
    found = launch(tmp_path, "process_group", {2: ("in-enter", 0)}, release_after=[2], mode=mode)
    assert 2 not in found or "params" not in found[2], found[2]
    final = [found[0], found[1], found[3]]
    for f in final:
        assert "error" not in f and "refused" not in f, f.get("error") or f.get("refused")
        assert f["steps"][-1][:2] == (STEPS, True) and f["world"] == 3, (f["steps"][-3:], f["world"])
        assert [s for s, ok, _, _ in f["steps"] if ok] == list(range(f["joined_at"] + 1, STEPS + 1))
    assert found[0]["counters"]["losses"] == 1 and found[0]["joined_at"] == 0, found[0]["counters"]
    _same(final)


@SLOW
def test_a_member_slow_to_enter_the_next_epoch_is_waited_for_while_its_pulse_beats(tmp_path: Path) -> None:
    """Member 2 dies at step 10; member 1 enters the epoch that drops it 8 s late (a starved
    process: past the 5 s the members give each other to enter), its pulse beating. Member 0
    waits for it instead of leaving it out, and neither goes into the epoch's group without
    the other (that one would wait there for the group's timeout): the replacement joins
    after, all three bit-identical."""
    found = launch(tmp_path, "process_group", {1: ("slow-enter", 1), 2: ("mid-step", 10)}, release_after=[2])
    final = [found[0], found[1], found[3]]
    for f in final:
        assert "error" not in f and "refused" not in f, f.get("error") or f.get("refused")
        assert f["steps"][-1][:2] == (STEPS, True) and f["world"] == 3, (f["steps"][-3:], f["world"])
    assert found[0]["counters"]["losses"] == 1 and found[1]["counters"]["losses"] == 1, \
        (found[0]["counters"], found[1]["counters"])
    _same(final)


@pytest.mark.parametrize("mode", ["fused", pytest.param("zero", marks=SLOW), pytest.param("diloco", marks=SLOW)])
@pytest.mark.cell("loop", "train", membership=True, modes=("fused", "zero", "diloco"))
def test_a_member_frozen_past_the_loss_window_joins_the_job_again_once_it_thaws(tmp_path: Path, mode: str) -> None:
    """Member 2 stopped whole mid-step at step 10 (SIGSTOP: every thread, its heartbeat too;
    SIGCONT 4 s later), as a host that hangs or a process the OS stops: the others find it
    silent and go on without it. Thawed, it finds itself left out of their epoch and joins the
    job again in the same process (a ticket, admitted at their next poll, their state sent it),
    its commit of that step ``False``; all three reach the last step in one epoch of 3 with the
    same parameters (and AdamW state, where the members share it), each step committed once.
    Until 2026-12-06 it raised ``MembershipError`` ("left out of epoch 1 ... start it again")."""
    found = run(tmp_path, "process_group", {2: ("frozen", 10)}, joiners=0, mode=mode, steps=300)
    final = [found[i] for i in range(3)]
    for f in final:
        assert f["steps"][-1][:2] == (300, True) and f["world"] == 3 and f["epoch"] == 2, (f["steps"][-3:], f["epoch"])
    for f in final[:2]:
        c = f["counters"]
        assert c["losses"] == 1 and c["joins"] == 1 and c["rejoins"] == 0, c
        committed = [s for s, ok, _, _ in f["steps"] if ok]
        assert committed == sorted(set(committed)) and committed[-1] == 300, committed[-5:]
    again = final[2]
    assert again["froze"] == 10 and again["counters"]["rejoins"] == 1, again["counters"]
    back = next(k for k, (s, ok, e, _) in enumerate(again["steps"]) if e == 2)  # its commit that joined again
    assert again["steps"][back][1] is False and again["steps"][back][0] > 10, again["steps"][back - 1:back + 2]
    if mode == "diloco":  # (each member's inner AdamW state is its own: the parameters after the last sync)
        assert all(torch.equal(f["params"], final[0]["params"]) for f in final)
    else:
        _same(final)


@pytest.mark.parametrize("mode, transport", [("zero", "process_group"), pytest.param("overlap", "shm", marks=SLOW)])
def test_a_member_frozen_inside_backward_joins_again_its_failed_launches_kept_for_its_commit(
        tmp_path: Path, mode: str, transport: str) -> None:
    """Of 4 members, member 2 stopped whole (4 s) inside backward at step 10, as its first
    layer's gradient is computed (the later layers' buckets launched); meanwhile the others
    lose it and go on, and member 3 dies at step 14. Thawed, member 2 launches its first
    layer's bucket on its old group, whose member 3 is gone: the launch fails at once (ZeRO's
    sends on Gloo: the connection closed; the shared-memory transport: a member exited). The
    failure is kept for its commit (the step discarded there, the member left out and back
    in the job), not raised out of the user's ``loss.backward()`` (until 2026-12-07 the
    process ended with ``RankLostError``, found by ``bench chaos --freeze``); the three left
    bit-identical at the last step."""
    found = run(tmp_path, transport, {2: ("frozen-in-backward", 10), 3: ("between", 14)}, joiners=0, mode=mode,
                steps=300, members=4)
    final = [found[i] for i in range(3)]
    for f in final:
        assert f["steps"][-1][:2] == (300, True) and f["world"] == 3, (f["index"], f["steps"][-3:], f["world"])
    assert found[2]["froze"] == 10 and found[2]["counters"]["rejoins"] == 1, found[2]["counters"]
    _same(final)


def test_a_member_frozen_as_it_enters_an_epoch_goes_no_further_into_it_and_joins_again(tmp_path: Path) -> None:
    """Member 2 stopped whole (4 s) as it builds its mode for epoch 1 (formed for a fourth
    process joining): the others lose it at epoch 1's first-step meeting and form epoch 2
    without it. Thawed, it finishes building and comes to that meeting, which every member
    had come to: it sees that the others gave the epoch up (it went into it alone and waited
    in a collective on members that had left, until they exited: the job was over before it
    was admitted) and joins again: all four at the last step, bit-identical."""
    found = run(tmp_path, "process_group", {2: ("frozen-at", "build", 1)}, joiners=1, release_after=[-1], steps=300)
    final = [found[i] for i in range(4)]
    for f in final:
        assert f["steps"][-1][:2] == (300, True) and f["world"] == 4, (f["index"], f["steps"][-3:], f["world"])
    assert found[2]["counters"]["rejoins"] == 1, found[2]["counters"]
    _same(final)


@pytest.mark.parametrize("asked, mode", [("leaves-frozen", "fused"), ("evicted-frozen", "zero")])
def test_a_member_frozen_after_it_asked_to_leave_is_out_once_it_thaws(tmp_path: Path, asked: str, mode: str) -> None:
    """Member 2 asks to leave at step 10 (or is asked to, as the straggler policy asks) and is
    stopped whole in that step (4 s), before a poll answered the request: the others lose it
    and go on at 2; thawed and left out of their epoch, it is out as asked (``m.left``), not
    back in the job (where the policy's spare took its place), and ends with no error (ZeRO:
    its loop's ``m.mode.zero_grad()`` after that step runs on the last epoch's mode, closed)."""
    found = run(tmp_path, "process_group", {2: (asked, 10)}, joiners=0, steps=300, mode=mode)
    leaver, final = found[2], [found[0], found[1]]
    assert leaver["froze"] == 10 and leaver["left_at"] >= 10 and leaver["counters"]["rejoins"] == 0, leaver
    for f in final:
        assert f["steps"][-1][:2] == (300, True) and f["world"] == 2, (f["steps"][-3:], f["world"])
        assert f["counters"]["losses"] == 1 and f["counters"]["joins"] == 0, f["counters"]
    _same(final)


@pytest.mark.parametrize("mode", ["fused", "zero"])
def test_a_member_frozen_until_the_job_ended_is_out_once_it_thaws_with_no_error(tmp_path: Path, mode: str) -> None:
    """Member 2 stopped whole mid-step at step 10 of a 40-step job until the others have
    finished the job at 2 and closed. Back, it finds itself left out and asks to join again;
    the job is over, so it is out (``m.left``, its loop ended, no error: the job's result is
    the others'), not stopped with "the job ended before it admitted this process" as a late
    replacement is. ZeRO: ``m.mode`` is the last epoch's mode, closed, as for a member that left
    at a poll (it was ``None``: the loop's ``m.mode.zero_grad()`` raised; chaos seed 27, shared memory)."""
    found = run(tmp_path, "process_group", {2: ("frozen-past-end", 10)}, joiners=0, steps=40, mode=mode)
    away, final = found[2], [found[0], found[1]]
    assert "refused" not in away, away.get("refused")
    assert away["froze"] == 10 and away["left_at"] == 10 and away["counters"]["rejoins"] == 1, away
    for f in final:
        assert f["steps"][-1][:2] == (40, True) and f["world"] == 2, (f["steps"][-3:], f["world"])
        assert f["counters"]["losses"] == 1 and f["counters"]["joins"] == 0, f["counters"]
    _same(final)


@SLOW
def test_two_members_lost_at_once_leave_one_below_min_ranks_who_waits_for_a_joiner(tmp_path: Path) -> None:
    found = run(tmp_path, "process_group", {1: ("mid-step", 8), 2: ("mid-step", 8)}, joiners=1)
    final = [found[i] for i in (0, 3)]
    for f in final:
        assert f["steps"][-1][:2] == (STEPS, True) and f["world"] == 2
    assert found[0]["counters"]["discarded_steps"] == 1
    _same(final)


@SLOW
def test_a_joiner_with_another_layout_is_refused_and_the_members_train_on(tmp_path: Path) -> None:
    found = run(tmp_path, "process_group", {2: ("between", 6)}, joiners=1, joiner_width=12)
    assert "refused" in found[3] and "model.0.weight [12, 8]" in found[3]["refused"], found[3]
    assert "[16, 8]" in found[3]["refused"]
    final = [found[0], found[1]]
    for f in final:
        assert f["steps"][-1][:2] == (STEPS, True) and f["world"] == 2 and f["counters"]["joins"] == 0
    _same(final)


@pytest.mark.parametrize("mode, start", [("fused", 5), pytest.param("zero", 0, marks=SLOW)])
def test_a_warm_spare_waits_while_the_job_is_whole_and_takes_a_lost_members_place_at_once(tmp_path: Path,
                                                                                         mode: str, start: int) -> None:
    """A spare (``spare=True``) started with the job registers and waits: the job trains with
    ``world_size`` members, never one more. Member 2 killed mid-step at step 10: the epoch the
    survivors form at that loss holds the spare, with the state, so the world is back at full
    size as they enter it (no poll later). Every final member bit-identical. The spare's ticket
    is taken before the first members', so epoch 0's founding sees it; the fused job is one
    resumed at step 5 (``join(start_step=5)`` on the first members; the spare, a joiner, gives
    none): the spare is not refused for starting elsewhere."""
    found = run(tmp_path, "process_group", {2: ("mid-step", 10)}, release_after=[-1], spares=True, mode=mode,
                start_step=start)
    assert "refused" not in found[3], found[3]["refused"]
    final = [found[i] for i in (0, 1, 3)]
    assert 2 not in found
    for f in (found[0], found[1]):
        worlds = {(e, w) for _, _, e, w in f["steps"]}
        assert worlds == {(0, 3), (1, 3)}, worlds  # whole, then whole again at the loss's epoch: never 4, never 2
        assert f["counters"]["losses"] == 1 and f["counters"]["joins"] == 1 and f["steps"][0][0] == start + 1
    spare = found[3]
    assert spare["joined_at"] == 10 and {e for _, _, e, _ in spare["steps"]} == {1}
    for f in final:
        assert f["steps"][-1][:2] == (STEPS, True)
    _same(final)


def test_a_warm_spare_the_job_never_needed_ends_once_the_members_close(tmp_path: Path) -> None:
    """2 members and a warm spare, no loss: the members train to the end and close; the spare,
    which waited the whole run, sees every member of the job's last epoch closed and its
    join() returns (``left`` set, no epoch entered) within seconds: its process ends by itself
    (it waited until killed), as a Slurm step or a pod that exits 0. A commit() after it says why."""
    found = run(tmp_path, "process_group", {}, release_after=[-1], spares=True, members=2)
    spare = found[2]
    assert spare.get("unneeded") and "steps" in spare and not spare["steps"], spare
    assert "left the job (a spare: the job ended without needing it)" in spare["commit_after"], spare
    end = max(f["times"][STEPS] for f in (found[0], found[1]))
    assert spare["ended_at"] - end < 10, (spare["ended_at"], end)  # (it looks once a second; launch waits 180 s)
    for f in (found[0], found[1]):
        assert f["steps"][-1][:2] == (STEPS, True) and f["world"] == 2 and f["counters"]["joins"] == 0
    _same([found[0], found[1]])


def _coordinator_killed(tmp_path: Path, kill: tuple | None, steps: int, ready: str, after_s: float = 0.0,
                        then: Any = None) -> float:
    """2 members (``keep_training.member``, ``kill``) on a coordinator of its own, killed
    ``after_s`` after both wrote ``member<i>.<ready>`` (``then()`` after it); when it was killed."""
    import signal
    import time

    from keep_training import member
    from launching import coordinator_process, members_wrote

    from fastreduce.launch import rank_context

    with coordinator_process() as (coordinator, port):
        ctx = rank_context("keep_training")
        procs = [ctx.Process(target=member, args=(i, port, str(tmp_path), "process_group", kill, None),
                             kwargs={"steps": steps, "world": 2}) for i in range(2)]
        for p in procs:
            p.start()
        members_wrote(tmp_path, 2, ready, procs)
        time.sleep(after_s)
        killed = time.time()
        coordinator.send_signal(signal.SIGKILL)
        coordinator.wait(10)
        if then is not None:
            then()
        for p in procs:
            p.join(60)
            assert not p.is_alive(), "a member hangs after its coordinator died"
    return killed


@SLOW
def test_the_coordinator_lost_is_a_clear_error_within_seconds(tmp_path: Path) -> None:
    """The coordinator is the job's single point: killed mid-run, every member raises
    MembershipError naming it within seconds (no hang, whatever the group's timeout)."""
    killed = _coordinator_killed(tmp_path, None, 100_000, "joined", after_s=0.5)
    for i in range(2):
        f = torch.load(tmp_path / f"member{i}.pt", weights_only=False)
        assert "error" not in f, f["error"]
        assert "the coordinator (127.0.0.1:" in f["refused"] and "stopped answering" in f["refused"], f["refused"]
        assert f["failed_at"] - killed < 10, f["failed_at"] - killed


def test_a_close_that_cannot_reach_the_coordinator_is_a_clear_error(tmp_path: Path) -> None:
    """A member's last steps are confirmed as the job's at its close(): the coordinator killed
    after both members' last commit and before their close(), each close() raises
    MembershipError naming the steps it could not confirm (a link lost in the last step's
    reduction can leave that step completed on one side of a partition and discarded by the
    side that reaches the coordinator: tests/test_membership_partition.py), after closing all
    the same (no thread of the member left running)."""
    _coordinator_killed(tmp_path, ("held-before-close",), 12, "finished", then=(tmp_path / "close.go").touch)
    found = [torch.load(tmp_path / f"member{i}.pt", weights_only=False) for i in range(2)]
    for f in found:
        assert "error" not in f, f["error"]
        assert f["steps"][-1][:2] == (12, True), f["steps"][-1]
        assert "closed with its 12 committed steps not confirmed" in f.get("refused", ""), f.get("refused")
        assert "stopped answering" in f["refused"], f["refused"]
    _same(found)


def test_a_close_confirms_its_last_step_only_where_no_other_member_ended_with_fewer_steps(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """close() waits for the other members' word on their end (fastreduce/ending.py). Epoch 0
    of "w1".."w3" at a real coordinator, w1 ended with 5 steps: w2 ended with 4 (its close()
    wrote so): w1's close() raises naming it. Again with w2 announcing itself for epoch 1
    with 5 (it went on past w1's end: w1's steps are a prefix of the job's), w3 ended with 5
    and a fourth member that never beat nor spoke (stopped): w1's close() returns. (A member
    gone on with fewer steps: the test above, in a real job.) Waiting past ``SAY_AFTER_S``,
    w1 says whom it waits for: w2, alive (not w3, which ended, nor w4, stopped)."""
    import threading

    from fastreduce import ending
    from fastreduce.coordinator import Epoch, epoch_key
    from fastreduce.membership import Membership, MembershipError, serve

    monkeypatch.setenv("FASTREDUCE_LOST_AFTER_S", "0.2")
    monkeypatch.setattr(ending, "SAY_AFTER_S", 0.1)
    for dispute in (True, False):
        server = serve(0, "127.0.0.1")
        names = ("w1", "w2", "w3") if dispute else ("w1", "w2", "w3", "w4")
        members = [Membership(f"127.0.0.1:{server.port}", world_size=len(names), member=n, timeout_s=30)
                   for n in names]
        epoch = Epoch(0, names, 0, len(names))
        server.set(epoch_key(0), epoch.to_json())
        for m, steps in zip(members, (5, 4 if dispute else 5, 5, 5)):
            m.me.epoch, m.me.step = epoch, steps
        members[2].ending.tell(epoch)  # w3 ended with 5 (what its close() writes first)
        members[1].epochs.pulse.up()  # w2 alive, then its word:
        said = (lambda: members[1].ending.tell(epoch)) if dispute else \
            (lambda: members[1].epochs.gathering.announce(epoch))
        threading.Timer(1.0, said).start()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fastreduce"):
            if dispute:
                with pytest.raises(MembershipError, match=r"member w2 ended at step 4: its last step failed where this "
                                                          r"member's completed"):
                    members[0].close()
            else:
                members[0].close()  # (w4 never beat nor spoke: stopped after its loss window)
        said = [r.getMessage() for r in caplog.records if "waits for the word of" in r.getMessage()]
        # w2 named (alive, its word not yet said); w3 never (it ended). w4, stopped, may be named
        # until its loss window passed, and w2 missed by a say before its first beat was read:
        # on a loaded host (CI) the first say named w4 alone, then the next one w2.
        assert any("waits for the word of w2" in s for s in said) and all("w3" not in s and s.endswith(
            "alive and not ended (each member's close(), or confirm() after its last step), up to timeout_s=30 s")
            for s in said), said
        for m in members[1:]:
            m.me.failed = True  # (their own ends are not under test here)
            m.close()
        server = None


def test_a_group_that_could_not_be_made_names_the_lost_or_says_the_members_reach_not_each_other(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Epoch 0 of w1..w4 at a real coordinator, its group not made on w1 (Gloo's connect failed):
    w1 watches only its successor w2 (WATCHED_SUCCESSORS=1, as past 9 members). w4 published
    lost by its watcher: w1 goes on without it (it raised that every member lives before: the
    job split, its watchers going on and the rest raising). Nothing published, w2's pulse
    beating: MembershipError after two loss windows. w2 silent: w2 lost."""
    from fastreduce import faults_heartbeat
    from fastreduce.coordinator import Epoch, epoch_key
    from fastreduce.membership import Membership, MembershipError, serve

    monkeypatch.setenv("FASTREDUCE_LOST_AFTER_S", "0.3")
    monkeypatch.setattr(faults_heartbeat, "WATCHED_SUCCESSORS", 1)
    for case in ("published", "alive", "silent"):
        server = serve(0, "127.0.0.1")
        names = ("w1", "w2", "w3", "w4")
        members = [Membership(f"127.0.0.1:{server.port}", world_size=4, member=n, timeout_s=30) for n in names]
        epoch = Epoch(0, names, 0, 4)
        server.set(epoch_key(0), epoch.to_json())
        if case != "silent":
            members[1].epochs.pulse.up()
        if case == "published":
            members[2].epochs._publish_lost(epoch, {"w4"})
        failed = RuntimeError("Gloo connectFullMesh failed")
        if case == "alive":
            with pytest.raises(MembershipError, match=r"epoch 0's process group could not be made \(Gloo "
                               r"connectFullMesh failed\), and every member still lives"):
                members[0].epochs._unmade(epoch, failed)
        else:
            assert members[0].epochs._unmade(epoch, failed) == ({"w4"} if case == "published" else {"w2"}), case
        for m in members:
            m.me.failed = True  # (their ends are not under test here)
            m.close()


def test_a_job_checkpoint_is_complete_once_every_rank_of_one_epoch_wrote_its_part(tmp_path: Path) -> None:
    """Which save a new job resumes: the newest step whose parts of one epoch are all there
    (a member lost before writing leaves its step incomplete); what rank 0 prunes as it
    writes (never the newest complete save for one still being written); bad settings."""
    from fastreduce.job_checkpoints import JobCheckpoints

    def parts(step: int, epoch: int, world: int, ranks: range) -> None:
        folder = tmp_path / f"step-{step:08d}"
        folder.mkdir(exist_ok=True)
        for r in ranks:
            (folder / f"e{epoch}-{r}-of-{world}.pt").touch()

    saves = JobCheckpoints(tmp_path, every=8, keep=1)
    assert saves.newest() is None and not saves.due(0) and saves.due(16) and not saves.due(12)
    parts(8, 0, 3, range(3))
    parts(16, 1, 3, range(2))  # rank 2 lost before writing
    parts(16, 2, 2, range(1))  # (the next epoch's: none of its members writes a step already saved)
    found = saves.newest()
    assert (found.step, found.world) == (8, 3) and found.parts[2].endswith("e0-2-of-3.pt"), found
    parts(24, 3, 2, range(2))
    assert (saves.newest().step, saves.newest().world) == (24, 2)
    with pytest.raises(ValueError, match="the job resumes from"):
        saves.newest(start_step=24)
    parts(32, 3, 2, range(1))
    saves._prune(32)  # (rank 0, writing step 32): 8 and 16 go, 24 (the newest complete) stays
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000024", "step-00000032"]
    for bad in ({"every": 0}, {"every": 8, "keep": 0}, {"every": True}):
        with pytest.raises(ValueError, match="must be an integer >= 1"):
            JobCheckpoints(tmp_path, **bad)


def test_a_meeting_polls_fast_at_first_then_at_the_usual_pace_however_long_it_waits() -> None:
    """gathering.poll_s: a meeting's looks after 1, 1, 2, 4 ms, then the usual pace (5 ms at 4
    members, never more often than the coordinator was sized for at 1,024), for as long as a
    member is waited for (a peer compiling its model for minutes: a million looks)."""
    from fastreduce.gathering import POLLS_PER_S, poll_s as _poll_s

    assert [_poll_s(4, n) for n in range(6)] == [0.001, 0.001, 0.002, 0.004, 0.005, 0.005]
    assert _poll_s(4) == 0.005 and _poll_s(1024) == _poll_s(1024, 3) == 1024 / POLLS_PER_S
    for polls in (1_100, 10**6):
        assert _poll_s(4, polls) == 0.005 and _poll_s(1024, polls) == 1024 / POLLS_PER_S


def test_a_copied_state_keeps_every_container_as_it_was() -> None:
    """fastreduce.nested (what a joiner's healing, a kept mode and a redone step copy through):
    a MultiStepLR's milestones (a Counter) stay its milestones, so a scheduler loaded from the
    copy decays where the original does; a defaultdict keeps its factory, a module's state its
    _metadata, a namedtuple its fields."""
    import collections

    from fastreduce.nested import clone_state, map_leaves

    def schedule(state: dict | None) -> list[float]:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[3, 6], gamma=0.1)
        if state is not None:
            sched.load_state_dict(state)
        lrs = []
        for _ in range(8):
            opt.step()
            sched.step()
            lrs.append(opt.param_groups[0]["lr"])
        return lrs

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    saved = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[3, 6], gamma=0.1).state_dict()
    copied = clone_state(saved)
    assert copied["milestones"] == saved["milestones"] and type(copied["milestones"]) is collections.Counter
    assert schedule(copied) == schedule(saved) == schedule(None) and min(schedule(copied)) < 0.1
    module_state = torch.nn.Linear(2, 2).state_dict()
    Pair = collections.namedtuple("Pair", "a b")
    nested = {"d": collections.defaultdict(list, x=[torch.ones(1)]), "m": module_state, "p": Pair(torch.ones(1), 2)}
    out = map_leaves(nested, lambda t: t * 2)
    assert out["d"].default_factory is list and torch.equal(out["d"]["x"][0], torch.full((1,), 2.0))
    assert out["m"]._metadata == module_state._metadata and list(out["m"]) == list(module_state)
    assert type(out["p"]) is Pair and out["p"].b == 2 and torch.equal(out["p"].a, torch.full((1,), 2.0))


def test_a_process_that_joins_under_a_leavers_name_is_not_taken_for_it() -> None:
    """A member named "w3" (a StatefulSet's pod) asks to leave and is voted out; a new process
    joining later as "w3" must not be voted out at the next poll by its old request."""
    import time

    from fastreduce.coordinator import MEMBERS_PREFIX, Epoch
    from fastreduce.membership import Membership, serve

    server = serve(0, "127.0.0.1")
    address = f"127.0.0.1:{server.port}"
    voter, leaver = (Membership(address, world_size=2, member=name) for name in ("w1", "w3"))
    epoch = Epoch(0, ("w1", "w3"), 0, 0)
    voter.me.epoch = leaver.me.epoch = epoch
    leaver.votes.ask_to_leave()
    server.add(MEMBERS_PREFIX + "e0/s0", 1)  # w3's ballot at the poll
    assert voter.votes.vote(0) == ("join", {"w3"})
    time.sleep(0.5)  # (the served request is deleted off the step's path)
    newcomer = Membership(address, world_size=2, member="w1")  # a voter that never counted the requests
    newcomer.me.epoch = Epoch(1, ("w1", "w3"), 1, 1)
    server.add(MEMBERS_PREFIX + "e1/s1", 1)
    decision, leavers = newcomer.votes.vote(1)
    assert leavers == set(), (decision, leavers)
    for m in (voter, leaver, newcomer):
        m.close()


def test_a_process_that_joins_under_the_name_of_a_leaver_lost_before_its_poll_is_not_taken_for_it() -> None:
    """"w3" asks to leave and is lost before the poll that would let it go (its request never
    served); a new process joining later as "w3" (a StatefulSet's pod, restarted) deletes the
    request as it enters the job (``EpochChanges.enter``, before its first vote): its first
    poll, completed by itself, lets nobody go. Without that, it voted itself out."""
    from fastreduce.coordinator import MEMBERS_PREFIX, Epoch
    from fastreduce.membership import Membership, serve

    server = serve(0, "127.0.0.1")
    address = f"127.0.0.1:{server.port}"
    lost = Membership(address, world_size=2, member="w3")
    lost.me.epoch = Epoch(0, ("w1", "w3"), 0, 0)
    lost.votes.ask_to_leave()  # ... and lost: the survivor's epoch 1 is w1's alone, then w3 joins again
    newcomer = Membership(address, world_size=2, member="w3")
    newcomer.me.epoch = Epoch(2, ("w1", "w3"), 5, 1)
    newcomer.votes.forget_leave_request()  # (what enter() does for a process new to the job)
    server.add(MEMBERS_PREFIX + "e2/s5", 1)  # w1's ballot: the newcomer completes the count
    assert newcomer.votes.vote(5) == ("go", set())
    lost.close()
    newcomer.close()


def test_a_joiner_still_waiting_when_the_last_member_closes_is_told_the_job_ended() -> None:
    """A job of one member ("w1", epoch 0 formed); a joiner takes its ticket and waits; w1
    closes: the joiner's wait ends at once with MembershipError saying the job ended (it
    waited wait_s, then said the members did not reach a step boundary). A spare that takes
    its ticket after that close (which answered only the tickets taken before it) finds the
    job over at once: its join returns, left set (it looked again only after wait_s)."""
    import threading
    import time

    from fastreduce.coordinator import Epoch, epoch_key
    from fastreduce.membership import Membership, MembershipError, serve

    server = serve(0, "127.0.0.1")
    address = f"127.0.0.1:{server.port}"
    member = Membership(address, world_size=1, member="w1")
    ticket, _ = member.admission.take_ticket()
    epoch = Epoch(0, ("w1",), 0, ticket)
    server.set(epoch_key(0), epoch.to_json())
    member.me.epoch = epoch
    joiner = Membership(address, world_size=1, member="w2", wait_s=60)
    late, _ = joiner.admission.take_ticket()
    threading.Timer(0.5, member.admission.closed).start()  # (what member.close() does first)
    start = time.monotonic()
    with pytest.raises(MembershipError, match="the job ended before it admitted this process"):
        joiner.admission.answer(late)
    assert time.monotonic() - start < 10
    spare = Membership(address, world_size=1, member="w3", wait_s=60, spare=True)
    later, _ = spare.admission.take_ticket()
    start = time.monotonic()
    assert spare.admission.answer(later).number == 0 and spare.left
    assert time.monotonic() - start < 10
    member.close()
    joiner.close()
    spare.close()


def test_members_asked_away_together_whose_going_would_lose_a_shard_leave_one_poll_apart() -> None:
    """A sharded mode's (ZeRO's) members "w2" and "w3" ask to leave at once, rank 2 holding the
    only copy of rank 1's shard: the poll takes w2 alone; the next epoch's first poll takes
    w3, voted by the same member (which looks for the request again, the count of requests
    unchanged). The vote's decision asks the mode (modes/contract.py: leaving_now)."""
    from fastreduce.coordinator import MEMBERS_PREFIX, Epoch
    from fastreduce.membership import Membership, serve

    class Sharded:  # a mode whose shard of rank 1 is held by ranks 1 and 2 alone (in epoch 0)
        commit_style, state_scope = "zero", "sharded"

        def __init__(self, epoch: int):
            self.epoch = epoch

        def kept_without(self, ranks: set[int]) -> bool:
            return self.epoch > 0 or not {1, 2} <= ranks

    server = serve(0, "127.0.0.1")
    address = f"127.0.0.1:{server.port}"
    voter, *leavers = (Membership(address, world_size=3, member=name) for name in ("w1", "w2", "w3"))
    voter.me.epoch, voter.me.mode = Epoch(0, ("w1", "w2", "w3"), 0, 0), Sharded(0)
    for m in leavers:
        m.me.epoch = voter.me.epoch
        m.votes.ask_to_leave()
    server.add(MEMBERS_PREFIX + "e0/s0", 2)  # the leavers' ballots at the poll
    assert voter.votes.vote(0) == ("join", {"w2"})
    voter.me.epoch, voter.me.mode = Epoch(1, ("w1", "w3"), 1, 1), Sharded(1)
    server.add(MEMBERS_PREFIX + "e1/s1", 1)
    assert voter.votes.vote(1) == ("join", {"w3"})
    voter.me.mode = None  # (no mode to close)
    for m in (voter, *leavers):
        m.close()


def test_a_member_alone_below_min_ranks_after_another_left_is_not_told_it_was_lost() -> None:
    """Below min_ranks after a member left at a poll (leave(), or the straggler policy), with no
    process joined within wait_s: MembershipError saying who left and what to do; it raised
    RankLostError saying the leaver "was lost". A member that went silent is still a loss."""
    from fastreduce.coordinator import Epoch
    from fastreduce.faults import RankLostError
    from fastreduce.membership import Membership, MembershipError, serve

    server = serve(0, "127.0.0.1")
    m = Membership(f"127.0.0.1:{server.port}", world_size=3, min_ranks=3, member="w0", wait_s=1)
    old = Epoch(0, ("w0", "w1", "w2"), 0, 3)
    try:
        with pytest.raises(MembershipError) as left:
            m.epochs._below_min_ranks(old, ["w0", "w1"], {"w2"})
        assert "w2 left the job" in str(left.value) and "below min_ranks=3" in str(left.value), left.value
        assert "lost" not in str(left.value), left.value
        with pytest.raises(RankLostError) as lost:  # w2 left, w1 silent: lost
            m.epochs._below_min_ranks(old, ["w0"], {"w2"})
        assert lost.value.ranks == [1], lost.value
    finally:
        m.close()


def test_what_a_joiner_is_refused_for_and_bad_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked by each process alone, before it waits on anyone: the joiner's fingerprint
    against the members' (version, tag, layout), the arguments, and its Gloo transport (a
    member whose device cannot be made failed the group's creation alone, the others waiting
    there for its address for timeout_s: 30 s of 30 measured, 3 members)."""
    from fastreduce.admission import Admission, _starts_elsewhere
    from fastreduce.membership import Membership, MembershipError, serve

    # first members resumed from different checkpoints: refused with both steps named
    assert _starts_elsewhere(8, 8) is None and _starts_elsewhere(0, None) is None
    assert "starts the job at step 0 where the other first members start at step 8" in _starts_elsewhere(0, 8)

    ours = {"version": "0.1.0", "tag": "fused bf16", "tensors": [["model.0.weight", [16, 8], "torch.float32"]]}
    assert Admission.differs(dict(ours), ours) is None
    assert "fastreduce 0.2.0 joining members on fastreduce 0.1.0" in Admission.differs({**ours, "version": "0.2.0"}, ours)
    assert "tag 'fused fp32'" in Admission.differs({**ours, "tag": "fused fp32"}, ours)
    other = {**ours, "tensors": [["model.0.weight", [16, 8], "torch.bfloat16"]]}
    assert "torch.bfloat16 where the members hold model.0.weight [16, 8] torch.float32" in Admission.differs(other, ours)
    assert "2 entries where the members hold 1" in Admission.differs({**ours, "tensors": ours["tensors"] * 2}, ours)
    server = serve(0, "127.0.0.1")
    with pytest.raises(ValueError, match="world_size and min_ranks must be >= 1"):
        Membership(f"127.0.0.1:{server.port}", world_size=0)
    with pytest.raises(ValueError, match="min_ranks at most world_size"):  # (epoch 0 would form below it)
        Membership(f"127.0.0.1:{server.port}", world_size=2, min_ranks=3)
    with pytest.raises(ValueError, match="poll_s must be a finite number"):  # (an OverflowError at the 2nd poll)
        Membership(f"127.0.0.1:{server.port}", world_size=2, poll_s=float("inf"))
    with pytest.raises(ValueError, match="coordinator must be 'host:port'"):
        Membership("nohostport", world_size=2)
    for name in ("node 1", "node,1", ""):  # (a leaver's name in a vote's decision: "leave 7 a,b")
        with pytest.raises(ValueError, match="without spaces or commas") if name else contextlib.nullcontext():
            Membership(f"127.0.0.1:{server.port}", world_size=2, member=name).close()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo,nope0")  # (before the coordinator: there is none at port 1)
    with pytest.raises(ValueError, match=r"backend='gloo' cannot make its transport on this host: "
                       r"\$GLOO_SOCKET_IFNAME='lo,nope0' names no interface .*Unable to find address for: nope0.*lo"):
        Membership("127.0.0.1:1", world_size=2)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    Membership(f"127.0.0.1:{server.port}", world_size=2).close()
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    if not torch.cuda.is_available():  # (a member on a host without its GPU among the others)
        with pytest.raises(ValueError, match="backend='nccl' cannot make its transport on this host: this torch was "
                           "built without NCCL|no CUDA device is visible"):
            Membership("127.0.0.1:1", world_size=2, backend="nccl")
    with pytest.raises(MembershipError, match="cannot reach the coordinator at 127.0.0.1:1"):
        from fastreduce.membership import connect
        connect("127.0.0.1:1", timeout_s=1)
    m = Membership(f"127.0.0.1:{server.port}", world_size=2)
    with pytest.raises(RuntimeError, match="not a member yet: call join"):
        _ = m.rank
    with pytest.raises(TypeError, match=r"commit\(\) takes the optimizer's step"):
        m.commit(None)
    import types
    m.me.mode = types.SimpleNamespace(reduce=lambda: None, under_join=True)  # as inside torch's Join
    with pytest.raises(RuntimeError, match="does not run a mode under torch's Join"):
        m.commit(lambda: None)
    from fastreduce import ZeroOptimizer
    from fastreduce.modes.contract import check_membership
    with pytest.raises(TypeError, match="ZeRO, gossip, LocalSGD and DiLoCo modes, not SGD"):
        check_membership(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
    unmirrored = type("Zero", (ZeroOptimizer,), {"__init__": lambda self: setattr(self, "redundant", False)})()
    with pytest.raises(ValueError, match="Zero under fastreduce.Membership needs redundant=True: each rank's optimizer "
                       "shard is then also kept on another rank"):
        check_membership(unmirrored)  # as ZeroOptimizer(redundant=False)


def test_a_job_short_of_its_first_members_says_how_many_came() -> None:
    """A first member whose job never formed (one of world_size=3 came: the others raised at
    their start, say) is told so at wait_s, not that the members reached no step boundary."""
    from fastreduce.membership import Membership, MembershipError, serve

    server, model = serve(0, "127.0.0.1"), torch.nn.Linear(2, 2)
    m = Membership(f"127.0.0.1:{server.port}", world_size=3, wait_s=1)
    with pytest.raises(MembershipError, match="the job did not form within wait_s=1 s: 1 of its world_size=3 first "
                       "members came, and it starts with all of them"):
        m.join({"model": model}, lambda: fastreduce.FusedReducer(model))
    m.close()


def _heal_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from fastreduce.heal import broadcast_state, recv_state, send_state

    torch.manual_seed(rank)  # every rank's own values: only rank 0's may arrive
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    state = {"step": 7 + rank, "model": model.state_dict(), "opt": opt.state_dict(),
             "extra": [torch.zeros(0), torch.arange(3, dtype=torch.int64), ("text", 1.5)]}
    got = broadcast_state(state if rank == 0 else None, torch.device("cpu"))
    if rank == 0:  # and point to point, as to a joiner among members
        send_state(state, torch.device("cpu"), [1])
    sent = recv_state(torch.device("cpu"), 0) if rank == 1 else None
    dist.barrier()
    return {"sent": state, "got": got, "p2p": sent}


def test_a_joiner_receives_the_state_as_flat_blocks_bit_for_bit() -> None:
    """fastreduce.heal.broadcast_state, and send_state/recv_state point to point: rank 0's
    nested state (a model's and AdamW's state_dicts, several dtypes, an empty tensor, plain
    values) arrives equal on rank 1."""
    from fastreduce.launch import run_ranks

    sent, got = (r for r in run_ranks(_heal_worker, 2, timeout=60))
    for b in (got["got"], got["p2p"]):
        _equal_state(sent["sent"], b)


def _equal_state(a: dict, b: dict) -> None:
    assert b["step"] == 7 and b["extra"][2] == ("text", 1.5) and b["extra"][0].numel() == 0
    assert torch.equal(b["extra"][1], a["extra"][1])
    for k, v in a["model"].items():
        assert torch.equal(b["model"][k], v) and b["model"][k].dtype == v.dtype, k
    for i, st in a["opt"]["state"].items():
        for k, v in st.items():
            assert torch.equal(b["opt"]["state"][i][k], v), (i, k)
    assert b["opt"]["param_groups"] == a["opt"]["param_groups"]


JOINER_KILLS = {4: ("admitted", 0), 5: ("healing", 0), 6: ("first-step", 0)}
"""Replacements killed at each point of their admission and healing (examples/keep_training.py):
as the members admit it (before it enters the epoch formed for it, the members waiting for it
there), as its healing begins (the member sending it the state in the transfer), and after
its first backward (the members at their first step of the epoch with it)."""


@pytest.mark.parametrize("mode, transport", [
    ("fused", "process_group"), ("fused", "shm"),
    *(pytest.param(m, t, marks=SLOW) for m in ("overlap", "zero", "localsgd", "diloco", "gossip")
      for t in ("process_group", "shm"))])
@pytest.mark.cell("loop", "train", membership=True, against="equal")
def test_a_joiner_lost_as_it_is_admitted_healed_or_in_its_first_step_is_a_loss_like_any_other(
        tmp_path: Path, mode: str, transport: str) -> None:
    """4 members (so that a Gloo ring has a member next to no joiner: it waits on a live
    neighbour, not on the joiner); member 3 dies at step 5, its replacement dies as it is
    admitted, the next one as its healing begins, the next in its first step, and a fourth
    joins for good. The members see each joiner's loss as any other (none waits in a
    collective on it), so the three survivors and the last replacement train on to the last
    step, none left out of an epoch, every final member bit-identical (the local modes and
    gossip: their parameters, after a last sync or the exact mean)."""
    found = launch(tmp_path, transport, {3: ("mid-step", 5), **JOINER_KILLS}, joiners=4, mode=mode, steps=120,
                   members=4)
    assert not {3, 4, 5, 6} & set(found), {i: found[i].get("error") or found[i].get("refused") for i in found}
    final = [found[i] for i in (0, 1, 2, 7) if i in found]
    for f in final:
        assert "error" not in f and "refused" not in f, f.get("error") or f.get("refused")
    assert len(final) == 4, sorted(found)
    for f in final:
        assert f["steps"][-1][:2] == (120, True) and f["world"] == 4, (f["index"], f["steps"][-3:], f["world"])
        committed = [s for s, ok, _, _ in f["steps"] if ok]
        assert committed == list(range(f["joined_at"] + 1, 121))  # every step once, none skipped
    for f in final[:3]:
        c = f["counters"]
        assert c["losses"] == 4 and c["discarded_steps"] <= 4 and c["joins"] >= 1, c
    if mode in ("fused", "overlap", "zero"):
        _same(final)
    else:
        for f in final[1:]:
            assert torch.equal(f["params"], final[0]["params"]), float((f["params"] - final[0]["params"]).abs().max())
