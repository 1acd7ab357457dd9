"""ZeRO's checkpoints: a :class:`~fastreduce.ZeroOptimizer`'s state in torch.optim's own
format (:meth:`ZeroCheckpointing.state_dict`, whole on every rank) and as ranges for
``torch.distributed.checkpoint`` (:meth:`ZeroCheckpointing.sharded_state_dict`, each
rank writing only what it owns), both loadable onto any world size.

A ZeRO shard is a contiguous range of a flat buffer, so the piece of a parameter's
state that a rank holds is a contiguous range of that parameter's elements, of any
length, possibly empty. Neither of DCP's own sharded types fits: a ``DTensor`` is cut
evenly, and a ``ShardedTensor`` (deprecated) is dropped from a load plan on ranks that
hold none of it. :class:`RangeShard` is the small missing piece: a 1-D tensor of the
parameter's full length that carries only this rank's range and answers DCP's
checkpoint protocol (``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``). Saving writes each range once, from its owner; loading on
another world size reads, into each rank's range, whatever saved ranges overlap it.
"""

from __future__ import annotations

from typing import Any

import torch

import torch.distributed as dist

from ..buffer import slot_view
from ..comm import all_gather_flat
from ..faults import all_reduce_watched
from ..torch_internals import disabled_torch_function, make_wrapper_subclass
from .zero_pieces import Piece, chunk_pieces

__all__ = ["RangeShard", "ZeroCheckpointing"]

MASTER_KEY = "fastreduce_master"  # fp32 master weights of low-precision params, in state dicts


