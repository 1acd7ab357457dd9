"""Copies of every ZeRO shard on other ranks: what lets training go on when ranks are lost
(:class:`~fastreduce.Membership`) without losing their optimizer state.

``ZeroOptimizer(..., redundant=k)`` (``True``: 1): each shard is also held by k other ranks
(its master weights and optimizer state: the *mirrors*), each stepping its copy as the owner
steps the shard. After each step's reduce-scatter, every rank sends its chunk of the averaged
gradients to the k holders of its copies (k point-to-point messages of P/N elements per step,
beside the 2(N - 1)/N P of the reduce-scatter and all-gather), clipping scales all alike, and
the step runs the torch optimizer on each: the same kernel on the same bits, so every copy
equals its shard bit for bit at every step. Memory: per copy a master, optimizer state and
gradient chunk, 4P/N more per rank and copy with AdamW (P/N each for the master and gradient,
2P/N for the moments; P/N more, once, for a buffer to send from where a dtype has several buckets).

Where the copies sit (:class:`Placement`): the ranks, listed host by host (the hosts with the
most ranks first, then in the order of their first rank), are laid down a table column by
column, in as many rows as the largest host has ranks (where it has more than half of them: as
many as the other hosts have), and read row by row; a shard's copies go to the k ranks after its
owner in that order. On one host that is ranks r + 1, ..., r + k; over hosts of one size, one
rank of each host in turn. Of n ranks, wherever no host holds more than n / (k + 1) (hosts of
one size: as many as k + 1), each copy sits on another host than the owner's and the other
copies', so a whole host lost at once loses no shard; where one does, no placement can do that,
and there the first copy is still on another host where no host holds more than half the ranks,
and every shard still has a holder off its owner's host where none holds more than k / (k + 1)
(the most any cyclic order gets, ``tests/test_zero.py``). Any k ranks lost at once never lose a
shard. A host is a host name and a network namespace
(:func:`~fastreduce.process_identity.host_key`).

:func:`held` is what a rank holds, per parameter (torch.optim's index) as ranges of the
parameter's elements: the masters and the optimizer state. :func:`reshard` moves those pieces
into a ZeroOptimizer built over the new group, at any world size: each rank receives, point to
point, only what it holds there, each range from one holder (the members' pieces may be laid
out in two epochs: a member lost as the others took theirs), and where some member's
parameters were stale (a step's all-gather failed after its shards stepped) the parameters
are all-gathered again from the masters.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..comm import complete
from ..faults import all_gather_object_watched
from ..process_identity import host_key
from .zero_pieces import ShardOptimizer
from .zero_state import MASTER_KEY

__all__ = ["Placement", "ShardsLost", "ZeroMirror", "copies_of", "exchange", "held", "reshard"]


class ShardsLost(RuntimeError):
    """Some shard's every holder was lost: its optimizer state is gone."""


def copies_of(redundant: bool | int) -> int:
    """The copies of each shard ``redundant=`` asks for: ``False`` 0, ``True`` 1, or a count."""
    if isinstance(redundant, bool):
        return int(redundant)
    if isinstance(redundant, int) and redundant >= 0:
        return redundant
    raise ValueError(f"redundant must be True, False or a count of copies of each shard (an int >= 0), "
                     f"got {redundant!r}")


class Placement:
    """Which ranks hold each shard's copies (see the module doc): ``order`` lists the ranks host
    by host (the largest host first), laid down a table column by column and read row by row;
    the j-th copy of rank d's shard is on the j-th rank after d in it."""

    def __init__(self, hosts: list[str], copies: int):
        columns: dict[str, list[int]] = {}
        for r, h in enumerate(hosts):
            columns.setdefault(h, []).append(r)
        world = len(hosts)
        listed = [r for c in sorted(columns.values(), key=len, reverse=True) for r in c]  # (ties: first rank first)
        tall = max(map(len, columns.values()))
        # As many rows as the largest host has ranks: no row holds a host twice, and a host as large as that fills
        # whole columns. A host of more than half the ranks: as many rows as the others have, one of theirs in each
        # row, so that its ranks run in stretches as short as they can be between them.
        rows = tall if 2 * tall <= world or tall == world else world - tall
        self.order = [listed[i] for row in range(rows) for i in range(row, world, rows)]
        self._at = {r: p for p, r in enumerate(self.order)}
        self.world, self.copies, self.hosts = world, min(copies, world - 1), list(hosts)

    @classmethod
    def of_group(cls, group: Any, copies: int) -> Placement:
        """The placement over ``group``'s ranks, from each one's host (collective)."""
        return cls(all_gather_object_watched(host_key(), group), copies)

    def holder(self, d: int, j: int) -> int:
        """The rank that holds the j-th copy (1 ... copies) of rank ``d``'s shard."""
        return self.order[(self._at[d] + j) % self.world]

    def held(self, r: int) -> list[int]:
        """The ranks whose shards rank ``r`` holds a copy of: the j-th copy's first."""
        return [self.order[(self._at[r] - j) % self.world] for j in range(1, self.copies + 1)]

    def kept_without(self, gone: set[int]) -> bool:
        """Whether every rank's shard keeps a holder (the rank or a copy's) outside ``gone``."""
        return all({d, *(self.holder(d, j) for j in range(1, self.copies + 1))} - gone for d in range(self.world))


