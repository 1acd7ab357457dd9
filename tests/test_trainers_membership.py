"""The HF Trainer and Lightning under fastreduce.Membership (issue 49): training goes on
when a member dies and a replacement joins, inside the trainers' own loops.

Real processes (spawned, each its own interpreter, not torchrun), a real coordinator (a
``TCPStore`` server in this test's process), real Gloo groups made again at each epoch.
Three members train a small MLP (AdamW, clipping, warm-up + cosine LR, accumulation 2)
through ``FastReduceTrainer(..., fastreduce_membership=m)`` or
``FastReduceStrategy(mode, membership=m)``; member 2 dies (SIGKILL to itself) in the forward of step
11; a replacement, started at once and built, trains when member 2 is gone and is admitted
mid-run. The members' script is ``examples/keep_training_trainers.py``.

Asserted: every final member reaches the last step (the trainer's global step equals the
committed steps), every final member's parameters are equal bit for bit (fused modes: at
every step; LocalSGD / DiLoCo: after the last step's sync), the lr of every step each
member trained (a discarded one too) is the failure-free schedule's at that step, the
replacement joined mid-run and the survivors counted the loss, the join and the step
discarded (none in the local modes: the sync is redone), no sample trained at two committed
steps within a data epoch (the data position moved past each committed step's samples, the
local modes' redone sync's too), and the logs went on (the HF Trainer's every
``logging_steps``, Lightning's logged metrics with the Membership's figures), evaluation too
(each member's own, with no collective: every ``eval_steps`` in the HF Trainer, Lightning's
validation with ``sync_dist=True`` logging).
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from keep_training_trainers import (EVAL_EVERY, LOG_EVERY, SAMPLES, SAVE_EVERY, STEPS,  # noqa: E402
                                    expected_lrs, launch)

SLOW = pytest.mark.slow  # the default stack runs them all; the Gaudi stack one case per trainer
KILL_AT = 10  # member 2 dies in the forward of the step after the 10th committed one


def _need(trainer: str) -> None:
    if trainer == "hf":
        pytest.importorskip("transformers", reason="the hf extra is not installed: pip install 'fastreduce[hf]'")
        pytest.importorskip("accelerate", reason="the hf extra is not installed: pip install 'fastreduce[hf]'")
    else:
        pytest.importorskip("lightning", reason="the lightning extra is not installed: "
                                                "pip install 'fastreduce[lightning]'")


def _final(trainer: str, tmp_path: Path, mode: str, compiled: str = "") -> list[dict]:
    _need(trainer)
    found = launch(trainer, tmp_path, mode, KILL_AT, timeout=150, compiled=compiled)
    for i, f in found.items():
        assert "error" not in f, f"member {i} failed:\n{f['error']}"
    assert 2 not in found and set(found) == {0, 1, 3}, sorted(found)  # member 2 died; the others finished
    return [found[i] for i in (0, 1, 3)]


def _trained_once(final: list[dict], steps: int = STEPS) -> None:
    """No sample trained at two committed steps within a data epoch (by one member or two),
    and every member ends at the same data position: each committed step moved the position
    past every member's draws, once. A member's committed step is the last it stepped at that
    count (one discarded before it drew its samples again); its ``j``-th sample came from the
    stream position ``position + j * world + rank``, which holds that sample (data epoch ``e``:
    a permutation seeded ``seed + e``; MembershipSampler)."""
    perms: dict[int, torch.Tensor] = {}
    seen: dict[tuple[int, int], tuple[int, int]] = {}
    for f in final:
        committed = {step: drew for step, *drew in f["draws"]}  # the last attempt at each step
        assert sorted(committed) == list(range(f["joined_at"] + 1, steps + 1)), (f["index"], sorted(committed))
        for step, (position, world, rank, samples) in committed.items():
            for j, sample in enumerate(samples):
                epoch, at = divmod(position + j * world + rank, SAMPLES)
                if epoch not in perms:
                    perms[epoch] = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(f["seed"] + epoch))
                assert sample == perms[epoch][at], (f["index"], step, position, world, rank, j, sample)
                assert (epoch, sample) not in seen, \
                    f"sample {sample} trained twice in data epoch {epoch}: (member, step) {seen[epoch, sample]} " \
                    f"and {(f['index'], step)}"
                seen[epoch, sample] = (f["index"], step)
    assert len({f["position"] for f in final}) == 1, [(f["index"], f["position"]) for f in final]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("trainer, mode", [
    ("hf", "fused"), ("lightning", "fused"),
    pytest.param("hf", "overlap", marks=SLOW), pytest.param("hf", "localsgd", marks=SLOW),
    pytest.param("lightning", "diloco", marks=SLOW), pytest.param("hf", "zero", marks=SLOW), ("hf", "gossip"),
    pytest.param("lightning", "gossip", marks=SLOW), pytest.param("lightning", "overlap", marks=SLOW),
    pytest.param("lightning", "zero", marks=SLOW), pytest.param("lightning", "localsgd", marks=SLOW),
    pytest.param("hf", "diloco", marks=SLOW)])
@pytest.mark.cell(None, "train", "compile", membership=True, against="equal")
def test_a_trainer_goes_on_through_a_loss_and_a_join(tmp_path: Path, trainer: str, mode: str) -> None:
    """The model compiled as each trainer's users ask (``torch_compile=True`` with the
    ``aot_eager`` backend; ``trainer.fit(torch.compile(module, backend="aot_eager"))``): the
    trainer's step goes on through the loss and the join, every member's graphs captured."""
    final = _final(trainer, tmp_path, mode, compiled="aot_eager")
    assert all(f["graphs"] > 0 for f in final), [f["graphs"] for f in final]
    local = mode in ("localsgd", "diloco")  # (gossip: a loss in backward discards the step, as in the fused modes)
    lrs = expected_lrs(STEPS)
    for f in final:
        assert f["global_step"] == STEPS and f["world"] == 3, (f["index"], f["global_step"], f["world"])
        # the lr of every step it trained (a discarded one too) is the failure-free run's at that step
        bad = [(s, lr, lrs[s - 1]) for s, lr in f["lrs"] if lr != lrs[s - 1]]
        assert not bad, (f["index"], bad[:3])
        trained = sorted({s for s, _ in f["lrs"]})
        assert trained == list(range(f["joined_at"] + 1, STEPS + 1)), (f["index"], trained)
    for f in final[:2]:  # the survivors
        c = f["counters"]
        assert f["joined_at"] == 0 and c["losses"] == 1 and c["joins"] == 1, c
        assert c["resyncs"] == (1 if local else 0), c
        # (gossip: an exchange with the lost member may complete into Gloo's buffers, so that the
        # loss is found at the next vote, where the step stands, or in the next step's exchanges)
        assert c["discarded_steps"] == (0 if local else 1) or mode == "gossip" and c["discarded_steps"] <= 1, c
    if mode == "zero":  # the Membership ran the trainer's ZeroOptimizer, each shard on two ranks
        assert all(f["mode_class"] == "ZeroOptimizer" and f["redundant"] for f in final), final[0]["mode_class"]
    joiner = final[2]
    assert KILL_AT <= joiner["joined_at"] < STEPS, joiner["joined_at"]
    assert joiner["counters"]["stalls"][0][0] == "joined", joiner["counters"]
    for f in final[1:]:  # bit for bit (the local modes: after the last step's sync)
        assert torch.equal(f["params"], final[0]["params"]), float((f["params"] - final[0]["params"]).abs().max())
    _trained_once(final)  # (the local modes: the sync redone over the survivors moved the data position too)
    for f in final:  # the logs went on
        if trainer == "hf":
            steps = [e["step"] for e in f["logs"]]
            first = -(-(f["joined_at"] + 1) // LOG_EVERY) * LOG_EVERY  # the first logging step it trained
            assert steps == list(range(first, STEPS + 1, LOG_EVERY)), (f["index"], steps)
            last = f["logs"][-1]
            assert last["fastreduce/world"] == 3 and "learning_rate" in last and last["epoch"] > 0, last
            assert [e["step"] for e in f["evals"]] == [s for s in (8, 16, 24) if s > f["joined_at"]], f["evals"]
            if f["joined_at"]:  # a joiner's first logged loss is a mean over the steps it trained since
                # it joined (the Trainer counts from its own start unless told: transformers_hooks.py),
                # not a sum spread over every step since 0 (here 5-6x smaller than a first member's
                # logged loss at the same step)
                first_log = f["logs"][0]
                theirs = {e["step"]: e["loss"] for e in final[0]["logs"]}[first_log["step"]]
                assert first_log["loss"] > theirs / 3, (f["index"], f["joined_at"], first_log, theirs)
        else:
            logged, trained = f["logged"], STEPS - f["joined_at"]  # (Lightning logs by its own counts: a
            # joiner's from where it joined; its validation every 2 * EVAL_EVERY batches it trained)
            assert logged["fastreduce/world"] == 3 and ("loss" in logged or trained < LOG_EVERY), (trained, logged)
            assert "val_loss" in logged or trained < EVAL_EVERY, (trained, logged)
            assert logged["fastreduce/joins"] == (0 if f is joiner else 1), logged


@pytest.mark.timeout(120)
def test_a_zero_member_whose_meeting_failed_moves_its_data_position_with_the_others(tmp_path: Path) -> None:
    """ZeRO under a trainer's Membership, 3 members (a loop driving ``TrainerMembership`` as the
    HF Trainer does, tests/trainer_loop.py: 15-19 s on 2 cores, the HF Trainer's own 45 s):
    member 1's meeting at step 5 (``all_arrived``) completes on every member, then fails on
    member 1 alone (a link that flapped: ``keep_training.flapping``).
    The others step their shards; member 1 steps the gradients it holds as the next epoch
    forms, after the trainer's step ended at the failure: the step stands on member 1 too, and
    its data position moves past that step's samples as the others' does (none trained twice
    in the data epoch, every member at the same position), the parameters equal."""
    from trainer_loop import launch as loop

    steps = 8  # 12 samples a step: one data epoch
    found = loop(tmp_path, "zero", steps, flap_at=4)  # (after 4 committed steps)
    for i, f in found.items():
        assert "error" not in f, f"member {i} failed:\n{f['error']}"
    final = [found[i] for i in (0, 1, 2)]
    for f in final:
        c = f["counters"]
        assert f["global_step"] == steps and f["world"] == 3 and c["losses"] == 1 and c["joins"] == 0, (f["index"], c)
    assert final[1]["counters"]["discarded_steps"] == 0, final[1]["counters"]  # healed forward: its step stood
    _trained_once(final, steps)
    for f in final[1:]:
        assert torch.equal(f["params"], final[0]["params"]), float((f["params"] - final[0]["params"]).abs().max())


@pytest.mark.timeout(120)
def test_a_trainer_member_cut_off_at_its_last_step_raises_before_the_trainer_saves(tmp_path: Path) -> None:
    """The coordinator killed during the last step (every member's reduction done, before its
    optimizer step; no poll due): that commit completes, and the trainer's side confirms the
    run's steps with the coordinator there (the request that, a partition in that step's
    reduction, tells a member its last step may be one the others discarded), so the
    trainer's step raises MembershipError before the trainer goes on to save anything
    (before: it returned, and only close() could have told)."""
    import signal

    from launching import coordinator_process
    from trainer_loop import launch as loop

    with coordinator_process() as (coordinator, port):
        found = loop(tmp_path, "fused", 6, coordinator=port,
                     held=lambda: (coordinator.send_signal(signal.SIGKILL), coordinator.wait(10)))
    assert sorted(found) == [0, 1, 2], sorted(found)
    for f in found.values():
        assert "ended its training with its 6 committed steps not confirmed" in f.get("error", ""), f.get("error")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("trainer", ["hf", "lightning"])
@pytest.mark.cell(None, "train", "compile", membership=True, modes=("fused",))
def test_a_trainer_member_frozen_past_the_loss_window_joins_the_job_again(tmp_path: Path, trainer: str) -> None:
    """Member 2 stopped whole (SIGSTOP, then SIGCONT 6 s later) in the forward of step 11: the
    others lose it and train on at 2; thawed, it joins the job again inside its trainer's step
    (no new process, no replacement): the trainer's global step, its LR schedulers and its
    data position jump to the members', and every member reaches the last step in one epoch
    of 3, bit-identical, each step it trained at the failure-free run's learning rate. (Its
    schedulers were a step behind the members' until it did the rest of the step it was
    admitted at, as a joiner does: the parameters differed.) The model compiled as each
    trainer's users ask (``aot_eager``), its graphs captured on every member."""
    _need(trainer)
    found = launch(trainer, tmp_path, "fused", KILL_AT, timeout=150, frozen=True, compiled="aot_eager")
    for i, f in found.items():
        assert "error" not in f, f"member {i} failed:\n{f['error']}"
    final, lrs = [found[i] for i in (0, 1, 2)], expected_lrs(STEPS)
    assert all(f["graphs"] > 0 for f in final), [f["graphs"] for f in final]
    for f in final:
        assert f["global_step"] == STEPS and f["world"] == 3 and f["epoch"] == 2, (f["index"], f["global_step"])
        bad = [(s, lr, lrs[s - 1]) for s, lr in f["lrs"] if lr != lrs[s - 1]]
        assert not bad, (f["index"], bad[:3])
    for f in final[:2]:
        assert f["counters"]["losses"] == 1 and f["counters"]["joins"] == 1, f["counters"]
    again = final[2]
    assert again["counters"]["rejoins"] == 1, again["counters"]
    for f in final:  # in the trainer's log too
        logged = f["logs"][-1] if trainer == "hf" else f["logged"]
        assert logged["fastreduce/rejoins"] == (1 if f is again else 0), (f["index"], logged)
    trained = sorted({s for s, _ in again["lrs"]})
    assert trained[:KILL_AT + 1] == list(range(1, KILL_AT + 2)) and trained[-1] == STEPS and \
        len(trained) < STEPS, trained  # (it missed the steps the others trained without it)
    assert len({f["position"] for f in final}) == 1, [f["position"] for f in final]
    for f in final[1:]:
        assert torch.equal(f["params"], final[0]["params"]), float((f["params"] - final[0]["params"]).abs().max())


