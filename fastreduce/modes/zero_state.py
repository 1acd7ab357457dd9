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

from ..buffer import _view
from ..comm import all_gather_flat

__all__ = ["RangeShard", "ZeroCheckpointing"]

_MASTER = "fastreduce_master"  # fp32 master weights of low-precision params, in state dicts
_SCALARS = frozenset({"step", "mu_product", "eta", "mu"})  # per-parameter scalars of torch optimizers


class ZeroCheckpointing:
    """The state-dict half of :class:`~fastreduce.ZeroOptimizer` (a mixin).

    It reads what the optimizer built: ``layout``, ``buckets`` and ``shards`` (one
    :class:`~fastreduce.modes.zero_shard.Shard` per bucket), ``inner`` (the shard's torch
    optimizer), ``param_groups``, ``world_size``, ``rank``, ``group``, ``device``; and calls
    its ``_wait_gathers()`` and ``_sync_hyperparameters()``; after a load, ``mirror.pull()``
    (``redundant=True``: rank r + 1's copy of the shard).

    ``_template``: the shard's optimizer state was made by :meth:`_materialize_state` for
    a checkpoint, before any step: it says "no step yet" (saved as ``fresh``), and the
    next :meth:`step` drops it, so a save or load before the first step changes nothing
    (an AdamW stepped once at lr=0 counts a step: its first real update would be 0.74x
    as large; Rprop's step sizes would start at 0).
    """

    _template = False

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

    def _chunk_slots(self, s: int, k: int) -> list[tuple[int, int, int, int, int]]:
        """Bucket ``s``'s parameters against chunk ``k`` of it: per parameter, ``(index,
        start, end, at, numel)``: its elements ``[start, end)`` (maybe none) lie at ``at`` in
        the chunk; ``index`` is torch.optim's."""
        c = self.layout.segments[s].numel // self.world_size
        by_slot, out = self._optim_index(), []
        for i in self.buckets[s].slots:
            slot = self.layout.slots[i]
            lo, hi = slot.offset, slot.offset + slot.numel
            a = min(max(lo, k * c), hi)
            b = max(min(hi, (k + 1) * c), a)
            out.append((by_slot[i], a - lo, b - lo, a - k * c, slot.numel))
        return out

    def _optim_index(self) -> dict[int, int]:
        """Layout slot -> torch.optim's parameter index."""
        index, _ = self._index()
        return {i: k for k, i in index.items()}

    def _chunk_states(self) -> list[dict[str, Any]]:
        return [self.inner.state.get(s.master, {}) for s in self.shards]

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
        bf16/fp16 parameters each state also holds the fp32 master (``fastreduce_master``).
        For big models prefer :meth:`sharded_state_dict`, which gathers nothing.
        """
        self._wait_gathers()
        index, per_group = self._index()
        slots_of_seg = [b.slots for b in self.buckets]
        layout = self.layout
        state: dict[int, dict[str, Any]] = {}
        by_slot = {i: k for k, i in index.items()}
        chunk_states = [{} for _ in self.shards] if self._template else self._chunk_states()
        for s, (shard, chunk_state) in enumerate(zip(self.shards, chunk_states)):
            seg = layout.segments[s]
            fulls: dict[str, torch.Tensor] = {}
            items = {k: v for k, v in chunk_state.items()}
            if shard.low:
                items[_MASTER] = shard.master
            for key, v in items.items():
                if key not in _SCALARS and torch.is_tensor(v) and v.shape == shard.master.shape:
                    fulls[key] = self._all_gather_state(v, seg.numel)
            for i in slots_of_seg[s]:
                slot = layout.slots[i]
                st: dict[str, Any] = {}
                for key, v in items.items():
                    if key in fulls:
                        st[key] = _view(fulls[key], slot).clone()
                    else:
                        st[key] = v.clone() if torch.is_tensor(v) else v
                if chunk_state or shard.low:
                    state[by_slot[i]] = st
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
        raises ``ValueError`` and changes nothing."""
        self._wait_gathers()
        index, per_group = self._index()
        self._check_loadable(state_dict, index, per_group)
        by_slot = {i: k for k, i in index.items()}
        chunks, masters = {}, {}
        for s, idx in enumerate(b.slots for b in self.buckets):
            entries = [(self.layout.slots[i], state_dict["state"].get(by_slot[i], {})) for i in idx]
            chunk_state, masters[s] = self._chunk_of(s, entries)
            if chunk_state:
                chunks[s] = chunk_state
        # The shard's optimizer numbers its tensors group by group, in shard order.
        order = [s for g in range(len(self.param_groups)) for s, sh in enumerate(self.shards) if sh.group == g]
        position = {s: k for k, s in enumerate(order)}
        groups, k = [], 0
        for g, src in enumerate(state_dict["param_groups"]):
            n = sum(sh.group == g for sh in self.shards)
            groups.append({**{a: b for a, b in src.items() if a != "params"}, "params": list(range(k, k + n))})
            k += n
        self.inner.load_state_dict({"state": {position[s]: st for s, st in chunks.items()},
                                    "param_groups": groups})
        self._template = False
        for pg, src in zip(self.param_groups, state_dict["param_groups"]):
            pg.update({a: b for a, b in src.items() if a != "params"})
        W, r = self.world_size, self.rank
        for s, shard in enumerate(self.shards):  # masters: loaded, else from the params
            if shard.low:
                c = shard.params.numel() // W
                m = masters[s]
                shard.master.copy_(m if m is not None else shard.params[r * c:(r + 1) * c])
        if self.mirror is not None:  # rank r + 1's copy of this shard, as loaded
            self.mirror.pull()

    def _chunk_of(self, s: int, entries: list[tuple[Any, dict[str, Any]]]) -> tuple[dict[str, Any],
                                                                                   torch.Tensor | None]:
        """This rank's chunk of bucket ``s``'s state, from per-parameter ``(slot, state)``
        entries; and its fp32 masters if the entries carry them."""
        seg, W, r = self.layout.segments[s], self.world_size, self.rank
        c = seg.numel // W
        chunk_state: dict[str, Any] = {}
        master = None
        for key in sorted({k for _, st in entries for k in st}):
            shaped = [(slot, st[key]) for slot, st in entries if key in st]
            if key in _SCALARS or not all(torch.is_tensor(v) and v.shape == slot.param.shape for slot, v in shaped):
                if key != _MASTER:  # a scalar (step): the same for every parameter of a bucket
                    v = shaped[0][1]
                    chunk_state[key] = v.clone() if torch.is_tensor(v) else v
                continue
            full = torch.zeros(seg.numel, dtype=shaped[0][1].dtype, device=self.device)
            for slot, v in shaped:
                _view(full, slot).copy_(v)
            if key == _MASTER:
                master = full[r * c:(r + 1) * c].float()
            else:
                chunk_state[key] = full[r * c:(r + 1) * c].clone()
        return chunk_state, master

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
                if key not in _SCALARS and torch.is_tensor(v) and v.shape != p.shape:
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
        hyperparameters are saved once. Collective. A fresh optimizer's state is first
        made by one step at lr=0 (as ``torch.distributed.checkpoint.state_dict`` does),
        so that a template exists to load into; ``fresh`` then says that no step was
        taken, and the next :meth:`step` starts from no state, as a new optimizer would::

            sd = opt.sharded_state_dict()
            torch.distributed.checkpoint.load(sd, checkpoint_id=path)
            opt.load_sharded_state_dict(sd)
        """
        self._wait_gathers()
        self._materialize_state()
        state: dict[str, dict[str, Any]] = {}
        for s, (shard, chunk_state) in enumerate(zip(self.shards, self._chunk_states())):
            items = dict(chunk_state)
            if shard.low:
                items[_MASTER] = shard.master
            for index, start, end, at, numel in self._chunk_slots(s, self.rank):  # my part of each, maybe empty
                entry: dict[str, Any] = {}
                for key, v in items.items():
                    if key in _SCALARS or not torch.is_tensor(v) or v.shape != shard.master.shape:
                        entry[key] = v.clone() if torch.is_tensor(v) else v
                    else:
                        entry[key] = RangeShard(v[at:at + end - start], start, numel)
                state[str(index)] = entry
        groups = [{k: v for k, v in pg.items() if k != "params"} for pg in self.param_groups]
        return {"state": state, "param_groups": groups, "fresh": self._template}

    @torch.no_grad()
    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Finish loading what ``dcp.load`` put into :meth:`sharded_state_dict`'s dict:
        the state ranges were filled in place; this sets the scalars and hyperparameters."""
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if groups is None or "state" not in state_dict or len(groups) != len(self.param_groups):
            raise ValueError("not a ZeroOptimizer.sharded_state_dict() of this optimizer (its "
                             "param groups differ); build the dict with sharded_state_dict() and "
                             "fill it with torch.distributed.checkpoint.load")
        index, _ = self._index()
        by_slot = {i: k for k, i in index.items()}
        for s, chunk_state in enumerate(self._chunk_states()):
            first = state_dict["state"][str(by_slot[self.buckets[s].slots[0]])]
            for key, v in first.items():
                if key in chunk_state and not isinstance(v, RangeShard):
                    if torch.is_tensor(v) and torch.is_tensor(chunk_state[key]):
                        chunk_state[key].copy_(v)
                    else:
                        chunk_state[key] = v
        for pg, src in zip(self.param_groups, groups):
            pg.update({k: v for k, v in src.items() if k != "params"})
        self._sync_hyperparameters()
        self._template = bool(state_dict.get("fresh", False))  # saved before any step: stays so
        if self.mirror is not None:
            self.mirror.pull()

    def _materialize_state(self) -> None:
        """Create the shard's optimizer state where it does not exist yet: one step at
        lr=0 on zero gradients (the gradients are restored); a template (``_template``)."""
        if all(s.master in self.inner.state and self.inner.state[s.master] for s in self.shards):
            return
        grads = [s.master.grad for s in self.shards]
        saved = [g.clone() for g in grads]
        lrs = [g["lr"] for g in self.inner.param_groups]
        try:
            for g in grads:
                g.zero_()
            for g in self.inner.param_groups:
                g["lr"] = 0.0
            self.inner.step()
        finally:
            for g, lr in zip(self.inner.param_groups, lrs):
                g["lr"] = lr
            for g, v in zip(grads, saved):
                g.copy_(v)
        self._template = True

    def _drop_template(self) -> None:
        """Before a step: a template state goes, so the step starts from none."""
        if self._template:
            self.inner.state.clear()
            if self.mirror is not None:  # it pulled the template too
                self.mirror.inner.state.clear()
            self._template = False


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
        t = torch.Tensor._make_wrapper_subclass(cls, (numel,), dtype=local.dtype, device=local.device)
        t.local, t.offset = local, offset
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

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
