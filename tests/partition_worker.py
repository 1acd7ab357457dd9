"""One rank of the partition test (under torchrun, on a namespace host): trains with a
mode until a collective fails, and says how.

    python -m torch.distributed.run ... tests/partition_worker.py MODE DIR

Every rank writes ``DIR/rank-<host>`` (its global rank) once the process group is up,
and ``DIR/steady`` after a few steps; the test then takes the last host's link down. Host A's
rank writes ``DIR/result-A.json``: what it raised (type, message, the lost ranks) and
when (``time.time()``), or that nothing was raised within ``$PARTITION_WATCH_S``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
from torch import nn

import fastreduce
from fastreduce.comm.ring import _ring_queues as ring_threads


def build(mode: str, model: nn.Module):
    """``step(x, y)`` of one training step in ``mode``."""
    loss_fn = nn.CrossEntropyLoss()
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-3)  # noqa: E731
    if mode == "gossip":
        net = fastreduce.DecentralizedDataParallel(model, lambda named: adamw([p for _, p in named]))

        def step(x, y):
            loss_fn(net(x), y).backward()
        return step
    if mode == "zero":
        opt = fastreduce.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, module=model)
    else:
        opt = adamw(model.parameters())
    reducer = fastreduce.FusedReducer(model, overlap=True) if mode == "overlap" else None
    local = {"local": lambda: fastreduce.LocalSGD(model, opt, sync_every=2),
             "diloco": lambda: fastreduce.DiLoCo(model, opt, torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9,
                                                                              nesterov=True), sync_every=2)}
    hooked = local[mode]() if mode in local else None

    def step(x, y):
        loss_fn(model(x), y).backward()
        if reducer is not None:
            reducer.reduce()
        elif mode == "fused":
            fastreduce.all_reduce_gradients(model)
        opt.step()
        opt.zero_grad()
    step.hooked = hooked  # kept alive
    return step


def publish(path: Path, text: str) -> None:
    """Write whole or not at all: the test polls for the file and reads it at once (every
    host's rank may publish the same name: each writes its own temporary file)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    host = os.environ["PARTITION_HOST"]
    info = fastreduce.init_distributed()
    publish(out / f"rank-{host}", str(info.rank))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 8))
    step = build(mode, model)
    gen = torch.Generator().manual_seed(info.rank)
    watch = float(os.environ.get("PARTITION_WATCH_S", "90"))
    result: dict = {"raised": None}
    n = 0
    try:
        start = time.monotonic()
        while time.monotonic() - start < watch:
            x = torch.randn(32, 64, generator=gen)
            y = torch.randint(0, 8, (32,), generator=gen)
            step(x, y)
            n += 1
            if n == 10:
                publish(out / "steady", str(time.time()))
            time.sleep(0.01)
    except BaseException as err:  # noqa: BLE001 - what the test looks at
        result = {"raised": type(err).__name__, "message": str(err), "at": time.time(),
                  "ranks": getattr(err, "ranks", None), "trace": traceback.format_exc()[-3000:]}
    result["steps"] = n
    result["ring"] = bool(ring_threads)  # a ring reduce-scatter ran (ZeRO, fp32, Gloo, > 2 ranks)
    if host == "A":
        publish(out / "result-A.json", json.dumps(result))
    # exits as a user's script does on an uncaught error: through the interpreter's
    # finalization, with the abandoned collective still pending in Gloo
    sys.exit(3 if result["raised"] is not None else 0)


if __name__ == "__main__":
    main()