@pytest.mark.timeout(200)
@pytest.mark.parametrize("trainer", ["hf", "lightning"])
def test_a_trainer_member_frozen_until_the_job_ended_stops_its_training_with_no_error(tmp_path: Path,
                                                                                      trainer: str) -> None:
    """Member 2 stopped whole in the forward of step 11 until the others have finished the
    job at 2 and ended. Thawed, it finds itself left out and the job over: out of the job
    (``m.left``), its trainer's training ends there with no error, and nothing more is saved,
    evaluated or logged (until 2026-12-07 the trainer's next step raised "this member left
    the job"); the others, bit-identical, at the last step."""
    _need(trainer)
    away = _one_out(launch(trainer, tmp_path, "fused", KILL_AT, timeout=150, frozen="past-end"), losses=1, leaves=0)
    assert away["left"] and away["counters"]["rejoins"] == 1 and away["global_step"] <= KILL_AT + 1, \
        (away["global_step"], away["counters"])


@pytest.mark.timeout(200)
@pytest.mark.parametrize("trainer", ["hf", "lightning"])
def test_a_trainer_member_evicted_as_a_straggler_stops_its_training_with_no_error(tmp_path: Path,
                                                                                  trainer: str) -> None:
    """Every member runs the straggler policy (``evict_slower_than=1.5, evict_for_s=1``);
    member 2's forward takes 0.6 s more from step 4 on. The epoch's rank 0 asks it to leave
    within seconds: out at a poll, after a step committed with the others, its trainer's
    training ends there with no error (until 2026-12-07 its next step raised "this member left
    the job"); the others train on at 2 to the last step, bit-identical."""
    _need(trainer)
    away = _one_out(launch(trainer, tmp_path, "fused", 3, timeout=150, slowed=True), losses=0, leaves=1)
    assert away["left"] and 4 <= away["global_step"] < STEPS, (away["global_step"], away["counters"])


