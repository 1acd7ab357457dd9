"""A trainer's loop written by hand through ``TrainerMembership``, as the HF Trainer drives it
(tests/test_trainers_membership.py): its ``MembershipSampler``, its ``CommittingOptimizer``,
``after_backward``, each step's samples recorded (``keep_training_trainers.Draws``). A fault
at a point every trainer reaches alike, without a trainer's imports and set-up: the members
of ``examples/keep_training_trainers.py`` (its data, model and mode settings), plain processes
forked from a server that imported them once, a real coordinator, Gloo."""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from keep_training import HEARTBEAT, flapping, hold  # noqa: E402
from keep_training_trainers import BATCH, LR, SETTINGS, Draws, Samples, net  # noqa: E402


def member(index: int, port: int, out: str, mode: str, steps: int, flap: int | None, held: bool = False) -> None:
    """One member of 3: ``steps`` committed steps of ``BATCH`` samples (``flap``: ZeRO, this
    member's meeting after ``flap`` committed steps fails after it completed on the others:
    ``keep_training.flapping``); what it saw saved to ``out/member<index>.pt``. ``held``: the
    last step's optimizer step (its reduction done on every member) waits for ``out/go``
    after writing ``member<index>.held``, and the members poll only at an epoch's first step."""
    os.environ.update(FASTREDUCE_HEARTBEAT_S=HEARTBEAT, FASTREDUCE_TRANSPORT="process_group")
    torch.set_num_threads(1)
    facts: dict[str, Any] = {"index": index}
    try:
        from fastreduce.integrations.membership import TrainerMembership
        from fastreduce.integrations.modes import make_mode
        from fastreduce.membership import Membership

        model = net()
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        m = Membership(f"127.0.0.1:{port}", world_size=3, min_ranks=2, wait_s=60, poll_s=600 if held else None)
        if held:
            opt.register_step_pre_hook(lambda *_: hold(Path(out), index, "held", "go") if m.step == steps - 1 else None)
        if flap is not None:
            flapping(None, m, ("flaps", flap), mode)
        glue = TrainerMembership(m, make_mode(mode, dict(SETTINGS[mode])), "a hand-written trainer loop")
        data = Samples(as_dict=False)
        sampler = glue.make_sampler(data, step_samples=BATCH, seed=0, sized=False)
        glue.join(model, opt, [], last_step=steps)
        stepped, draws, drawn = glue.optimizer(opt), Draws(lambda: glue), iter(sampler)
        while m.step < steps:
            x, y, i = torch.utils.data.default_collate([data[next(drawn)] for _ in range(BATCH)])
            draws.trained(i)
            torch.nn.functional.mse_loss(model(x).squeeze(-1), y).backward()
            glue.after_backward()
            draws.stepped()
            stepped.step()
            opt.zero_grad()
        facts.update(global_step=m.step, world=m.world, counters=vars(m.counters), joined_at=glue.joined_at,
                     draws=draws.attempts, position=sampler.position, seed=sampler.seed,
                     params=torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        m.close()
    except BaseException:  # noqa: BLE001 - reported by the test
        facts["error"] = traceback.format_exc()
    torch.save(facts, Path(out) / f"member{index}.pt")


def launch(out: Path, mode: str, steps: int, flap_at: int | None = None, timeout: float = 90,
           coordinator: int | None = None, held: Callable[[], None] | None = None) -> dict[int, dict]:
    """A coordinator (or the one at port ``coordinator``) and 3 members (member 1's meeting
    flaps after ``flap_at`` committed steps); what each saved. ``held``: called once every
    member is held at its last optimizer step (:func:`member`), which then goes on."""
    from launching import members_wrote

    from fastreduce.launch import rank_context
    from fastreduce.membership import serve

    server = serve(0, "127.0.0.1") if coordinator is None else None
    port = server.port if server is not None else coordinator
    ctx = rank_context("torch._dynamo", "fastreduce.integrations.membership", "keep_training_trainers", "trainer_loop")
    procs = [ctx.Process(target=member, args=(i, port, str(out), mode, steps, flap_at if i == 1 else None,
                                              held is not None)) for i in range(3)]
    for p in procs:
        p.start()
    try:
        if held is not None:
            members_wrote(out, 3, "held", procs, timeout)
            held()
            (out / "go").touch()
        for p in procs:
            p.join(timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return {i: torch.load(path, weights_only=False) for i in range(3) if (path := out / f"member{i}.pt").exists()}
