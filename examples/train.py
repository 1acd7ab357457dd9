"""Data-parallel training through fastreduce: the main job of the README.

    torchrun --standalone --nproc-per-node 2 examples/train.py              # fused
    torchrun --standalone --nproc-per-node 2 examples/train.py --mode overlap  # overlapped
    torchrun --standalone --nproc-per-node 2 examples/train.py --mode zero  # ZeRO
    torchrun --standalone --nproc-per-node 2 examples/train.py --mode gossip  # decentralized
    torchrun --standalone --nproc-per-node 2 examples/train.py --mode local   # local SGD
    torchrun --standalone --nproc-per-node 2 examples/train.py --mode diloco  # DiLoCo
    python examples/train.py --chaos   # a member dies mid-run, a replacement joins (keep_training.py)

Each rank trains the same small classifier on its own shard of a synthetic data set,
averages gradients with ``fastreduce.all_reduce_gradients`` after every backward (with
``--mode overlap``, a ``fastreduce.FusedReducer(overlap=True)`` starts bucketed
all-reduces during backward and ``reduce()`` waits for them; or,
with ``--mode zero``, lets ``fastreduce.ZeroOptimizer`` reduce-scatter them and step
its shard of AdamW; with ``--mode gossip``, ``fastreduce.DecentralizedDataParallel``
mixes parameters with one peer per round and averages them globally at the end; with
``--mode local``, ``fastreduce.LocalSGD`` averages the parameters every 4th step after 10
synchronous ones; with ``--mode diloco``, ``fastreduce.DiLoCo`` runs an outer Nesterov
step on the averaged pseudo-gradient of two staggered fragments every 10 steps), and
at the end checks that every rank holds bit-identical parameters. Runs on CPU (gloo),
CUDA (nccl) and Gaudi (hccl); the device is picked by ``fastreduce.init_distributed``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import fastreduce

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def integration_parser(description: str | None) -> argparse.ArgumentParser:
    """The flags the Hugging Face examples share (``hf_trainer.py``, ``accelerate_train.py``)."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps")
    ap.add_argument("--batch", type=int, default=8, help="per-rank micro-batch size")
    ap.add_argument("--accum", type=int, default=2, help="gradient accumulation steps")
    ap.add_argument("--wire", choices=sorted(DTYPES), default="bf16", help="dtype on the wire")
    ap.add_argument("--overlap", action="store_true", help="reduce buckets during backward")
    return ap


def make_data(n: int, dim: int, classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed, learnable problem: labels from a random linear teacher plus noise."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, dim, generator=g)
    teacher = torch.randn(dim, classes, generator=g)
    y = (x @ teacher + 0.5 * torch.randn(n, classes, generator=g)).argmax(dim=1)
    return x, y


def make_model(dim: int, hidden: int, classes: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(dim, hidden), nn.GELU()]
    for _ in range(depth):
        layers += [nn.Linear(hidden, hidden), nn.LayerNorm(hidden), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(hidden, classes))


def say(line: str) -> None:
    """Print ``line`` whole: the text and its newline in one write, flushed (unbuffered,
    print writes them apart, and another process's line can land between)."""
    print(line + "\n", end="", flush=True)


def params_in_sync(model: nn.Module) -> bool:
    """True when every rank holds exactly rank 0's parameters."""
    flat = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, src=0)
    same = torch.tensor([float(torch.equal(flat, ref))], device=flat.device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same.item())