def _one_out(found: dict[int, dict], losses: int, leaves: int) -> dict:
    """Members 0 and 1 at the last step at 2, bit-identical, having seen ``losses`` and
    ``leaves``; no member failed. Returns member 2's record (out of the job)."""
    for i, f in found.items():
        assert "error" not in f, f"member {i} failed:\n{f['error']}"
    final = [found[0], found[1]]
    for f in final:
        assert f["global_step"] == STEPS and f["world"] == 2 and not f["left"], (f["index"], f["global_step"])
        c = f["counters"]
        assert (c["losses"], c["leaves"], c["joins"]) == (losses, leaves, 0), c
    assert torch.equal(final[0]["params"], final[1]["params"])
    return found[2]


@pytest.mark.timeout(60)
def test_what_a_trainer_refuses_under_membership(tmp_path: Path) -> None:
    """Checked by each process alone, before it joins: modes a Membership cannot run, a
    run without max_steps, data-loader workers, a process launched by torchrun."""
    import os

    from fastreduce.integrations.membership import MembershipSampler, TrainerMembership, check_plain_process
    from fastreduce.integrations.modes import make_mode
    from fastreduce.membership import Membership, serve

    server = serve(0, "127.0.0.1")
    m = Membership(f"127.0.0.1:{server.port}", world_size=2)
    with pytest.raises(ValueError, match="drop redundant=False"):
        TrainerMembership(m, make_mode("zero", {"redundant": False}), "T")
    with pytest.raises(ValueError, match="fragment_delay > 0 with a compressed wire"):
        TrainerMembership(m, make_mode("diloco", {"sync_every": 4, "fragments": 2, "fragment_delay": 1,
                                                  "wire_dtype": "int8"}), "T")
    with pytest.raises(TypeError, match="must be a fastreduce.Membership"):
        TrainerMembership(object(), make_mode("fused", {}), "T")
    glue = TrainerMembership(m, make_mode("fused", {}), "T")
    with pytest.raises(ValueError, match="use 0 workers"):
        glue.make_sampler(list(range(8)), step_samples=2, seed=0, sized=True, num_workers=2)
    with pytest.raises(ValueError, match="set max_steps"):
        glue.make_sampler(list(range(8)), step_samples=2, seed=0, sized=True)
        glue.join(torch.nn.Linear(2, 2), torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1), [],
                  last_step=0)
    with pytest.raises(ValueError, match="fp16 with a GradScaler does not run under fastreduce.Membership"):
        glue.join(torch.nn.Linear(2, 2), torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1), [],
                  last_step=4, scaler=torch.amp.GradScaler("cpu"))
    old = os.environ.get("TORCHELASTIC_RUN_ID")
    os.environ["TORCHELASTIC_RUN_ID"] = "x"
    try:
        with pytest.raises(RuntimeError, match="launched by torchrun"):
            check_plain_process("T")
    finally:
        os.environ.pop("TORCHELASTIC_RUN_ID") if old is None else os.environ.update(TORCHELASTIC_RUN_ID=old)
    # the sampler: a stream interleaved over the world; a committed step moves it past every member's draws
    seen = types.SimpleNamespace(epoch=True, rank=1, world=2)  # the sampler reads a membership's epoch, rank, world
    s = MembershipSampler(list(range(10)), seen, step_samples=2, world_size=2, shuffle=False)
    it = iter(s)
    assert [next(it), next(it)] == [1, 3]  # rank 1 of 2 from position 0
    s.advance(1)
    assert s.position == 4 and [next(it), next(it)] == [5, 7]
    s.redraw()  # discarded: drawn again
    seen.rank, seen.world = 2, 3  # a new epoch: rank 2 of 3
    it = iter(s)
    assert [next(it), next(it)] == [6, 9] and len(s) == 6
    s.advance(2)
    assert s.position == 10 and s.data_epoch == 1.0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("trainer", ["hf", "lightning"])