class ZeroCheckpointing:
    """The state-dict half of :class:`~fastreduce.ZeroOptimizer` (a mixin).

    It reads what the optimizer built: ``layout``, ``buckets`` and ``shards`` (one
    :class:`~fastreduce.modes.zero_shard.Shard` per bucket), ``inner`` (the
    :class:`~fastreduce.modes.zero_pieces.ShardOptimizer` of the shard's pieces),
    ``param_groups``, ``world_size``, ``rank``, ``group``, ``device``; and calls its
    ``_wait_gathers()`` and ``_sync_hyperparameters()``; after a load, each of ``mirrors``' ``pull()``
    (``redundant=True``: rank r + 1's copy of the shard).

    Each parameter has a state of its own (torch.optim's), on the ranks that hold a piece
    of it, or none while it has never been stepped (as torch.optim has none for it).

    ``_template``: the torch.optim indices of parameters whose state was made by
    :meth:`_materialize_state` for a checkpoint, before their first step: it says "no step
    yet" (saved as ``fresh``), and the next :meth:`step` drops it, so a save or load before
    a parameter's first step changes nothing for it (an AdamW stepped once at lr=0 counts
    a step: its first real update would be 0.74x as large; Rprop's step sizes would start at 0).
    """

    _template: frozenset[int] = frozenset()

    def _index(self) -> tuple[dict[int, int], list[int]]:
        """torch.optim's parameter index -> layout slot; per group, its indices."""
        slot_of = {id(p): i for i, p in enumerate(self.layout.params)}
        index: dict[int, int] = {}
        per_group, k = [], 0
        for pg in self.param_groups:
            ids = []
            for p in pg["params"]:
                if id(p) in slot_of:
                    index[k] = slot_of[id(p)]
                ids.append(k)
                k += 1
            per_group.append(ids)
        return index, per_group

    def pieces_of(self, s: int, k: int) -> list[Piece]:
        """Chunk ``k`` of bucket ``s``: the pieces of its parameters it holds."""
        return chunk_pieces(self.layout, self.buckets[s].slots, self._optim_index(), s, k, self.world_size)

    def _optim_index(self) -> dict[int, int]:
        """Layout slot -> torch.optim's parameter index."""
        index, _ = self._index()
        return {i: k for k, i in index.items()}

    def _agreed_scalars(self) -> dict[int, dict[str, Any]]:
        """Per layout slot of a parameter with state on some rank (templates apart): its
        scalars (``step``, ...), the same on every rank (one MAX all-reduce of a row per
        parameter: the ranks holding a piece of it agree, the others learn it)."""
        inner = self.inner
        table = torch.full((len(self.layout), 1 + len(inner.scalar_keys)), float("-inf"), dtype=torch.float32)
        for s in range(len(self.shards)):
            rows = inner.table(s)
            for j, p in enumerate(inner.pieces[s]):
                if rows[j, 0] and p.index not in self._template:
                    table[p.slot] = rows[j].nan_to_num(nan=float("-inf"))
        if self.world_size > 1:
            table = table.to(self.device)
            all_reduce_watched(table, dist.ReduceOp.MAX, self.group)
            table = table.cpu()
        return {i: {k: inner.scalar(k, float(row[c])) for c, k in enumerate(inner.scalar_keys, 1)
                    if row[c] > float("-inf")}
                for i, row in enumerate(table) if row[0] > 0}

    def wire_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's error-feedback residual of a quantized wire (a copy; empty without
        one). Per rank, so not in :meth:`state_dict`: ``fastreduce.Checkpointer`` saves it
        with the rank's own state and restores it on the same world size."""
        return {} if self.quantized is None else self.quantized.state_dict()

    def load_wire_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`wire_state_dict` (same world size and parameters); ``{}`` resets it."""
        if self.quantized is not None:
            self.quantized.load_state_dict(state)
        elif state:
            raise ValueError("this state holds a quantized wire's error-feedback residual, but this "
                             "ZeroOptimizer sends no quantized wire: build it with the same wire_dtype "
                             "and error_feedback=True")

    @torch.no_grad()
    def state_dict(self) -> dict[str, Any]:
        """torch.optim's own per-parameter format, whole on every rank (collective).

        Loads into a plain optimizer of the same class over the same parameters; for
        bf16/fp16 parameters (or ``gather_dtype``) each state also holds the fp32 master
        (``fastreduce_master``). A parameter never stepped has no state, as in torch.optim,
        so no master either (a load takes its value for one). For big models prefer
        :meth:`sharded_state_dict`, which gathers nothing.
        """
        self._wait_gathers()
        index, per_group = self._index()
        by_slot = {i: k for k, i in index.items()}
        scalars = self._agreed_scalars()
        state: dict[int, dict[str, Any]] = {}
        for s, shard in enumerate(self.shards):
            seg = self.layout.segments[s]
            flats, _ = self.inner.pack(s) if scalars else ({}, None)  # no state anywhere: none gathered
            if shard.low and scalars:
                flats[MASTER_KEY] = shard.master
            fulls = {key: self._all_gather_state(v, seg.numel) for key, v in flats.items()}
            for i in self.buckets[s].slots:
                if i in scalars:  # a parameter never stepped has none, its master neither
                    state[by_slot[i]] = {**scalars[i], **{key: slot_view(full, self.layout.slots[i]).clone()
                                                          for key, full in fulls.items()}}
        groups = [{**{k: v for k, v in pg.items() if k != "params"}, "params": ids}
                  for pg, ids in zip(self.param_groups, per_group)]
        return {"state": state, "param_groups": groups}

    def _all_gather_state(self, chunk: torch.Tensor, numel: int) -> torch.Tensor:
        full = torch.empty(numel, dtype=chunk.dtype, device=chunk.device)
        if self.world_size == 1:
            full.copy_(chunk)
        else:
            all_gather_flat(full, chunk.contiguous(), self.group)
        return full

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch.optim's per-parameter format: from :meth:`state_dict` at any world
        size, or from a plain optimizer of the same class. Checked first: a mismatch
        raises ``ValueError`` and changes nothing. Load the model's parameters first: each
        fp32 master (bf16/fp16 parameters, ``gather_dtype``) is its parameter's value, or the
        saved ``fastreduce_master`` where that still rounds to the parameter (a plain
        optimizer that loaded it keeps it as it was while it steps the parameters)."""
        self._wait_gathers()
        index, per_group = self._index()
        self._check_loadable(state_dict, index, per_group)
        saved = state_dict["state"]
        inner = self.inner
        for s, shard in enumerate(self.shards):
            if shard.low:
                self._load_master(s, saved)
            for j, (p, v) in enumerate(zip(inner.pieces[s], inner.views[s])):
                entry = saved.get(p.index, {})
                st: dict[str, Any] = {}
                for key, value in entry.items():
                    if key == MASTER_KEY:
                        continue
                    elif torch.is_tensor(value) and value.dim() > 0:
                        st[key] = value.reshape(-1)[p.start:p.start + p.n].to(v.device, v.dtype, copy=True)
                    else:
                        st[key] = inner.scalar(key, float(value)) if key in inner.scalar_keys else value
                if st:
                    inner.state[v] = st
                else:
                    inner.state.pop(v, None)
        self._template = frozenset()
        self.load_hyperparameters(state_dict["param_groups"])
        for m in self.mirrors:  # the copies of other ranks' shards, as loaded
            m.pull()

    def _load_master(self, s: int, saved: dict[int, dict[str, Any]]) -> None:
        """Chunk ``s``'s fp32 master from the parameters as they are, and from a saved master
        where it still rounds to them: a plain optimizer keeps the masters as it loaded
        them, so after its steps they are stale wherever it moved the parameters."""
        shard = self.shards[s]
        c = shard.params.numel() // self.world_size
        now = shard.params[self.rank * c:(self.rank + 1) * c]
        shown = shard.params.dtype if shard.send is None else shard.send.dtype  # what the parameters hold it as
        shard.master.copy_(now)
        for p in self.inner.pieces[s]:
            value = saved.get(p.index, {}).get(MASTER_KEY)
            if value is not None:
                kept = value.reshape(-1)[p.start:p.start + p.n].to(shard.master.device, shard.master.dtype)
                master = shard.master[p.at:p.at + p.n]
                master.copy_(torch.where(kept.to(shown).to(now.dtype) == now[p.at:p.at + p.n], kept, master))

    def load_hyperparameters(self, groups: list[dict[str, Any]]) -> None:
        """The loaded param groups' hyperparameters (not their parameters) into
        :attr:`param_groups` and the shard's optimizers, whose state keys follow them."""
        for pg, src in zip(self.param_groups, groups):
            pg.update({k: v for k, v in src.items() if k != "params"})
        self._sync_hyperparameters()
        for inner in [self.inner, *(m.inner for m in self.mirrors)]:
            inner.probe_keys()

    def _check_loadable(self, sd: dict[str, Any], index: dict[int, int], per_group: list[list[int]]) -> None:
        if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
            raise ValueError("not an optimizer state dict: expected the keys 'state' and 'param_groups'")
        groups = sd["param_groups"]
        if len(groups) != len(per_group) or any(len(g["params"]) != len(ids) for g, ids in zip(groups, per_group)):
            raise ValueError(f"the state dict has param groups of sizes {[len(g['params']) for g in groups]}, "
                             f"this optimizer {[len(ids) for ids in per_group]}: it is from another model")
        for k, st in sd["state"].items():
            if k not in index:
                continue
            p = self.layout.params[index[k]]
            for key, v in st.items():
                if torch.is_tensor(v) and v.dim() > 0 and v.shape != p.shape:
                    raise ValueError(f"state {key!r} of parameter {k} has shape {tuple(v.shape)}, the "
                                     f"parameter {self.layout.names[index[k]]!r} {tuple(p.shape)}: the "
                                     "checkpoint is from another model")

    @torch.no_grad()
    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's ranges of the optimizer state, for ``torch.distributed.checkpoint``.

        Per parameter (torch.optim's index) and state key, a :class:`RangeShard` over the
        parameter's elements (flattened in memory order) holding a view of this rank's range
        of the state, so ``dcp.save`` writes each range once, from its owner, and
        ``dcp.load`` fills it in place on any world size; scalars (``step``) and the
        hyperparameters are saved once. Collective. A parameter not stepped yet first gets
        a state by one step at lr=0 (as ``torch.distributed.checkpoint.state_dict`` does),
        so that a template exists to load into; ``fresh`` then lists those parameters, and
        the next :meth:`step` starts them from no state, as a new optimizer would::

            sd = opt.sharded_state_dict()
            torch.distributed.checkpoint.load(sd, checkpoint_id=path)
            opt.load_sharded_state_dict(sd)
        """
        self._wait_gathers()
        self._materialize_state()
        fresh = self._template
        self._template = frozenset()  # (for the scalars' agreement: every parameter has a state now)
        try:
            scalars = self._agreed_scalars()
        finally:
            self._template = fresh
        fresh = self._agreed_fresh()
        inner, by_slot = self.inner, self._optim_index()
        state: dict[str, dict[str, Any]] = {}
        for s, shard in enumerate(self.shards):
            held = {p.slot: j for j, p in enumerate(inner.pieces[s])}
            for i in self.buckets[s].slots:
                slot = self.layout.slots[i]
                j = held.get(i)
                p = None if j is None else inner.pieces[s][j]
                st = {} if j is None else inner.state_of(s, j)
                entry: dict[str, Any] = {k: v.clone() if torch.is_tensor(v) else v for k, v in scalars.get(i, {}).items()}
                ranges = {key: st[key] if p is not None else shard.master.new_empty(0) for key in inner.keys_of(s)}
                if shard.low:
                    ranges[MASTER_KEY] = shard.master[p.at:p.at + p.n] if p is not None else shard.master.new_empty(0)
                for key, v in ranges.items():
                    if slot.numel:  # (of a parameter of 0 elements no rank holds a range, nor writes one)
                        entry[key] = RangeShard(v, 0 if p is None else p.start, slot.numel)
                state[str(by_slot[i])] = entry
        groups = [{k: v for k, v in pg.items() if k != "params"} for pg in self.param_groups]
        return {"state": state, "param_groups": groups, "fresh": fresh}

    def _agreed_fresh(self) -> list[int]:
        """The torch.optim indices of :attr:`_template`, over every rank."""
        flags = torch.zeros(len(self.layout), dtype=torch.float32, device=self.device)
        index, _ = self._index()
        for k in self._template:
            flags[index[k]] = 1
        if self.world_size > 1:
            all_reduce_watched(flags, dist.ReduceOp.MAX, self.group)
        by_slot = self._optim_index()
        return sorted(by_slot[i] for i in flags.nonzero().flatten().tolist())

    @torch.no_grad()
    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Finish loading what ``dcp.load`` put into :meth:`sharded_state_dict`'s dict:
        the state ranges were filled in place; this sets the scalars and hyperparameters."""
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if groups is None or "state" not in state_dict or len(groups) != len(self.param_groups):
            raise ValueError("not a ZeroOptimizer.sharded_state_dict() of this optimizer (its "
                             "param groups differ); build the dict with sharded_state_dict() and "
                             "fill it with torch.distributed.checkpoint.load")
        inner = self.inner
        for s in range(len(self.shards)):
            for j, p in enumerate(inner.pieces[s]):
                st = inner.state_of(s, j)
                for key, v in state_dict["state"][str(p.index)].items():
                    if key in st and not isinstance(v, RangeShard):
                        if torch.is_tensor(v) and torch.is_tensor(st[key]):
                            st[key].copy_(v)
                        else:
                            st[key] = v
        self.load_hyperparameters(groups)
        fresh = state_dict.get("fresh", False)  # a bool: saved before fastreduce kept it per parameter
        self._template = frozenset(self._index()[0]) if fresh is True else frozenset(fresh or ())
        for m in self.mirrors:
            m.pull()

    def _materialize_state(self) -> None:
        """Give every parameter without state one: a step at lr=0 of those alone, on zero
        gradients; they join :attr:`_template`."""
        self._template = self._template | self.inner.materialize()

    @property
    def template(self) -> frozenset[int]:
        """The torch.optim indices whose state is still the template's (see the class doc)."""
        return self._template

    def clear_template(self) -> None:
        """Forget the template states, which the caller dropped itself (a reshard keeps none)."""
        self._template = frozenset()

    def _drop_template(self) -> None:
        """Before a step: template states go, so those parameters start from none."""
        if self._template:
            self.inner.drop(self._template)
            for m in self.mirrors:  # they pulled the templates too
                m.inner.drop(self._template)
            self._template = frozenset()


class RangeShard(torch.Tensor):
    """``numel`` elements, of which this rank holds ``local`` at ``offset``.

    Only a checkpoint view: DCP reads and fills ``local`` in place; any other
    operation on it raises.
    """

    local: torch.Tensor
    offset: int

    @staticmethod
    def __new__(cls, local: torch.Tensor, offset: int, numel: int) -> RangeShard:
        if local.dim() != 1 or not 0 <= offset <= offset + local.numel() <= numel:
            raise ValueError(f"a range of {local.numel()} elements at {offset} does not fit in {numel}")
        t = make_wrapper_subclass(cls, (numel,), local.dtype, local.device)
        t.local, t.offset = local, offset
        return t

    __torch_function__ = disabled_torch_function

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise NotImplementedError(f"{func} on a fastreduce RangeShard: it is a checkpoint view of one "
                                  "rank's range; read .local instead")

    def __repr__(self) -> str:  # type: ignore[override]
        return f"RangeShard([{self.offset}, {self.offset + self.local.numel()}) of {self.shape[0]}, {self.dtype})"

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        if self.local.numel() == 0:
            return []
        offsets = torch.Size([self.offset])
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=offsets, sizes=self.local.shape),
                              properties=TensorProperties.create_from_tensor(self.local),
                              size=self.shape))]

    def __create_chunk_list__(self) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        if self.local.numel() == 0:
            return []
        return [ChunkStorageMetadata(offsets=torch.Size([self.offset]), sizes=self.local.shape)]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        return self.local