class ZeroMirror:
    """This rank's ``j``-th copy: of the shard of the rank ``k`` that :class:`Placement` puts
    j ranks before it (see the module doc), built from ``opt``."""

    def __init__(self, opt: Any, j: int):
        self.opt, self.j = opt, j
        r = opt.rank
        self.k = opt.placement.held(r)[j - 1]  # its owner, who sends it the gradients
        self.next = opt.placement.holder(r, j)  # the holder of my shard's j-th copy
        W = opt.world_size
        self.masters: list[torch.Tensor] = []
        sizes: dict[torch.dtype, int] = {}
        for s in opt.shards:
            c = s.params.numel() // W
            self.masters.append(s.params[self.k * c:(self.k + 1) * c].to(s.master.dtype).clone())
            sizes[s.master.grad.dtype] = sizes.get(s.master.grad.dtype, 0) + c
        # The gradients: per dtype one flat buffer received whole, each master's a view.
        self.recv = {d: torch.zeros(n, dtype=d, device=opt.device) for d, n in sizes.items()}
        # What is sent: a dtype's one gradient chunk as it is, several joined in a buffer of their own
        # (the first copy's; every copy's holder is sent the same).
        self._grads = {d: [s.master.grad.reshape(-1) for s in opt.shards if s.master.grad.dtype == d] for d in sizes}
        self.send = {d: torch.empty(n, dtype=d, device=opt.device) for d, n in sizes.items()
                     if len(self._grads[d]) > 1 and j == 1}
        at = dict.fromkeys(sizes, 0)
        for m, s in zip(self.masters, opt.shards):
            d = s.master.grad.dtype
            m.grad = self.recv[d][at[d]:at[d] + m.numel()]
            at[d] += m.numel()
        self.inner = ShardOptimizer(opt.optimizer_class, opt.param_groups, [s.group for s in opt.shards], self.masters,
                                    [opt.pieces_of(s, self.k) for s in range(len(opt.shards))], opt.inner_kwargs)

    def grads(self) -> list[torch.Tensor]:
        return [m.grad for m in self.masters]

    @torch.no_grad()
    def pull(self) -> None:
        """Rank k's shard as it is now (after a load): its masters and optimizer state, sent
        from there (collective: every rank's j-th copy at once): per bucket the master, the
        state laid out flat (:meth:`~fastreduce.modes.zero_pieces.ShardOptimizer.pack`) and its
        pieces' scalars."""
        opt, inner = self.opt, self.opt.inner
        for s, shard in enumerate(opt.shards):
            flats, table = inner.pack(s)
            keys = inner.keys_of(s)  # (its copy's too: the same param group)
            sends = [shard.master] + [flats[k] for k in keys] + [table]
            got = {k: torch.empty_like(self.masters[s]) for k in keys}
            recvs = [self.masters[s]] + [got[k] for k in keys] + \
                [torch.empty(len(self.inner.pieces[s]), table.shape[1], dtype=table.dtype)]
            for a, b in zip(sends, recvs):
                complete((opt.comm.send_recv({self.next: a.contiguous()}, {self.k: b}), None))
            self.inner.unpack(s, got, recvs[-1])


def exchange(opt: Any) -> None:
    """My chunk of the averaged gradients to the holders of its copies, the chunks of the
    shards I hold copies of into those copies' gradients (one exchange per dtype)."""
    first = opt.mirrors[0]
    for d in first.recv:
        grads = first._grads[d]
        send = grads[0] if len(grads) == 1 else torch.cat(grads, out=first.send[d])
        complete((opt.comm.send_recv({m.next: send for m in opt.mirrors}, {m.k: m.recv[d] for m in opt.mirrors}),
                  None))