def test_a_trainer_under_membership_refuses_to_resume_a_checkpoint(tmp_path: Path, trainer: str) -> None:
    """Where a trainer's checkpoint does not hold the mode's whole state under a Membership
    (ZeRO's shards in the HF Trainer; Lightning's job position), resuming would train on
    from a wrong state (no error): refused before anything trains, naming the job's own
    checkpoints (``JobCheckpoints``) as the way (cells.py)."""
    from fastreduce.integrations.membership import RESUME_UNDER_MEMBERSHIP
    from fastreduce.membership import Membership, serve

    _need(trainer)
    server = serve(0, "127.0.0.1")
    m = Membership(f"127.0.0.1:{server.port}", world_size=2)
    if trainer == "hf":
        from transformers import TrainingArguments

        from fastreduce.integrations.transformers import FastReduceTrainer

        run = FastReduceTrainer(model=torch.nn.Linear(2, 2), train_dataset=[{"x": torch.zeros(2)}] * 4,
                                args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                                                       max_steps=2), fastreduce_mode="zero", fastreduce_membership=m)
        with pytest.raises(ValueError, match="holds the whole job in the HF Trainer's fused") as info:
            run.train(resume_from_checkpoint=str(tmp_path))
    else:
        from fastreduce.integrations.lightning import FastReduceStrategy

        with pytest.raises(ValueError, match="holds the whole job in the HF Trainer's fused") as info:
            FastReduceStrategy("fused", membership=m).load_checkpoint(str(tmp_path / "last.ckpt"))
    assert RESUME_UNDER_MEMBERSHIP in str(info.value) and "JobCheckpoints" in str(info.value) and m.epoch is None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode, kill", [("fused", None)])  # (overlap with member 2 killed at 12: passed at stop 67)
