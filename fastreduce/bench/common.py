"""Timing and statistics shared by the bench suites.

The machine a benchmark runs on is usually shared and noisy, so every suite times its
methods the same way: interleaved round-robin (every round runs each method, in an
order of its own, so drift hits all methods alike and no method always follows the
same one: what a method leaves behind, freed memory or cold caches, the next one pays;
with the start only rotating, ZeRO's row after torch's ZeroRedundancyOptimizer's was 3-9%
slower than the very same layout further down), a ``dist.barrier()``
before each timed call, and per iteration the **slowest rank's** time (what the next
step waits for). Only medians and p10/p90 are reported, never means.
"""

from __future__ import annotations

import os
import platform
import random
import signal
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["HEAD_SIZE", "VOCAB", "Method", "byte_gpt2", "crash", "last_free",
           "machine_info", "ohabana_loop", "percentile", "slowest_rank", "summary_ms",
           "time_call", "time_round_robin"]


def _noop() -> None:
    pass


def last_free(members: int, taken: set[int]) -> int | None:
    """The highest index below ``members`` not in ``taken`` (``None``: none is free): the
    chaos run's first member for a failure kind beside the kills."""
    return max((i for i in range(members) if i not in taken), default=None)


def crash() -> Any:
    """Die as the OS kills a process (what ``kill -9`` from outside does): SIGKILL to this
    process, no teardown, no flush, no exit code of its own choosing. The fault benches'
    injected crashes; it never returns (typed ``Any`` to sit in a hook's expression)."""
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable: SIGKILL was sent to this process")


@dataclass
class Method:
    """One timed call: ``prep`` (untimed) then ``step`` (timed); ``nbytes`` on the wire per call."""

    name: str
    step: Callable[[], Any]
    prep: Callable[[], Any] = _noop
    nbytes: int = 0


def time_call(method: Method) -> float:
    """Seconds for one ``step`` on this rank, all ranks released together by a barrier."""
    method.prep()
    dist.barrier()
    t0 = time.perf_counter()
    method.step()
    return time.perf_counter() - t0


def time_round_robin(methods: list[Method], iters: int, reps: int = 1,
                     warmup_rounds: int = 1) -> dict[str, list[float]]:
    """``reps`` calls of every method per round, in each round's own order (a permutation
    drawn from the round's number: the same on every rank).

    ``warmup_rounds`` rounds run first, untimed; then enough rounds for ``iters``
    timed calls per method. Returns each method's per-call seconds on this rank.
    """
    rounds = -(-iters // reps)
    times: dict[str, list[float]] = {m.name: [] for m in methods}
    for r in range(warmup_rounds + rounds):
        order = list(methods)
        random.Random(r).shuffle(order)
        for method in order:
            for _ in range(reps):
                t = time_call(method)
                if r >= warmup_rounds:
                    times[method.name].append(t)
    return {name: ts[:iters] for name, ts in times.items()}


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``values``, interpolated linearly between ranks."""
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def slowest_rank(per_rank_times: list[dict[str, list[float]]], name: str) -> list[float]:
    """Per-iteration time of ``name``: the slowest rank's time for that iteration."""
    return [max(ts) for ts in zip(*(times[name] for times in per_rank_times))]


def summary_ms(seconds: list[float]) -> dict[str, float]:
    """Median, p10 and p90 of ``seconds``, in milliseconds."""
    ms = [t * 1e3 for t in seconds]
    return {"median_ms": percentile(ms, 0.5), "p10_ms": percentile(ms, 0.1), "p90_ms": percentile(ms, 0.9)}


def machine_info() -> dict[str, Any]:
    return {"platform": platform.platform(), "machine": platform.machine(),
            "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "torch": torch.__version__}


def ohabana_loop(params: list[torch.nn.Parameter]) -> Callable[[], None]:
    """The baseline both suites beat, optimum-habana's loop: per-parameter cast and scale
    into a fused bf16 buffer, one SUM all-reduce, per-parameter cast back."""
    fused = torch.zeros(sum(p.numel() for p in params), dtype=torch.bfloat16)
    views, start = [], 0
    for p in params:
        views.append(fused[start:start + p.numel()].view(p.shape))
        start += p.numel()
    scale = 1.0 / dist.get_world_size()

    @torch.no_grad()
    def reduce() -> None:
        for p, v in zip(params, views):
            v.copy_(p.grad.to(torch.bfloat16) * scale)
        dist.all_reduce(fused, op=dist.ReduceOp.SUM)
        for p, v in zip(params, views):
            p.grad.copy_(v.to(p.grad.dtype))
    return reduce


VOCAB = 256
HEAD_SIZE = 32


def byte_gpt2(layers: int, width: int, positions: int, head_size: int = HEAD_SIZE, seed: int = 0) -> Any:
    """A GPT-2 from ``transformers`` built from a config (never downloaded): byte vocabulary,
    dropout 0, weights from ``seed`` (the convergence and compression suites' model)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=positions, n_embd=width, n_layer=layers,
                        n_head=max(1, width // head_size), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=None, eos_token_id=None)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # what transformers falls back to for GPT-2, said here: no warning
    return model
