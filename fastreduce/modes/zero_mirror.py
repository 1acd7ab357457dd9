"""A second copy of every ZeRO shard, on the next rank: what lets training go on when a
rank is lost (:class:`~fastreduce.Membership`) without losing its optimizer state.

``ZeroOptimizer(..., redundant=True)``: rank r also holds rank r - 1's shard (its master
weights and optimizer state: the *mirror*) and steps it as rank r - 1 steps its own. After
each step's reduce-scatter, every rank sends its chunk of the averaged gradients to rank
r + 1 (one point-to-point message of P/N elements per step, beside the 2(N - 1)/N P of
the reduce-scatter and all-gather), clipping scales both alike, and the step runs the
torch optimizer on both: the same kernel on the same bits, so rank r's mirror equals rank
r - 1's shard bit for bit at every step. Memory: a second master, optimizer state and
gradient chunk, 4P/N more per rank with AdamW (P/N each for the master and gradient,
2P/N for the moments; P/N more for a buffer to send from where a dtype has several buckets).

After a loss the survivors hold every shard so long as no two ranks lost at once were
neighbours (r and r + 1); :func:`held` is what a rank holds, per parameter (torch.optim's
index) as ranges of the parameter's elements, and :func:`reassemble` joins the members'
pieces over a new group into torch.optim's whole format, which a ZeroOptimizer at any
world size loads.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..comm import complete
from ..heal import broadcast_state
from .zero_state import _MASTER, _SCALARS

__all__ = ["PARAM", "ShardsLost", "ZeroMirror", "held", "load", "reassemble"]

PARAM = "fastreduce_param"
"""The parameter's values, beside its optimizer state, in :func:`held` and :func:`reassemble`."""


class ShardsLost(RuntimeError):
    """Some shard's both holders were lost: its optimizer state is gone."""


class ZeroMirror:
    """Rank r's copy of rank r - 1's shard (see the module doc), built from ``opt``."""

    def __init__(self, opt: Any):
        self.opt = opt
        W, r = opt.world_size, opt.rank
        self.k, self.next, self.prev = (r - 1) % W, (r + 1) % W, (r - 1) % W
        self.masters: list[torch.Tensor] = []
        sizes: dict[torch.dtype, int] = {}
        for s in opt.shards:
            c = s.params.numel() // W
            self.masters.append(s.params[self.k * c:(self.k + 1) * c].to(s.master.dtype).clone())
            sizes[s.master.grad.dtype] = sizes.get(s.master.grad.dtype, 0) + c
        # The gradients: per dtype one flat buffer received whole, each master's a view.
        self.recv = {d: torch.zeros(n, dtype=d, device=opt.device) for d, n in sizes.items()}
        # What is sent: a dtype's one gradient chunk as it is, several joined in a buffer of their own.
        count = {d: sum(s.master.grad.dtype == d for s in opt.shards) for d in sizes}
        self.send = {d: torch.empty(n, dtype=d, device=opt.device) for d, n in sizes.items() if count[d] > 1}
        at = dict.fromkeys(sizes, 0)
        for m, s in zip(self.masters, opt.shards):
            d = s.master.grad.dtype
            m.grad = self.recv[d][at[d]:at[d] + m.numel()]
            at[d] += m.numel()
        # The same torch optimizer as the shard's (class, settings, groups), over the mirror's masters.
        self.inner = opt.optimizer_class([{**{k: v for k, v in pg.items() if k != "params"},
                                           "params": [m for m, s in zip(self.masters, opt.shards) if s.group == g]}
                                          for g, pg in enumerate(opt.param_groups)], **opt._kwargs)

    def exchange(self) -> None:
        """My chunk of the averaged gradients to rank r + 1, rank r - 1's into the mirror's."""
        for d, recv in self.recv.items():
            grads = [s.master.grad.reshape(-1) for s in self.opt.shards if s.master.grad.dtype == d]
            send = grads[0] if len(grads) == 1 else torch.cat(grads, out=self.send[d])
            complete((self.opt.comm.send_recv({self.next: send}, {self.prev: recv}), None))

    def grads(self) -> list[torch.Tensor]:
        return [m.grad for m in self.masters]

    def step(self) -> None:
        for ours, inner in zip(self.opt.param_groups, self.inner.param_groups):
            for key, v in ours.items():
                if key != "params":
                    inner[key] = v
        self.inner.step()

    @torch.no_grad()
    def pull(self) -> None:
        """Rank r - 1's shard as it is now (after a load): its masters and optimizer
        state, sent from there (collective)."""
        opt = self.opt
        mine = {"masters": [s.master for s in opt.shards], "state": opt.inner.state_dict()["state"]}
        theirs = {"masters": [torch.empty_like(m) for m in self.masters],
                  "state": {i: {k: torch.empty_like(v) if torch.is_tensor(v) else v for k, v in st.items()}
                            for i, st in mine["state"].items()}}
        sends = [t.contiguous() for t in _tensors(mine)]
        recvs = _tensors(theirs)
        for a, b in zip(sends, recvs):
            complete((opt.comm.send_recv({self.next: a}, {self.prev: b}), None))
        for m, got in zip(self.masters, theirs["masters"]):
            m.copy_(got)
        self.inner.load_state_dict({"state": theirs["state"], "param_groups": opt.inner.state_dict()["param_groups"]})


def _tensors(tree: Any) -> list[torch.Tensor]:
    if torch.is_tensor(tree):
        return [tree]
    if isinstance(tree, dict):
        return [t for k in sorted(tree, key=str) for t in _tensors(tree[k])]
    if isinstance(tree, list):
        return [t for v in tree for t in _tensors(v)]
    return []


