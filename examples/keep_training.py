"""Training that goes on when a member dies and a replacement joins (``fastreduce.Membership``).

    python examples/keep_training.py                    # 3 members; member 2 dies at step 15
    python examples/train.py --chaos                    # the same, from the main example
    python examples/keep_training.py --transport shm --kill-at 8 --where between

On one host this starts everything itself: a coordinator (``fastreduce.membership.serve``),
``--members`` processes that train a small MLP with AdamW through the fused reducer (fp32
wire), and one replacement process, started at once (so its imports are done) and told to
join when the member it replaces has died. Member 2 dies (SIGKILL to itself) at step ``--kill-at``,
``--where`` ``mid-step`` (after its backward, before the reduction) or ``between`` steps.
Each member prints one line per new epoch: the survivors discard the step in flight and go
on without it, the replacement is admitted at their next step and takes the whole state
(parameters, AdamW's moments, the step count) from a live member; at the end every member
prints a digest of its parameters, the same on all.

On several hosts: ``fastreduce coordinator --port 29400`` on one machine, then on each host
the training script with ``FASTREDUCE_COORDINATOR=thathost:29400`` (plain processes, not
under torchrun, whose agent would restart every worker of a host when one dies), each doing
what :func:`member` does. docs/faults.md says what each step costs and what a loss keeps.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import signal
import subprocess
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn

STEPS = 40
SAVE_EVERY = 16  # committed steps between the job's checkpoints (where member() is given a directory)
HEARTBEAT = "0.25"  # s: a silent member is lost after 3 heartbeats


def make_model(width: int = 16) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 1))


MODES = ("fused", "overlap", "zero", "localsgd", "diloco", "diloco-streaming", "gossip")


def build(mode: str, model: nn.Module, opt: torch.optim.Optimizer, redundant: bool | int = True) -> Any:
    """The mode, over the current epoch's group (Membership calls this at each new epoch);
    ``redundant``: ZeRO's copies of each shard."""
    import fastreduce

    if mode == "localsgd":
        return fastreduce.LocalSGD(model, opt, sync_every=4)
    if mode in ("diloco", "diloco-streaming"):  # streaming: each fragment's all-reduce runs over the next inner step
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        return fastreduce.DiLoCo(model, opt, outer, sync_every=4, fragments=2,
                                 fragment_delay=int(mode == "diloco-streaming"))
    if mode == "zero":  # the mode is the optimizer (``opt`` is not used); each shard also on the next rank(s)
        return fastreduce.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, module=model,
                                        redundant=redundant, bucket_mb=0.0005)
    if mode == "gossip":  # each bucket's AdamW inside the mode (``opt`` is not used)
        return fastreduce.DecentralizedDataParallel(
            model, lambda named: torch.optim.AdamW([p for _, p in named], lr=1e-2), topology="ring")
    settings = {"overlap": True, "bucket_mb": 0.0005} if mode == "overlap" else {}  # 0.5 KB: a bucket per layer
    return fastreduce.FusedReducer(model, wire_dtype=torch.float32, **settings)


def digest(model: nn.Module) -> str:
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    return hashlib.sha256(params.numpy().tobytes()).hexdigest()[:12]