def _copies(opt: Any, d: int) -> list[tuple[str, int]]:
    """What rank ``d`` of ``opt``'s layout holds: ``(which, k)``, its own chunk and its copies'."""
    return [("own", d)] + ([(f"copy{j}", k) for j, k in enumerate(opt.placement.held(d), 1)] if opt.mirrors else [])


def _holdings(opt: Any) -> list[tuple[str, int, int, Any]]:
    """What rank ``opt.rank`` holds, per bucket ``s``: ``(which, s, k, inner)``: its chunk
    ``k`` (``own``) and its copies of other ranks' (``copy1``, ...); ``inner``: the
    :class:`~fastreduce.modes.zero_pieces.ShardOptimizer` that holds it (its master ``inner.masters[s]``)."""
    out = [("own", s, opt.rank, opt.inner) for s in range(len(opt.shards))]
    for m in opt.mirrors:
        out += [(f"copy{m.j}", s, m.k, m.inner) for s in range(len(opt.shards))]
    return out


@torch.no_grad()
def held(opt: Any) -> dict[str, Any]:
    """What this rank holds of the job's ZeRO state, as copies that outlive ``opt`` and its
    group: per chunk it holds (its own, and with ``redundant=`` its copies of others'), per
    parameter piece (torch.optim's index, the range of its elements in that chunk) its
    master weights and optimizer state, every param group's keys (zeros where it has no
    such key, and no scalars where it has no state yet);
    whether the parameters are stale (:attr:`~fastreduce.ZeroOptimizer.params_stale`); the
    hyperparameters."""
    chunks: dict[str, Any] = {}
    for _, s, k, inner in _holdings(opt):
        master = inner.masters[s]
        pieces = []
        for j, p in enumerate(inner.pieces[s]):
            st = {} if p.index in opt.template else inner.state_of(s, j)
            tensors = {key: st[key].clone() if key in st else master.new_zeros(p.n) for key in inner.keys}
            tensors[MASTER_KEY] = master[p.at:p.at + p.n].clone()
            scalars = {key: v.clone() if torch.is_tensor(v) else v for key, v in st.items() if key not in inner.keys}
            pieces.append((p.index, p.start, p.n, tensors, scalars if st else None))
        chunks[f"{s}/{k}"] = {"dtype": master.dtype, "keys": sorted([*inner.keys, MASTER_KEY]), "pieces": pieces}
    return {"world": opt.world_size, "buckets": len(opt.shards), "copies": len(opt.mirrors), "chunks": chunks,
            "stale": opt.params_stale,
            "param_groups": [{k: v for k, v in pg.items() if k != "params"} for pg in opt.param_groups]}


def _moves(opt: Any, d: int, pieces: dict[int, list[tuple[int, int, str]]]) -> list[tuple[Any, ...]]:
    """What rank ``d`` of ``opt``'s layout holds, out of a source's ``pieces`` (per parameter,
    its held ``(offset, length, chunk)``): ``(which, s, at, index, offset, n, chunk)``: ``n``
    elements of parameter ``index`` from ``offset``, held in ``chunk``, to ``at`` in ``d``'s
    chunk of bucket ``s`` (``which``: its own, or one of its copies)."""
    out = []
    for which, k in _copies(opt, d):
        for s in range(len(opt.shards)):
            for p in opt.pieces_of(s, k):
                for off, n, chunk in pieces.get(p.index, ()):
                    x, y = max(p.start, off), min(p.start + p.n, off + n)
                    if x < y:
                        out.append((which, s, p.at + x - p.start, p.index, x, y - x, chunk))
    return out


