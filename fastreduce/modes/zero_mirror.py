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
index) as ranges of the parameter's elements. :func:`reshard` moves those pieces into a
ZeroOptimizer built over the new group, at any world size: each rank receives, point to
point, only what it holds there. :func:`reassemble` joins them whole instead (torch.optim's
format, every rank all of it; :func:`load` loads that), where the parameters' values must
travel too.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..comm import complete
from ..heal import broadcast_state
from .zero_state import _MASTER, _SCALARS

__all__ = ["PARAM", "ShardsLost", "ZeroMirror", "held", "load", "reassemble", "reshard"]

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
def held(opt: Any, params_current: bool = False) -> dict[str, Any]:
    """What this rank holds of the job's ZeRO state, as copies that outlive ``opt`` and its
    group: per chunk it holds (its own, and with ``redundant=True`` rank r - 1's), per
    parameter (torch.optim's index) the range of its elements in that chunk with the
    parameter's values (:data:`PARAM`), its state and master; and the hyperparameters.
    ``params_current``: this rank's parameters are the last step's, all-gathered (else a
    step's all-gather failed after its shards stepped, and :func:`reassemble` sends the
    parameters' values too)."""
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
    return {"world": W, "buckets": len(opt.shards), "chunks": chunks, "stale": not params_current,
            "param_groups": [{k: v for k, v in pg.items() if k != "params"} for pg in opt.param_groups]}


@torch.no_grad()
def reassemble(mine: dict[str, Any] | None, device: torch.device) -> dict[str, Any]:
    """The members' :func:`held` pieces (``None`` on a joiner) joined on every rank of the
    default group: torch.optim's format (``state``, ``param_groups``), each state also
    holding :data:`PARAM` where some member's parameters were stale (a joiner's come with
    the model's state). Collective. :class:`ShardsLost` on every rank alike where some
    chunk has no holder."""
    world, rank = dist.get_world_size(), dist.get_rank()
    heads: list[Any] = [None] * world
    dist.all_gather_object(heads, None if mine is None else (mine["world"], mine["buckets"], sorted(mine["chunks"]),
                                                             mine["stale"]))
    values = any(h[3] for h in heads if h is not None)
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
        sent = None
        if r == rank:
            sent = {c: [(i, o, n, {k: v for k, v in e.items() if values or k != PARAM}) for i, o, n, e in
                        mine["chunks"][c]] for c, src in source.items() if src == r}
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
        if PARAM in st:
            values = st[PARAM].view(p.shape)
            p.copy_(values if opt.gather_dtype is None or opt.world_size == 1 else values.to(opt.gather_dtype))
        state[i] = {k: v.view(p.shape) if torch.is_tensor(v) and k not in _SCALARS else v
                    for k, v in st.items() if k != PARAM}
    opt.load_state_dict({"state": state, "param_groups": [{**hyper, "params": ids} for hyper, ids in
                                                          zip(whole["param_groups"], per_group)]})


def _wanted(opt: Any, d: int) -> list[tuple[str, int, int, int, int, int]]:
    """What rank ``d`` of ``opt``'s layout holds: per bucket ``s``, its chunk and (with a
    mirror) rank d - 1's, as ``(which, s, index, start, end, at)``: parameter ``index``'s
    elements ``[start, end)`` at ``at`` in the chunk (``which``: ``own`` or ``mirror``)."""
    W = opt.world_size
    index, _ = opt._index()
    by_slot = {i: k for k, i in index.items()}
    chunks = [("own", d)] + ([("mirror", (d - 1) % W)] if opt.redundant and W > 1 else [])
    out = []
    for which, k in chunks:
        for s, shard in enumerate(opt.shards):
            c = shard.params.numel() // W
            for slot_i in opt.buckets[s].slots:
                slot = opt.layout.slots[slot_i]
                lo, hi = slot.offset, slot.offset + slot.numel
                a, b = min(max(lo, k * c), hi), min(max(lo, (k + 1) * c), hi)
                if a < b:
                    out.append((which, s, by_slot[slot_i], a - lo, b - lo, a - k * c))
    return out


def _moves(wanted: list[tuple[str, int, int, int, int, int]], pieces: dict[int, list[tuple[int, int]]]
           ) -> list[tuple[str, int, int, int, int, int]]:
    """The overlaps of ``wanted`` ranges with a source's ``pieces`` (per parameter, its held
    ``(offset, length)``): ``(which, s, at, index, offset, n)``: ``n`` elements of parameter
    ``index`` from ``offset`` (in the piece held from ``offset`` on) to ``at`` in the chunk."""
    out = []
    for which, s, index, start, end, at in wanted:
        for off, n in pieces.get(index, ()):
            x, y = max(start, off), min(end, off + n)
            if x < y:
                out.append((which, s, at + x - start, index, x, y - x))
    return out