def graphs() -> int:
    """The graphs ``torch.compile`` captured in this process (0: nothing was compiled)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def die() -> None:
    """Crash as the OS crashes a process: SIGKILL to itself (no teardown, no flush; what
    ``kill -9`` from outside does too)."""
    os.kill(os.getpid(), signal.SIGKILL)


def freeze(seconds: float, until: list[Path] = ()) -> None:
    """Stop this whole process (every thread, its heartbeat's too: SIGSTOP to itself) for
    ``seconds``, as ``kill -STOP`` and ``kill -CONT`` from outside, or a host that hangs, do;
    a shell started first sends the SIGCONT (``until``: once these files exist instead, or
    after ``seconds`` at the latest)."""
    wait = " && ".join(f"[ -e '{p}' ]" for p in until)
    script = f"sleep {seconds}" if not until else \
        f"end=$(( $(date +%s) + {int(seconds)} )); until {wait} || [ $(date +%s) -ge $end ]; do sleep 0.1; done"
    thaw = subprocess.Popen(["sh", "-c", f"{script}; kill -CONT {os.getpid()}"])
    os.kill(os.getpid(), signal.SIGSTOP)
    thaw.wait()


def hold(out: Path, index: int, here: str, go: str, seconds: float = 120) -> None:
    """Write ``out/member<index>.<here>``, then wait until ``out/<go>`` exists (at most
    ``seconds``): the test does something to the job meanwhile (kills its coordinator, cuts
    the network) with every member at the same point."""
    (out / f"member{index}.{here}").touch()
    deadline = time.monotonic() + seconds
    while not (out / go).exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def frozen_once(facts: dict[str, Any], step: int, say: Any, where: str, until: list[Path] = ()) -> None:
    """Stopped whole for 4 s (:func:`freeze`; ``until``: until these files exist, at most 2
    minutes), once: ``facts["froze"]`` the step."""
    if "froze" not in facts:
        say(f"frozen {where}, at step {step}")
        facts["froze"] = step
        freeze(120 if until else 4, until)


def die_as_source(flag: Path, m: Any) -> None:
    """Make this process die as it starts sending a joiner the state (after epoch 0), once
    per job (``flag``): a test of a joiner's source lost while it heals."""
    import torch.distributed as dist

    def dying(epoch: Any) -> None:
        if dist.get_rank() == 0 and epoch.number > 0 and not flag.exists():
            flag.touch()
            die()

    m.at("sync_state", dying)


def die_joining(m: Any, where: str) -> None:
    """Make this replacement die as it is admitted (``admitted``: before it enters its first
    epoch, the members waiting for it there) or as its healing begins (``healing``: the
    member sending it the state; only a joiner receives it: its first pass there)."""
    m.at("enter" if where == "admitted" else "sync_state", lambda _epoch: die())


def flapping(mode: Any, m: Any, kill: tuple[str, int] | None, name: str) -> Any:
    """``mode``, whose ``reduce()`` (ZeRO: its members' meeting, ``all_arrived()``) raises a
    transport error once at step ``kill[1]`` after it completed (where ``kill[0]`` is
    ``flaps``): a link that failed on this member alone."""
    if kill is None or kill[0] != "flaps":
        return mode
    if name == "zero":
        m.at("voted", lambda s: _flap() if s == kill[1] and not m.counters.losses else None)
        return mode
    reduce = mode.reduce

    def flaky() -> None:
        reduce()
        if m.step == kill[1] and not m.counters.losses:
            _flap()

    mode.reduce = flaky
    return mode


def connections_to(port: int | str) -> set[int]:
    """The local ports of this process's open TCP connections to ``port`` on this host (its
    connections to the coordinator: a test sees whether an epoch change opened a new one)."""
    if not isinstance(port, int):
        return set()
    sockets = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            sockets.add(os.readlink(f"/proc/self/fd/{fd}"))
    found = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()  # local, remote (hex address:port), state (01: established), ..., inode
            if int(f[2].rsplit(":", 1)[1], 16) == port and f[3] == "01" and f"socket:[{f[9]}]" in sockets:
                found.add(int(f[1].rsplit(":", 1)[1], 16))
    return found


def _user_error() -> None:
    raise ValueError("fastreduce demo: the optimizer's step failed (injected by examples/keep_training.py)")


def _flap() -> None:
    from fastreduce.faults import TransportError

    raise TransportError("fastreduce: the link flapped on this member after its collective completed "
                         "(injected by examples/keep_training.py)")


HOLD_STEPS = 20
"""In its last steps a member slows to half a second a step (each still committed, so that a
replacement is admitted at its boundary) until :func:`launch` has released every replacement
and each has connected to the coordinator (``released``), then waits a second for the last
one's ticket to reach the coordinator: on a
loaded machine the members could otherwise finish the run before the last replacement asks to
join (it would wait its ``wait_s`` for an admission that no step boundary gives). A member that
stopped stepping instead would keep an earlier replacement from being admitted, and so from
reaching the point where it is killed and the next one released."""


def member(index: int, port: int | str, out: str, transport: str, kill: tuple[str, int] | None, go: Any,
           width: int = 16, steps: int = STEPS, world: int = 3, verbose: bool = False, mode: str = "fused",
           compiled: str = "", released: Any = None, device: str = "cpu", checkpoints: str = "",
           accelerate: bool = False, poll_s: float = 0.2, spare: bool = False, redundant: bool | int = True,
           start_step: int = 0) -> None:
    """One process of the job: join, train to ``steps`` committed steps, save what it saw
    to ``out/member<index>.pt`` (``kill``: ``(where, step)`` to die at, ``where`` one of
    ``mid-step``, ``between``, ``in-backward`` (as the first layer's gradient is computed,
    the later layers' buckets in flight with ``overlap``), ``after-reduce`` (its reduction
    done on every member, its optimizer step not taken), ``after-vote`` (ZeRO: the members'
    meeting at that step done, before its shard steps: the survivors step it from their copy), ``flaps`` (its reduction completed
    on every member, then a transport error on this one alone: it is healed forward to the
    step the others committed), ``in-heal``, ``in-enter`` (as it enters epoch ``kill[1]``),
    ``slow-enter`` (not killed: it enters epoch ``kill[1]`` 8 s late, past the members' entry bound),
    ``frozen`` (not killed: mid-step, the whole process stopped for 4 s, as ``kill -STOP`` and
    ``kill -CONT`` from outside: the others leave it out, and it joins again), ``frozen-in-backward``
    (as ``frozen``, inside backward as the first layer's gradient is computed: its later
    buckets' launches, after its thaw, fail on the group the others left), ``frozen-past-end``
    (as ``frozen``, stopped until the other first members have ended: back, it finds the job
    over), ``leaves-frozen``
    (asks to leave at that step and is frozen in it: out once it thaws), ``frozen-at``
    (``(where, point, epoch)``: frozen at ``Membership.at(point)`` of epoch ``epoch``'s entry),
    ``ranks-mid-step`` (``(where, step, ranks)``: dies mid-step if its rank in the first epoch is one
    of ``ranks``: given to every member, several ranks lost at once, chosen by rank; a fourth
    element, ranks of the first epoch that die as epoch 1's mode is built, ZeRO's as it takes its shards),
    a replacement's ``admitted`` (as it is admitted, before it enters its first epoch),
    ``healing`` (as its healing begins, the member sending it the state), ``first-step``
    (after its first backward, before its first commit),
    ``leaves`` (asks to leave at that step: :meth:`~fastreduce.Membership.leave`), ``ranks-leave``
    (``(where, step, ranks)``: asks to leave at that step if its rank in the first epoch is one of
    ``ranks``: given to every member, several asking at once, chosen by rank), ``slow``
    (not killed: that step takes 3 s more), ``step-raises`` (not killed: the optimizer's step raises
    ``ValueError`` in that step's commit, given to every member: a user's error; the member takes the
    step again, its batch the same), ``held-before-close`` (not killed: done, it writes
    ``member<index>.finished`` and waits for ``out/close.go`` before ``close()``);
    ``go``: an event to wait for before joining, for a replacement; ``mode``: one of :data:`MODES`; ``port``: the
    coordinator's on this host, or its ``host:port``; ``compiled``: a
    ``torch.compile`` backend (``"inductor"``, ``"aot_eager"``), the forward through
    ``torch.compile(model, backend=compiled)``, the way users on Gaudi and CUDA train); ``released``: an event
    :func:`launch` sets once every replacement is told to join (see :data:`HOLD_STEPS`); ``device``: where the
    model and its batches live (``cuda``: every member on the one GPU, its tensors sent over Gloo);
    ``checkpoints``: a directory where the job saves itself every :data:`SAVE_EVERY` committed steps
    (:class:`fastreduce.JobCheckpoints`), and which a new job resumes from; ``accelerate``: the loop an
    Accelerate user writes (the model prepared by an ``Accelerator``, which sees one process and adds
    no DDP, the backward through it, the optimizer it wraps stepped in the commit); ``poll_s``: the
    Membership's (how often the members vote; on etcd, whose every request is a quorum's write or read,
    about a second); ``spare``: a warm spare (admitted where a member is missing, at once at a loss);
    ``redundant``: ZeRO's copies of each shard; ``start_step``: a first member's ``join(start_step=)`` (a job
    resumed at that step, with no checkpoint read: the model as made here)."""
    os.environ.update(FASTREDUCE_HEARTBEAT_S=HEARTBEAT, FASTREDUCE_TRANSPORT=transport)
    import fastreduce
    from fastreduce.membership import Membership, MembershipError

    torch.set_num_threads(1)
    model = make_model(width).to(device)
    # compiled once: every epoch's mode hooks the same model
    net = torch.compile(model, backend=compiled) if compiled and not accelerate else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stepped, backward = opt, torch.Tensor.backward  # (the mode is built over the optimizer itself)
    if accelerate:  # (compiled: by the Accelerator, as its users ask it to)
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=device == "cpu", dynamo_backend=compiled or "no")
        net = accelerator.prepare_model(model, evaluation_mode=True)
        stepped, backward = accelerator.prepare_optimizer(opt), accelerator.backward
    facts: dict[str, Any] = {"index": index, "steps": [], "digests": {}}

    def say(text: str) -> None:
        if verbose:
            # the line and its newline in one write: members print at once (unbuffered, print
            # writes them apart and two members' lines run together)
            print(f"[member {index} {time.strftime('%H:%M:%S')}] {text}\n", end="", flush=True)

    try:
        if go is not None:
            go.wait(120)
        started = time.perf_counter()
        saves = fastreduce.JobCheckpoints(checkpoints, every=SAVE_EVERY) if checkpoints else None
        m = Membership(port if isinstance(port, str) else f"127.0.0.1:{port}", world_size=world, min_ranks=2, tag=mode,
                       wait_s=60, checkpoints=saves, poll_s=poll_s, spare=spare)
        (Path(out) / f"member{index}.connected").touch()  # (launch waits for a replacement's: see HOLD_STEPS)
        if kill is not None and kill[0] in ("admitted", "healing"):  # a replacement that dies as it joins
            die_joining(m, kill[0])
        if kill is not None and kill[0] == "in-enter":  # dies as it enters epoch kill[1] (0: the first), before its group exists
            m.at("set_up", lambda e: die() if e.number == kill[1] else None)
        first_rank: list[int] = []  # its rank in the first epoch (ranks-mid-step's fourth element)
        if kill is not None and kill[0] == "ranks-mid-step" and len(kill) > 3:  # then as epoch 1's mode is built (ZeRO: takes its shards)
            m.at("reshard" if mode == "zero" else "build", lambda e: die() if e.number == 1 and first_rank and first_rank[0] in kill[3] else None)
        if kill is not None and kill[0] == "frozen-at":  # stopped whole at point kill[1] of epoch kill[2]'s entry
            m.at(kill[1], lambda e: freeze(4) if getattr(e, "number", None) == kill[2] else None)
        if kill is not None and kill[0] == "slow-enter":  # enters epoch kill[1] 8 s late (a starved process)
            m.at("set_up", lambda e: time.sleep(8) if e.number == kill[1] else None)
        wrapped = net if mode == "gossip" else model  # (gossip's forward is the mode's: it wraps the compiled model)
        m.join({"model": model} if mode == "zero" else {"model": model, "optimizer": opt},
               lambda: flapping(build(mode, wrapped, opt, redundant), m, kill, mode), start_step=start_step)
        if kill is not None and kill[0] == "in-heal":  # the first member to send a joiner the state dies doing it
            die_as_source(Path(out) / "source-died", m)
        if kill is not None and kill[0] == "after-vote":  # ZeRO: the members met, its shard not stepped
            m.at("voted", lambda s: die() if s == kill[1] else None)
        if kill is not None and kill[0] == "in-backward":
            model[0].weight.register_hook(lambda g: die() if m.step == kill[1] else g)
        if kill is not None and kill[0] == "frozen-in-backward":  # its last buckets launched after its thaw
            model[0].weight.register_hook(lambda g: (frozen_once(facts, m.step, say, "in backward"), g)[1]
                                          if m.step == kill[1] else g)
        if m.left:  # a warm spare the job ended without needing: join() returned, no epoch entered
            say("a spare the job ended without: done")
            facts.update(unneeded=True, ended_at=time.time())
            try:
                m.commit(opt.step)
            except RuntimeError as err:  # (a loop that goes on: told why)
                facts["commit_after"] = str(err)
            m.close()
            torch.save(facts, Path(out) / f"member{index}.pt")
            return
        facts["joined_s"], facts["joined_at"] = time.perf_counter() - started, m.step
        facts["name"] = m.epoch.members[m.rank]  # its name at the coordinator (what others' counters.lost hold)
        first_rank.append(m.rank if m.epoch.number == 0 else -1)
        (Path(out) / f"member{index}.joined").touch()
        say(f"joined epoch {m.epoch.number} as rank {m.rank} of {m.world} at step {m.step} "
            f"in {facts['joined_s']:.2f} s")
        while m.step < steps and not m.left:
            if released is not None and m.step >= steps - HOLD_STEPS:
                if released.is_set():
                    time.sleep(1.0)
                    released = None
                else:
                    time.sleep(0.5)
            if kill in (("leaves", m.step), ("leaves-frozen", m.step)) or (kill is not None and kill[:2] == ("ranks-leave", m.step)
                                              and m.epoch.number == 0 and m.rank in kill[2]):  # out at the next poll
                say(f"asks to leave at step {m.step}")
                m.leave()
            if kill == ("evicted-frozen", m.step):  # asked to leave by the straggler policy, for it (as rank 0's asks)
                say(f"is asked to leave at step {m.step}")
                m.votes.ask_to_leave(m.epoch.members[m.rank])
            if m.step == 5 and "connections" not in facts:  # (its connections made apart are made by then)
                facts["connections"] = connections_to(port)
            if kill == ("between", m.step):
                say(f"dies between steps, at step {m.step}")
                die()
            g = torch.Generator().manual_seed(1000 * m.step + m.rank)  # this rank's shard of the step's batch
            x = torch.randn(16, 8, generator=g).to(device)

            def forward_backward(net: nn.Module) -> None:
                backward(nn.functional.mse_loss(net(x).squeeze(-1), x.sum(1).sin()))
                if kill == ("mid-step", m.step) or (kill is not None and kill[0] == "first-step") or \
                        (kill is not None and kill[0] == "ranks-mid-step" and kill[1] == m.step and m.rank in kill[2]
                         and m.epoch.number == 0):
                    say(f"dies mid-step, at step {m.step}")
                    die()
                if kill == ("slow", m.step):  # a long step: it sees a loss well after the others
                    time.sleep(3)
                if kill in (("frozen", m.step), ("leaves-frozen", m.step), ("evicted-frozen", m.step),
                            ("frozen-past-end", m.step)):  # stopped
                    others = [Path(out) / f"member{i}.pt" for i in range(world) if i != index]
                    frozen_once(facts, m.step, say, "mid-step", others if kill[0] == "frozen-past-end" else [])

            epoch = m.epoch.number
            if mode == "gossip":  # the mode steps inside forward and backward: commit runs them
                ok = m.commit(lambda: forward_backward(m.mode))
            else:
                forward_backward(net)
                dies = kill == ("after-reduce", m.step)  # its reduction succeeded everywhere
                raises, before = kill == ("step-raises", m.step) and "raised" not in facts, m.step  # (once)
                stepper = m.mode if mode == "zero" else stepped
                try:  # the reduction (or the sync), the step
                    ok = m.commit(lambda: die() if dies else _user_error() if raises else stepper.step())
                except ValueError:
                    if not raises:
                        raise
                    facts["raised"] = (before, m.step)  # the step counted by the commit that raised (none)
                    stepper.zero_grad()
                    continue
            (m.mode if mode == "zero" else stepped).zero_grad()
            if m.epoch.number != epoch or not ok:
                why, stall = m.counters.stalls[-1] if m.counters.stalls else ("", 0.0)
                say(f"epoch {m.epoch.number}: rank {m.rank} of {m.world} ({why}"
                    f"{'; step discarded' if not ok else ''}), {stall:.2f} s")
            facts["steps"].append((m.step, ok, m.epoch.number, m.world))
            if ok:  # what this member committed at each step (and when): no two members may differ on one
                facts["digests"][m.step], facts.setdefault("times", {})[m.step] = digest(model), time.time()
            time.sleep(0.02)  # a step long enough for the replacement to arrive mid-run
        if m.left:
            facts.update(left_at=m.step, counters=vars(m.counters), epoch=m.epoch.number)
            say(f"left at step {m.step}")
            torch.save(facts, Path(out) / f"member{index}.pt")
            return
        if mode in ("localsgd", "diloco", "diloco-streaming"):
            m.mode.sync()  # the end of training: every fragment averaged now, as the last step may sync only one
        if mode == "gossip":
            m.mode.global_avg()  # the end of training: every rank's parameters := their exact mean
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
        st = (m.mode if mode == "zero" else opt).state_dict()["state"]  # (empty in gossip: its optimizers are the mode's)
        import threading
        facts["store_threads"] = sum(t.name == "fastreduce-store" for t in threading.enumerate())  # one per epoch: a leak
        facts["connections_end"] = connections_to(port)
        facts.update(params=params, adam=torch.cat([torch.cat([s["exp_avg"].reshape(-1), s["exp_avg_sq"].reshape(-1)]).cpu()
                                                    for s in st.values()] or [torch.zeros(0)]),
                     devices=sorted({str(t.device) for t in [*model.parameters(), *(s["exp_avg"] for s in st.values())]}),
                     adam_step=[float(s["step"]) for s in st.values()], counters=vars(m.counters),
                     epoch=m.epoch.number, world=m.world, graphs=graphs(),
                     hosts=len(set(m.mode.placement.hosts)) if mode == "zero" and m.world > 1 else None)
        say(f"done at step {m.step}, epoch {m.epoch.number}, world {m.world}: parameters {digest(model)}")
        if kill is not None and kill[0] == "held-before-close":  # the test cuts or kills something, then lets it close
            hold(Path(out), index, "finished", "close.go")
        m.close()
        facts["closed_in"] = m.epoch.number  # (a close that settled the last step with the others: the next epoch)
    except MembershipError as err:
        facts["refused"], facts["failed_at"] = str(err), time.time()
        say(f"stops: {err}")
    except BaseException:  # noqa: BLE001 - reported by the launcher
        facts["error"] = traceback.format_exc()
    torch.save(facts, Path(out) / f"member{index}.pt")