@torch.no_grad()
def reshard(opt: Any, mine: dict[str, Any] | None) -> None:
    """The members' :func:`held` pieces (``None`` on a joiner) into ``opt`` (built over the
    new default group, any world size): each rank receives only what it holds in the new
    layout (its shard and, with ``redundant=``, its copies of others'), point to
    point from one holder of each piece; nothing is gathered whole. Where some member's
    parameters were stale, the parameters are then all-gathered from the masters.
    Collective. :class:`ShardsLost` on every rank alike where some piece has no holder.
    Pieces laid out in different epochs (``mine["layout"]``: a member lost while the others
    took their shards in a new epoch, after some had taken theirs) hold the same step (no
    step commits in an epoch that a member failed to enter): :func:`_chosen` takes each range
    once, the newest layout's first."""
    world, rank = dist.get_world_size(), dist.get_rank()
    head = None if mine is None else {
        **{k: mine[k] for k in ("world", "buckets", "stale", "param_groups")}, "layout": mine.get("layout"),
        "copies": mine.get("copies", 1),  # (a job checkpoint saved before redundant=k: one copy)
        "chunks": {c: {"dtype": h["dtype"], "keys": h["keys"],
                       "pieces": [(i, o, n, sc) for i, o, n, _, sc in h["pieces"]]} for c, h in mine["chunks"].items()}}
    heads = all_gather_object_watched(head)  # (watched: a member lost as the others take their shards)
    holders = [h for h in heads if h is not None]
    if not holders:
        raise ShardsLost("no member holds any ZeRO shard")
    chunks, pieces = _chosen(opt, heads)
    keys = chunks[min(chunks)]["keys"]
    if any(h["keys"] != keys for h in chunks.values()):
        raise RuntimeError(f"fastreduce: the ZeRO shards hold different optimizer state keys "
                           f"({sorted({tuple(h['keys']) for h in chunks.values()})}): a bug, please report it")
    scalars = {i: sc for h in chunks.values() for i, _, _, sc in h["pieces"]}  # per parameter; None: no state yet
    first = holders[0]
    opt.load_hyperparameters(first["param_groups"])  # (which state keys each group keeps follows them)
    targets = {}  # (which, s, index) -> (piece, its master's range, its state: filled in place)
    for which, s, _, inner in _holdings(opt):
        for p, v in zip(inner.pieces[s], inner.views[s]):
            st = {k: torch.zeros_like(v) for k in inner.keys_of(s)}  # (the moves carry every group's keys)
            st.update({k: inner.scalar(k, float(x)) for k, x in (scalars.get(p.index) or {}).items()})
            inner.state[v] = st
            targets[(which, s, p.index)] = (p, v, st)
    mine_at: dict[tuple[str, int], list[tuple[int, int, dict[str, torch.Tensor]]]] = {}
    for c, h in ({} if mine is None else mine["chunks"]).items():
        for i, o, n, t, _ in h["pieces"]:
            mine_at.setdefault((_named(head["layout"], c), i), []).append((o, n, t))

    def held_range(chunk: str, index: int, x: int, n: int) -> dict[str, torch.Tensor]:
        o, _, t = next(held for held in mine_at[(chunk, index)] if held[0] <= x < held[0] + held[1])
        return {k: v[x - o:x - o + n] for k, v in t.items()}

    # One message per peer and dtype: each move's keys in order, the moves in _moves' order.
    sends: dict[torch.dtype, dict[int, torch.Tensor]] = {}
    recvs: dict[torch.dtype, dict[int, torch.Tensor]] = {}
    arriving = {peer: _by_dtype(_moves(opt, rank, pieces[peer]), chunks) for peer in range(world)}  # what peer sends me
    for peer in range(world):
        out = _moves(opt, peer, pieces[rank])  # what I send peer
        parts: dict[torch.dtype, list[torch.Tensor]] = {}
        for _, _, _, i, x, n, chunk in out:
            got = held_range(chunk, i, x, n)
            parts.setdefault(chunks[chunk]["dtype"], []).extend(got[k] for k in keys)
        for dtype, ps in parts.items():
            flat = torch.cat([p.reshape(-1).to(opt.device) for p in ps])
            (recvs if peer == rank else sends).setdefault(dtype, {})[peer] = flat
        if peer != rank:
            for dtype, moves in arriving[peer].items():
                recvs.setdefault(dtype, {})[peer] = torch.empty(sum(m[5] for m in moves) * len(keys), dtype=dtype,
                                                                device=opt.device)
    for dtype in sorted(set(sends) | set(recvs), key=str):  # the same order on every rank
        theirs = {p: b for p, b in recvs.get(dtype, {}).items() if p != rank}
        if sends.get(dtype) or theirs:
            complete((opt.comm.send_recv(sends.get(dtype, {}), theirs), None))
    for peer in range(world):
        for dtype, moves in arriving[peer].items():
            buf, at_ = recvs[dtype][peer], 0
            for which, s, at, i, _, n, _ in moves:
                p, v, st = targets[(which, s, i)]
                for k in keys:
                    if k == MASTER_KEY or k in st:
                        (v if k == MASTER_KEY else st[k])[at - p.at:at - p.at + n].copy_(buf[at_:at_ + n])
                    at_ += n
    unstepped = {i for i, sc in scalars.items() if sc is None}
    for inner in {id(h[3]): h[3] for h in _holdings(opt)}.values():  # what had no state yet has none
        inner.drop(unstepped)
    opt.clear_template()
    if any(h["stale"] for h in holders):  # the parameters from the masters (full-precision ones hold them already)
        opt.gather_params()
        opt.wait_params()