@pytest.mark.cell("hf", "resume", membership=True, modes=("fused",))
def test_the_hf_trainer_under_a_membership_resumes_the_job_from_a_checkpoint(tmp_path: Path, mode: str,
                                                                             kill: int | None) -> None:
    """A job of 3 members through the HF Trainer saves a checkpoint every 8 steps; a new job
    (a new coordinator, new processes) resumed from step 8's goes on at step 8, its lr at
    every step the uninterrupted run's. Without a fault its members end where the
    uninterrupted job's end, bit for bit (the data stream's position came with the
    checkpoint); with member 2 killed at step 12 and replaced, every final member the same."""
    _need("hf")
    first = launch("hf", tmp_path / "first", mode, None, timeout=150, resume="save")
    for i, f in first.items():
        assert "error" not in f, f"member {i} failed:\n{f['error']}"
    checkpoint = tmp_path / "first" / "hf0" / "checkpoint-8"
    assert (checkpoint / "fastreduce_membership.json").is_file(), sorted(p.name for p in checkpoint.iterdir())
    again = launch("hf", tmp_path / "again", mode, kill, timeout=150, resume=str(checkpoint))
    for i, f in again.items():
        assert "error" not in f, f"member {i} failed:\n{f['error']}"
    final = [again[i] for i in sorted(again)]
    assert len(final) == 3 and (kill is None) == (2 in again), sorted(again)
    lrs = expected_lrs(STEPS)
    for f in final:
        assert f["global_step"] == STEPS and f["world"] == 3, (f["global_step"], f["world"])
        assert all(lr == lrs[s - 1] for s, lr in f["lrs"]), f["lrs"][:3]
        assert torch.equal(f["params"], final[0]["params"]), float((f["params"] - final[0]["params"]).abs().max())
    for f in final[:2]:  # the first members: from the checkpoint's step on
        assert f["joined_at"] == 8 and [s for s, _ in f["lrs"]][0] == 9, (f["joined_at"], f["lrs"][:2])
    if kill is None:
        assert torch.equal(final[0]["params"], first[0]["params"]), \
            float((final[0]["params"] - first[0]["params"]).abs().max())
    else:
        assert kill <= final[2]["joined_at"] < STEPS and final[0]["counters"]["losses"] == 1, final[2]["joined_at"]