def launch(out: Path, transport: str, kills: dict[int, tuple[str, int]], joiners: int = 1,
           joiner_width: int = 16, steps: int = STEPS, verbose: bool = False, mode: str = "fused",
           release_after: list[int] | None = None, compiled: str = "", members: int = 3,
           device: str = "cpu", checkpoints: str = "", accelerate: bool = False,
           spares: bool = False, redundant: bool | int = True, start_step: int = 0) -> dict[int, dict]:
    """A coordinator, ``members`` members (``kills``: index -> (where, step); the replacements
    are numbered after them) and ``joiners`` replacements, each told to join once the next
    dying member's process is gone (of ``release_after``, default: the killed ones in order;
    -1: at once, an extra member, or with ``spares`` a warm spare, which then holds its ticket before
    the members start: it is among the tickets that found epoch 0); ``checkpoints``, ``accelerate``,
    ``redundant``, ``start_step`` (the first members'): see :func:`member`; returns what each member saved."""
    from fastreduce.coordinator import MEMBERS_PREFIX
    from fastreduce.launch import rank_context
    from fastreduce.membership import serve

    server = serve(0, "127.0.0.1")
    # forked from a server that imported torch, fastreduce and dynamo (an optimizer's first use imports it) once
    ctx = rank_context("keep_training", "torch._dynamo")
    released = ctx.Event()  # every replacement told to join: the members' last steps wait for it (HOLD_STEPS)
    settings = {"steps": steps, "verbose": verbose, "mode": mode, "compiled": compiled, "world": members,
                "released": released, "device": device, "checkpoints": checkpoints, "accelerate": accelerate,
                "redundant": redundant}
    procs = {i: ctx.Process(target=member, args=(i, server.port, str(out), transport, kills.get(i), None),
                            kwargs={**settings, "start_step": start_step}) for i in range(members)}
    gos = [ctx.Event() for _ in range(joiners)]
    late = {i: ctx.Process(target=member, args=(i, server.port, str(out), transport, kills.get(i), gos[i - members]),
                           kwargs={**settings, "width": joiner_width, "spare": spares})
            for i in range(members, members + joiners)}
    everyone = [*late.values(), *procs.values()]
    order = (sorted(kills) if release_after is None else release_after)[:joiners]
    early = [k for k, i in enumerate(order) if i < 0 and spares]  # warm spares started with the job
    try:
        for p in late.values():
            p.start()
        for k in early:
            gos[k].set()
        for _ in range(600):  # their tickets taken before the members start (up to 10 s each: see below)
            if server.add(MEMBERS_PREFIX + "tickets", 0) >= len(early) or \
                    not all(late[members + k].is_alive() for k in early):
                break
            time.sleep(0.1)
        for p in procs.values():
            p.start()
        for k, i in enumerate(order):
            if i >= 0:  # (-1: an extra process, told to join at once)
                {**procs, **late}[i].join(120)
            gos[k].set()
            connected = out / f"member{members + k}.connected"  # its first connection to the coordinator made:
            for _ in range(600):  # that can take 10 s (torch's reverse DNS lookup of the address), and the
                if connected.exists() or not late[members + k].is_alive():  # members would finish meanwhile
                    break
                time.sleep(0.1)
        released.set()
        for p in everyone:
            p.join(180)
    finally:
        for p in everyone:
            if p.is_alive():
                p.kill()
    found = {}
    for i in [*procs, *late]:
        f = out / f"member{i}.pt"
        if f.exists():
            found[i] = torch.load(f, weights_only=False)
    return found