def _named(layout: Any, chunk: str) -> str:
    """A chunk's name among the members' pieces: ``chunk`` (``"s/k"``) of the epoch it was laid out in."""
    return f"{layout}:{chunk}"


def _chosen(opt: Any, heads: list[Any]) -> tuple[dict[str, Any], dict[int, dict[int, list[tuple[int, int, str]]]]]:
    """Which holder sends each range of each parameter, out of the members' ``heads`` (their
    pieces' descriptions, ``None`` for a joiner's): per chunk of the newest layout one holder
    (the first rank holding it), then the ranges of older layouts' chunks that those leave
    uncovered. Returns the chunks chosen (by :func:`_named` name) and per rank, per parameter,
    the ``(offset, length, chunk)`` it sends. :class:`ShardsLost` where a range ``opt``'s
    layout holds has no holder."""
    layouts = sorted({h["layout"] for h in heads if h is not None}, key=lambda t: -1 if t is None else t, reverse=True)
    chunks: dict[str, Any] = {}
    pieces: dict[int, dict[int, list[tuple[int, int, str]]]] = {r: {} for r in range(len(heads))}
    covered: dict[int, list[tuple[int, int]]] = {}  # per parameter, the ranges chosen
    for layout in layouts:
        source: dict[str, int] = {}
        for r, h in enumerate(heads):
            for c in (h["chunks"] if h is not None and h["layout"] == layout else ()):
                source.setdefault(c, r)
        for c, r in sorted(source.items()):
            name = _named(layout, c)
            chunks[name] = heads[r]["chunks"][c]
            for i, o, n, _ in chunks[name]["pieces"]:
                for x, m in _uncovered(covered.setdefault(i, []), o, n):
                    pieces[r].setdefault(i, []).append((x, m, name))
                    covered[i].append((x, m))
    needed = {(p.index, p.start, p.n) for s in range(len(opt.shards)) for k in range(opt.world_size)
              for p in opt.pieces_of(s, k)}
    if any(_uncovered(covered.get(i, []), o, n) for i, o, n in needed):
        first = next(h for h in heads if h is not None)
        if len(layouts) > 1:
            raise ShardsLost(f"ZeRO shards were lost with every rank that held them: members were lost as the others "
                             f"took their shards in a new epoch, and some range is in none of the shards the members "
                             f"hold, laid out in epochs {', '.join(map(str, sorted(layouts, key=str)))}")
        missing = sorted({k for s in range(first["buckets"]) for k in range(first["world"])
                          if _named(layouts[0], f"{s}/{k}") not in chunks})
        raise ShardsLost(f"the ZeRO shards of old rank(s) {missing} were lost with every rank that held them (the "
                         f"rank and the {first.get('copies', 1)} holding copies of its shard, lost at once)")
    return chunks, pieces


def _uncovered(ranges: list[tuple[int, int]], o: int, n: int) -> list[tuple[int, int]]:
    """The parts of ``[o, o + n)`` that none of ``ranges`` (``(offset, length)``) covers."""
    out, at = [], o
    for x, m in sorted(ranges):
        if x > at:
            out.append((at, min(x, o + n) - at))
        at = max(at, x + m)
        if at >= o + n:
            break
    if at < o + n:
        out.append((at, o + n - at))
    return [(x, m) for x, m in out if m > 0]


def _by_dtype(moves: list[tuple[Any, ...]], chunks: dict[str, Any]) -> dict[torch.dtype, list[tuple[Any, ...]]]:
    out: dict[torch.dtype, list[tuple[Any, ...]]] = {}
    for m in moves:
        out.setdefault(chunks[m[6]]["dtype"], []).append(m)
    return out