RESHARDS = pytest.mark.cell(None, "reshard", membership=True, against="equal")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("trainer, mode", [
    pytest.param("hf", "zero", marks=RESHARDS), ("lightning", "diloco"),
    pytest.param("hf", "fused", marks=[SLOW, RESHARDS]), pytest.param("hf", "overlap", marks=[SLOW, RESHARDS]),
    pytest.param("hf", "localsgd", marks=SLOW), pytest.param("hf", "diloco", marks=SLOW),
    pytest.param("hf", "gossip", marks=SLOW), pytest.param("lightning", "fused", marks=[SLOW, RESHARDS]),
    pytest.param("lightning", "overlap", marks=[SLOW, RESHARDS]), pytest.param("lightning", "zero", marks=[SLOW, RESHARDS]),
    pytest.param("lightning", "localsgd", marks=SLOW), pytest.param("lightning", "gossip", marks=SLOW)])
@pytest.mark.cell(None, "resume", membership=True)
def test_a_trainer_job_saved_as_it_trains_resumes_as_if_it_had_never_stopped(tmp_path: Path, trainer: str,
                                                                            mode: str) -> None:
    """The trainer given ``Membership(..., checkpoints=JobCheckpoints(dir, every=16))``: a job of 3
    members writes its parts after committing step 16; a new job on the same directory (a new
    coordinator, new processes, ``train()`` / ``fit()`` as for a fresh run) starts at step 16, the
    trainer's global step, LR schedulers and data position with it, and ends where the
    uninterrupted job ended, bit for bit, its lr at every step the uninterrupted schedule's.
    Where the mode's state loads onto another world size (fused, overlapped, ZeRO), a job of 2
    started on the same directory resumes at step 16 too and trains to the end, both members
    ending equal, their lr the schedule's."""
    _need(trainer)
    saves = str(tmp_path / "saves")
    runs = []
    for out, members in (("first", 3), ("again", 3), ("fewer", 2)):
        if members == 2 and mode not in ("fused", "overlap", "zero"):
            continue
        (tmp_path / out).mkdir()
        found = launch(trainer, tmp_path / out, mode, None, timeout=150, saves=saves, members=members)
        for i, f in found.items():
            assert "error" not in f, f"member {i} failed:\n{f['error']}"
        assert sorted(found) == list(range(members)), sorted(found)
        runs.append([found[i] for i in sorted(found)])
    first, *resumed = runs
    lrs = expected_lrs(STEPS)
    for f in [f for run in resumed for f in run]:
        assert f["global_step"] == STEPS and f["joined_at"] == SAVE_EVERY, (f["global_step"], f["joined_at"])
        assert [s for s, _ in f["lrs"]] == list(range(SAVE_EVERY + 1, STEPS + 1)), f["lrs"][:2]
        assert all(lr == lrs[s - 1] for s, lr in f["lrs"]), f["lrs"][:3]
    for run in resumed:  # on 3 members the uninterrupted job's parameters; on 2, the members' own, all equal
        want = first[0]["params"] if len(run) == 3 else run[0]["params"]
        assert all(f["world"] == len(run) for f in run)
        for f in run:
            assert torch.equal(f["params"], want), float((f["params"] - want).abs().max())
        if len(run) == 2:
            assert not torch.equal(want, first[0]["params"])