def main(argv: list[str] | None = None) -> None:
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--kill-at", type=int, default=15, help="the step member 2 dies at")
    ap.add_argument("--where", choices=("mid-step", "between", "in-backward"), default="mid-step")
    ap.add_argument("--mode", choices=MODES, default="fused", help="overlap: buckets during backward; localsgd, "
                    "diloco: a sync every 4 steps, redone over the survivors when a member is lost in it (diloco-streaming: "
                    "each fragment's sync in flight over the next inner step, sent again over the survivors); gossip: "
                    "a ring, rebuilt over the survivors")
    ap.add_argument("--transport", choices=("process_group", "shm"), default="process_group")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as out:
        found = launch(Path(out), args.transport, {2: (args.where, args.kill_at)}, steps=args.steps, verbose=True,
                       mode=args.mode)
    errors = [f["error"] for f in found.values() if "error" in f]
    if errors:
        raise SystemExit(errors[0])
    final = [f for f in found.values() if "params" in f]
    one_model = args.mode in ("fused", "overlap", "zero")  # the local modes' ranks keep their own AdamW state
    same = all(torch.equal(f["params"], final[0]["params"]) and (not one_model or torch.equal(f["adam"], final[0]["adam"]))
               for f in final)
    what = "parameters and AdamW state" if one_model else "parameters (after a last sync or global_avg)"
    print(f"{len(final)} members at step {args.steps}; {what} {'bit-identical on every member' if same else 'DIFFER'}",
          flush=True)
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
