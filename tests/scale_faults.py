"""The heavy part of the scale tier (``make test-scale`` names this file; its name keeps it out
of ``make test``): at ``FASTREDUCE_SCALE_BIG`` ranks (default 64) on one host,

* the heartbeat names a SIGKILLed rank within its window (test_faults' cases and checks);
* ZeRO's state resharded 64 -> 48: saved sharded (``torch.distributed.checkpoint``) by 64
  ranks and loaded by 48, and moved by ``zero_mirror.reshard`` onto the 48 survivors of 16
  non-adjacent losses (``redundant=True``); both equal the 64 ranks' ``state_dict()`` bit for bit;
* a Membership of 64 members loses two (mid-step and between steps) and takes two
  replacements (examples/keep_training.py's member loop): training goes on to the last step
  at 64 members, every member bit for bit alike.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from fastreduce.launch import rank_context, run_ranks
from fastreduce.modes import zero_mirror

import test_faults as faults_t
from models import batch_for, odd_model
from test_zero import CLIP, SEED, SMALL_BUCKET_MB, loss_fn, zero_opt

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from keep_training import member  # noqa: E402  (examples/keep_training.py: the members' loop)

BIG = int(os.environ.get("FASTREDUCE_SCALE_BIG", "64"))
TRANSPORT = os.environ.get("FASTREDUCE_TRANSPORT", "shm")
RESHARD_STEPS = 3

pytestmark = pytest.mark.timeout(1500)


# ============================================================== heartbeat

@pytest.mark.parametrize("case", ["fused", "zero"])
def test_the_heartbeat_names_a_killed_rank_within_its_window(case: str, monkeypatch: Any) -> None:
    monkeypatch.setattr(faults_t, "SPAWN_DEADLINE", 600.0)  # 64 ranks' start and warm steps on 2 cores
    victim = BIG * 3 // 5
    reports = faults_t.run_kill(case, TRANSPORT, BIG, victim)
    faults_t._check_reports(reports, victim, faults_t.WHERE[case])
    print(f"\nscale N={BIG} {TRANSPORT} heartbeat {case}: raised {max(o['since_death'] for o in reports.values()):.2f} s "
          f"after the death (bound {faults_t.BOUND:g} s)")


# ============================================================== ZeRO reshard 64 -> 48

def _equal_state(got: dict, want: dict) -> bool:
    return got["state"].keys() == want["state"].keys() and all(
        torch.equal(got["state"][i][k], v) for i, st in want["state"].items() for k, v in st.items())


def reshard_save(rank: int, world: int, path: str) -> None:
    """``world`` ranks train ZeRO (``redundant=True``), save the state sharded and what each holds."""
    import torch.distributed.checkpoint as dcp

    model = odd_model(SEED)
    opt = zero_opt(model.parameters(), module=model, bucket_mb=SMALL_BUCKET_MB, redundant=True)
    for step in range(RESHARD_STEPS):
        loss_fn(model, batch_for(model, rank, step)).backward()
        opt.clip_grad_norm_(CLIP)
        opt.step()
        opt.zero_grad()
    opt.wait_params()
    want = opt.state_dict()
    dcp.save(opt.sharded_state_dict(), checkpoint_id=os.path.join(path, "ckpt"))
    torch.save({"held": zero_mirror.held(opt), "want": want, "model": model.state_dict()},
               os.path.join(path, f"held{rank}.pt"))


def reshard_load(rank: int, world: int, path: str, survivors: list[int]) -> dict:
    """A new world of the ``survivors``: the checkpoint loaded, and what they held moved
    (``zero_mirror.reshard``, the parameters from the masters); each against the old ``state_dict()``."""
    import torch.distributed.checkpoint as dcp

    saved = torch.load(os.path.join(path, f"held{survivors[rank]}.pt"), weights_only=False)
    model = odd_model(SEED)
    model.load_state_dict(saved["model"])
    loaded = zero_opt(model.parameters(), module=model)
    sd = loaded.sharded_state_dict()
    dcp.load(sd, checkpoint_id=os.path.join(path, "ckpt"))
    loaded.load_sharded_state_dict(sd)
    fresh_model = odd_model(SEED + 1)  # elsewhere: its parameters come from the masters moved
    moved = zero_opt(fresh_model.parameters(), module=fresh_model, redundant=True)
    mine = saved["held"]
    mine["stale"] = True
    zero_mirror.reshard(moved, mine)
    moved.wait_params()
    return {"loaded": _equal_state(loaded.state_dict(), saved["want"]),
            "moved": _equal_state(moved.state_dict(), saved["want"]), "world": moved.world_size,
            "params": all(torch.equal(fresh_model.state_dict()[n], t) for n, t in saved["model"].items())}


def test_zero_state_reshards_from_64_to_48() -> None:
    """Every fourth rank lost (no two neighbours: each shard keeps a holder)."""
    survivors = [r for r in range(BIG) if r % 4 != 3]
    with tempfile.TemporaryDirectory() as path:
        run_ranks(reshard_save, BIG, path, timeout=1200, threads=1)
        outs = run_ranks(reshard_load, len(survivors), path, survivors, timeout=1200, threads=1)
    for rank, o in enumerate(outs):
        assert o == {"loaded": True, "moved": True, "world": BIG * 3 // 4, "params": True}, (rank, o)


# ============================================================== Membership at 64

MEMBER_STEPS = 16
KILLS = {3: ("mid-step", 6), BIG - 5: ("between", 8)}


def launch_members(out: Path) -> dict[int, dict]:
    """``BIG`` members (forked from the warm server) and a replacement per kill, each told to
    join once its member has died; what each saved."""
    from fastreduce.membership import serve

    server = serve(0, "127.0.0.1")
    ctx = rank_context()
    kw = {"steps": MEMBER_STEPS, "world": BIG}
    procs = {i: ctx.Process(target=member, args=(i, server.port, str(out), TRANSPORT, KILLS.get(i), None), kwargs=kw)
             for i in range(BIG)}
    gos = {i: ctx.Event() for i in KILLS}
    late = {BIG + k: ctx.Process(target=member, args=(BIG + k, server.port, str(out), TRANSPORT, None, gos[i]),
                                 kwargs=kw) for k, i in enumerate(sorted(KILLS))}
    everyone = [*late.values(), *procs.values()]
    for p in everyone:
        p.start()
    try:
        for i in sorted(KILLS):
            procs[i].join(900)
            gos[i].set()
        for p in everyone:
            p.join(900)
    finally:
        for p in everyone:
            if p.is_alive():
                p.kill()
    return {i: torch.load(out / f"member{i}.pt", weights_only=False)
            for i in [*procs, *late] if (out / f"member{i}.pt").exists()}


def test_membership_shrinks_and_grows_at_64(tmp_path: Path) -> None:
    found = launch_members(tmp_path)
    for i, f in found.items():
        assert "error" not in f, f"member {i} failed:\n{f['error']}"
        assert "refused" not in f, f"member {i} could not join: {f['refused']}"
    assert not set(KILLS) & set(found), "a killed member saved"
    final = [f for i, f in sorted(found.items())]
    assert len(final) == BIG
    for f in final:
        assert f["steps"][-1][:2] == (MEMBER_STEPS, True), f["steps"][-3:]
        assert f["world"] == BIG, (f["index"], f["world"], f["epoch"])
    survivors = [f for f in final if f["index"] < BIG]
    for f in survivors:
        c = f["counters"]
        # (a joiner may enter the epoch that drops the lost member: no smaller world is seen)
        assert c["losses"] == len(KILLS) and c["joins"] == len(KILLS), c
        assert c["discarded_steps"] <= len(KILLS), c
        committed = [s for s, ok, _, _ in f["steps"] if ok]
        assert committed == list(range(1, MEMBER_STEPS + 1)), committed
    for f in final[1:]:
        assert torch.equal(f["params"], final[0]["params"]), f["index"]
        assert torch.equal(f["adam"], final[0]["adam"]), f["index"]
    stalls = [s for f in survivors for _, s in f["counters"]["stalls"]]
    print(f"\nscale N={BIG} {TRANSPORT} membership: 2 lost, 2 joined, every member alike; "
          f"longest stall {max(stalls):.2f} s, epochs {final[0]['epoch']}")