@torch.no_grad()
def held(opt: Any) -> dict[str, Any]:
    """What this rank holds of the job's ZeRO state, as copies that outlive ``opt`` and its
    group: per chunk it holds (its own, and with ``redundant=True`` rank r - 1's), per
    parameter (torch.optim's index) the range of its elements in that chunk with the
    parameter's values (:data:`PARAM`), its state and master; and the hyperparameters."""
    W = opt.world_size
    index, _ = opt._index()
    by_slot = {i: k for k, i in index.items()}
    mirror = opt.mirror
    own = [(opt.rank, opt.shards[s].master, opt.inner.state.get(opt.shards[s].master, {})) for s in range(len(opt.shards))]
    chunks: dict[str, list[Any]] = {}
    for which, pieces in (("own", own), ("mirror", [] if mirror is None else
                                        [(mirror.k, m, mirror.inner.state.get(m, {})) for m in mirror.masters])):
        for s, (k, master, state) in enumerate(pieces):
            shard = opt.shards[s]
            if opt._template and which == "own":
                state = {}
            c = shard.params.numel() // W
            items: dict[str, Any] = dict(state)
            items[PARAM] = master
            if shard.low:
                items[_MASTER] = master
            entries = []
            for slot_i in opt.buckets[s].slots:
                slot = opt.layout.slots[slot_i]
                lo, hi = slot.offset, slot.offset + slot.numel
                a, b = min(max(lo, k * c), hi), min(max(lo, (k + 1) * c), hi)  # my part of it, maybe empty
                if a == b:
                    continue
                entry = {}
                for key, v in items.items():
                    if key in _SCALARS or not torch.is_tensor(v) or v.shape != master.shape:
                        entry[key] = v.clone() if torch.is_tensor(v) else v
                    else:
                        entry[key] = v[a - k * c:b - k * c].clone()
                entries.append((by_slot[slot_i], a - lo, slot.numel, entry))
            chunks[f"{s}/{k}"] = entries
    return {"world": W, "buckets": len(opt.shards), "chunks": chunks,
            "param_groups": [{k: v for k, v in pg.items() if k != "params"} for pg in opt.param_groups]}


@torch.no_grad()
def reassemble(mine: dict[str, Any] | None, device: torch.device) -> dict[str, Any]:
    """The members' :func:`held` pieces (``None`` on a joiner) joined on every rank of the
    default group: torch.optim's format (``state``, ``param_groups``), each state also
    holding :data:`PARAM`. Collective. :class:`ShardsLost` on every rank alike where some
    chunk has no holder."""
    world, rank = dist.get_world_size(), dist.get_rank()
    heads: list[Any] = [None] * world
    dist.all_gather_object(heads, None if mine is None else (mine["world"], mine["buckets"], sorted(mine["chunks"])))
    layout = next((h[:2] for h in heads if h is not None), None)
    if layout is None:
        raise ShardsLost("no member holds any ZeRO shard")
    source: dict[str, int] = {}
    for r, h in enumerate(heads):
        for chunk in (h[2] if h is not None else ()):
            source.setdefault(chunk, r)
    old_world, buckets = layout
    missing = sorted({k for s in range(buckets) for k in range(old_world) if f"{s}/{k}" not in source})
    if missing:
        raise ShardsLost(f"the ZeRO shards of old rank(s) {missing} were lost with both their holders (that rank "
                         "and the next: two neighbouring ranks lost at once)")
    out: dict[int, dict[str, Any]] = {}
    for r in range(world):
        if not any(src == r for src in source.values()):
            continue
        sent = {c: mine["chunks"][c] for c, src in source.items() if src == r} if r == rank else None
        got = broadcast_state(sent, device, src=r)
        for entries in got.values():
            for index, offset, numel, entry in entries:
                full = out.setdefault(index, {})
                for key, v in entry.items():
                    if not torch.is_tensor(v) or key in _SCALARS:
                        full.setdefault(key, v.clone() if torch.is_tensor(v) else v)
                        continue
                    if key not in full:
                        full[key] = torch.empty(numel, dtype=v.dtype, device=device)
                    full[key][offset:offset + v.numel()].copy_(v)
    box = [None if mine is None else mine["param_groups"]]  # the hyperparameters: the first holder's
    dist.broadcast_object_list(box, src=next(r for r, h in enumerate(heads) if h is not None))
    return {"state": out, "param_groups": box[0]}


@torch.no_grad()
def load(opt: Any, whole: dict[str, Any]) -> None:
    """Load :func:`reassemble`'s state into ``opt`` (any world size): the parameters'
    values, then the optimizer state and hyperparameters (collective with
    ``redundant=True``: the mirrors pull)."""
    params = [p for pg in opt.param_groups for p in pg["params"]]
    _, per_group = opt._index()
    state = {}
    for i, st in whole["state"].items():
        p = params[i]
        values = st[PARAM].view(p.shape)
        p.copy_(values if opt.gather_dtype is None or opt.world_size == 1 else values.to(opt.gather_dtype))
        state[i] = {k: v.view(p.shape) if torch.is_tensor(v) and k not in _SCALARS else v
                    for k, v in st.items() if k != PARAM}
    opt.load_state_dict({"state": state, "param_groups": [{**hyper, "params": ids} for hyper, ids in
                                                          zip(whole["param_groups"], per_group)]})