@pytest.mark.timeout(60)
def test_the_optimizer_a_trainer_steps_under_membership_is_the_users_wrapped() -> None:
    """CommittingOptimizer: an LR scheduler (a warm-up, then a step decay) built over it steps
    the wrapped AdamW exactly as it steps a bare one (bit for bit), without torch's scheduler
    warnings (Accelerate's wrapper around it: the HF Trainer's run above); a step its commit discards leaves
    the parameters and the moments as they were; its state dicts are the wrapped one's."""
    import warnings

    from fastreduce.integrations.committing import CommittingOptimizer, commits, unwrapped

    def run(wrap: bool, discard: set[int]) -> tuple[torch.nn.Module, torch.optim.Optimizer, list[float]]:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        inner = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
        calls = []

        def commit(step: object) -> bool:
            calls.append(len(calls) + 1)
            if calls[-1] in discard:
                return False
            step()
            return True

        opt = CommittingOptimizer(inner, commit) if wrap else inner
        sched = torch.optim.lr_scheduler.SequentialLR(opt, [
            torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=3),
            torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)], milestones=[3])
        lrs = []
        g = torch.Generator().manual_seed(1)
        for _ in range(8):
            opt.zero_grad()
            model(torch.randn(5, 4, generator=g)).square().sum().backward()
            opt.step()
            sched.step()
            lrs.append(inner.param_groups[0]["lr"])
        return model, inner, lrs

    said = []
    for wrap in (False, True):  # torch's "scheduler stepped before the optimizer" among them; as many as
        with warnings.catch_warnings(record=True) as seen:  # the bare one (torch 2.6's SequentialLR warns alone)
            warnings.simplefilter("always")
            ran = run(wrap, set())
        said.append(([str(w.message) for w in seen], ran))
    (bare_said, (bare, bare_opt, bare_lrs)), (wrapped_said, (wrapped, wrapped_opt, lrs)) = said
    assert wrapped_said == bare_said, (wrapped_said, bare_said)
    assert lrs == bare_lrs
    for a, b in zip(wrapped.parameters(), bare.parameters()):
        assert torch.equal(a, b)
        assert torch.equal(wrapped_opt.state[a]["exp_avg_sq"], bare_opt.state[b]["exp_avg_sq"])
    # every step discarded: nothing moves (the trainer puts its schedulers back itself)
    torch.manual_seed(0)
    start = [p.detach().clone() for p in torch.nn.Linear(4, 3).parameters()]
    untouched, opt, _ = run(True, set(range(1, 9)))
    assert all(torch.equal(a, b) for a, b in zip(untouched.parameters(), start)) and not opt.state
    # its state dicts are the wrapped optimizer's, both ways
    c = CommittingOptimizer(wrapped_opt, lambda step: step() or True)
    assert c.state_dict()["state"].keys() == wrapped_opt.state_dict()["state"].keys()
    fresh = torch.optim.AdamW(torch.nn.Linear(4, 3).parameters(), lr=0.1)
    CommittingOptimizer(fresh, lambda step: True).load_state_dict(wrapped_opt.state_dict())
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], wrapped_opt.state_dict()["state"][0]["exp_avg"])
    assert unwrapped(c) is wrapped_opt and c.param_groups is wrapped_opt.param_groups
    assert commits(c) and not commits(wrapped_opt)
    with pytest.raises(TypeError, match="wraps a torch.optim.Optimizer"):
        CommittingOptimizer(object(), lambda step: True)  # type: ignore[arg-type]