def leave(in_sync: bool = True) -> None:
    """End a checked run on every rank (every example ends here): wait for the peers, so
    nobody tears its connections down while one still uses them; fail if the ranks'
    parameters diverged. What fastreduce runs in the background (the heartbeat, the store's
    and transport's workers) stops before the group is torn down, as docs/guarantees.md asks of
    a script that destroys its group itself (without that call, it stops at exit)."""
    dist.barrier()
    fastreduce.shutdown()
    dist.destroy_process_group()
    if not in_sync:
        raise SystemExit("parameters diverged across ranks")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=64, help="per-rank batch size")
    ap.add_argument("--wire", choices=sorted(DTYPES), default="bf16", help="dtype on the wire")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--mode", choices=("fused", "overlap", "zero", "gossip", "local", "diloco"), default="fused",
                    help="fused: all_reduce_gradients + AdamW; overlap: FusedReducer(overlap=True) + AdamW; "
                         "zero: ZeroOptimizer(AdamW); "
                         "gossip: DecentralizedDataParallel (one-peer-exp) + AdamW per bucket; "
                         "local: LocalSGD(AdamW, every 4 steps); diloco: DiLoCo(AdamW, outer Nesterov SGD)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    info = fastreduce.init_distributed()
    torch.manual_seed(0)  # same initial weights on every rank
    model = make_model(dim=32, hidden=128, classes=8, depth=4).to(info.device)
    zero, gossip = args.mode == "zero", args.mode == "gossip"
    local = None  # a local-update mode: hooked on the optimizer's step, no gradient all-reduce
    reducer = None  # overlap: the reducer object (its hooks start all-reduces during backward)
    net = model
    if args.mode == "overlap":
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        reducer = fastreduce.FusedReducer(model, wire_dtype=DTYPES[args.wire], overlap=True)
    elif args.mode == "local":
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        local = fastreduce.LocalSGD(model, opt, sync_every=4, warmup_steps=10, wire_dtype=DTYPES[args.wire])
    elif args.mode == "diloco":
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        local = fastreduce.DiLoCo(model, opt, outer, sync_every=10, fragments=2, fragment_delay=1,
                                  wire_dtype=DTYPES[args.wire])
    elif gossip:  # no all-reduce: each bucket mixes with one peer per round, in backward
        net = fastreduce.DecentralizedDataParallel(
            model, lambda named: torch.optim.AdamW([p for _, p in named], lr=args.lr), topology="one-peer-exp",
            wire_dtype=DTYPES[args.wire])
        opt = None
    elif zero:  # reduce-scatter during backward, 1/N of AdamW per rank, all-gather after
        opt = fastreduce.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=args.lr,
                                       wire_dtype=DTYPES[args.wire], module=model)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    x, y = make_data(4096, 32, 8)
    shard = slice(info.rank, None, info.world_size)  # each rank its own examples
    x, y = x[shard].to(info.device), y[shard].to(info.device)
    loss_fn = nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(100 + info.rank)

    t0 = time.perf_counter()
    for step in range(args.steps + 1):
        idx = torch.randint(0, x.shape[0], (args.batch,), generator=gen).to(info.device)
        loss = loss_fn(net(x[idx]), y[idx])
        loss.backward()
        if opt is not None:
            if reducer is not None:
                reducer.reduce()  # wait for the buckets launched during backward
            elif not zero and local is None:
                fastreduce.all_reduce_gradients(model, DTYPES[args.wire])
            opt.step()
            opt.zero_grad()  # set_to_none: the next forward re-attaches the grads as zeroed views
        if step % 10 == 0:
            avg = loss.detach().clone()
            dist.all_reduce(avg)
            if info.rank == 0:
                say(f"step {step:4d}  loss {avg.item() / info.world_size:.4f}")
    elapsed = time.perf_counter() - t0

    if gossip:
        spread = net.consensus_distance()  # a collective: the same number on every rank
        if info.rank == 0:
            say(f"before the global average the ranks' parameters were {spread:.2e} apart "
                "(relative distance from their mean)")
        net.global_avg()  # every rank: the exact mean of the ranks' parameters
    if local is not None:
        local.sync()  # LocalSGD: the mean now; DiLoCo: an outer step of every fragment now
    with torch.no_grad():
        acc = (model(x).argmax(dim=1) == y).float().mean()
    dist.all_reduce(acc)
    if zero:
        opt.wait_params()  # read outside forward: wait for the last all-gather
    in_sync = params_in_sync(model)
    if info.rank == 0:  # one summary line, printed whole
        say(f"{info.world_size} ranks on {info.device} ({info.backend}), {args.mode} mode, {args.wire} wire: "
            f"{args.steps} steps in {elapsed:.1f} s, train accuracy {acc.item() / info.world_size:.1%}; "
            f"parameters identical on all ranks: {in_sync}")
    leave(in_sync)


if __name__ == "__main__":
    if "--chaos" in sys.argv[1:]:  # not under torchrun: it launches a fault-tolerant job itself
        from keep_training import main as chaos

        chaos([a for a in sys.argv[1:] if a != "--chaos"])
        sys.exit(0)
    main()