@torch.no_grad()
def reshard(opt: Any, mine: dict[str, Any] | None) -> None:
    """The members' :func:`held` pieces (``None`` on a joiner) into ``opt`` (built over the
    new default group, any world size): each rank receives only what it holds in the new
    layout (its shard and, with ``redundant=True``, its copy of rank r - 1's), point to
    point from one holder of each piece; nothing is gathered whole. Where a member's
    parameters were stale (a step's all-gather failed after its shards stepped), the
    state is joined whole instead (:func:`reassemble`, :func:`load`), the parameters'
    values with it. Collective. :class:`ShardsLost` on every rank alike where some piece
    has no holder."""
    world, rank = dist.get_world_size(), dist.get_rank()
    head = None
    if mine is not None:
        entries = [e for pieces in mine["chunks"].values() for _, _, _, e in pieces]
        first = entries[0] if entries else {}
        keys = {k: v.dtype for k, v in first.items() if torch.is_tensor(v) and k not in _SCALARS and k != PARAM}
        uniform = len(set(keys.values())) == 1 and all(
            {k for k, v in e.items() if torch.is_tensor(v) and k not in _SCALARS and k != PARAM} == set(keys)
            for e in entries)  # (else, mixed dtypes or state: joined whole)
        head = {"layout": (mine["world"], mine["buckets"]), "stale": mine["stale"] or not uniform, "keys": keys,
                "scalars": {k: v for k, v in first.items() if k in _SCALARS},
                "groups": mine["param_groups"],
                "chunks": {c: [(i, o, e[next(iter(keys))].numel() if keys else 0) for i, o, _, e in pieces]
                           for c, pieces in mine["chunks"].items()}}
    heads: list[Any] = [None] * world
    dist.all_gather_object(heads, head)
    holders = [h for h in heads if h is not None]
    if not holders:
        raise ShardsLost("no member holds any ZeRO shard")
    if any(h["stale"] for h in holders) or not holders[0]["keys"]:  # (no state yet: only the parameters)
        load(opt, reassemble(mine, opt.device))
        return
    source: dict[str, int] = {}
    for r, h in enumerate(heads):
        for chunk in (h["chunks"] if h is not None else ()):
            source.setdefault(chunk, r)
    old_world, buckets = holders[0]["layout"]
    missing = sorted({k for s in range(buckets) for k in range(old_world) if f"{s}/{k}" not in source})
    if missing:
        raise ShardsLost(f"the ZeRO shards of old rank(s) {missing} were lost with both their holders (that rank "
                         "and the next: two neighbouring ranks lost at once)")
    keys = sorted(holders[0]["keys"])
    dtype = holders[0]["keys"][keys[0]]
    pieces: dict[int, dict[int, list[tuple[int, int]]]] = {r: {} for r in range(world)}
    for chunk, r in sorted(source.items()):
        for i, o, n in heads[r]["chunks"][chunk]:
            pieces[r].setdefault(i, []).append((o, n))
    # Where this rank's pieces sit, per parameter: (offset, length, entry).
    held_at: dict[int, list[tuple[int, int, dict[str, Any]]]] = {}
    for chunk, r in source.items():
        if r == rank:
            for i, o, _, e in mine["chunks"][chunk]:
                held_at.setdefault(i, []).append((o, e[keys[0]].numel(), e))
    mirror = opt.mirror
    targets = {"own": [(s.master, opt.inner) for s in opt.shards],
               "mirror": [] if mirror is None else [(m, mirror.inner) for m in mirror.masters]}
    for which, pairs in targets.items():  # every state tensor, to be filled in place
        for master, inner in pairs:
            st = inner.state[master]
            st.clear()
            on_device = inner.defaults.get("fused") or inner.defaults.get("capturable")  # torch's rule for "step"
            for k, v in holders[0]["scalars"].items():
                st[k] = (v.clone().to(master.device) if on_device else v.clone()) if torch.is_tensor(v) else v
            for k in keys:
                if k != _MASTER:
                    st[k] = torch.zeros_like(master, dtype=dtype)

    def into(which: str, s: int, key: str) -> torch.Tensor:
        master, inner = targets[which][s]
        return master if key == _MASTER else inner.state[master][key]

    sends: dict[int, torch.Tensor] = {}
    recvs: dict[int, tuple[torch.Tensor, list[tuple[str, int, int, int, int, int]]]] = {}
    for peer in range(world):
        out = _moves(_wanted(opt, peer), pieces[rank])  # what I send peer
        if out:
            parts = []
            for which, s, at, i, x, n in out:
                o, _, e = next((o, m, e) for o, m, e in held_at[i] if o <= x < o + m)
                parts += [e[k][x - o:x - o + n] for k in keys]
            flat = torch.cat([p.reshape(-1).to(opt.device) for p in parts]) if parts else None
            if peer == rank:
                recvs[peer] = (flat, out)
            elif flat is not None:
                sends[peer] = flat
        if peer != rank:
            got = _moves(_wanted(opt, rank), pieces[peer])
            if got:
                recvs[peer] = (torch.empty(sum(n for *_, n in got) * len(keys), dtype=dtype, device=opt.device), got)
    work = opt.comm.send_recv(sends, {p: buf for p, (buf, _) in recvs.items() if p != rank}) \
        if world > 1 else None
    if work is not None:
        complete((work, None))
    for buf, moves in recvs.values():
        at_ = 0
        for which, s, at, _, _, n in moves:
            for k in keys:
                into(which, s, k)[at:at + n].copy_(buf[at_:at_ + n])
                at_ += n
    if mirror is not None:  # a copy of full-precision parameters: their chunk, as they are now
        for m, shard in zip(mirror.masters, opt.shards):
            if not shard.low:
                c = shard.params.numel() // opt.world_size
                m.copy_(shard.params[mirror.k * c:(mirror.k + 1) * c])
    opt._template = False
    groups = holders[0]["groups"]
    for pg, src in zip(opt.param_groups, groups):
        pg.update(src)
    opt._sync_hyperparameters()
