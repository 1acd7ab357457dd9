"""Checkpoints through ``torch.distributed.checkpoint`` (DCP): a whole training state in
every mode (:class:`Checkpointer`).

:class:`Checkpointer` saves and restores the model, the optimizer (a torch optimizer, or
the mode's own), the mode's state, the step, each rank's random generators and any
extra ``state_dict()`` objects, so that a job that ``torchrun --max-restarts`` brings
back after a crash goes on exactly as if it had never stopped. One checkpoint is a
folder ``step-00000123/`` of DCP files plus ``fastreduce.json``, the commit marker:
rank 0 writes it (atomically: a rename) once every rank has written its files, and
only a folder that has it is ever loaded; it holds the fingerprint (mode, optimizer,
world size, every parameter's and buffer's name, shape and dtype) that a load checks,
on every rank and before anything is changed.

Inside, as DCP keys::

    model            the model's parameters, where they are the same on every rank (DCP
                     writes a key that several ranks hold once); loaded in place
    optimizer        a torch optimizer's state_dict (same on every rank), or a
                     ZeroOptimizer's sharded_state_dict (each rank writes its ranges;
                     loads onto any world size)
    rank<r>/...      what rank r alone holds: its buffers, random generators, extras, the mode's
                     state (error-feedback residuals; gossip, LocalSGD, DiLoCo: the
                     rank's own parameters, optimizer and mode state)

A tree of per-rank state is stored as its tensors (DCP tensors ``rank<r>/<i>``) and its
skeleton (``rank<r>/tree``, pickled, with each tensor's place marked), so that a load
needs no template of it: the tensors' sizes come from DCP's metadata.

A ZeRO optimizer's state is saved as its ranges (:meth:`~fastreduce.ZeroOptimizer.sharded_state_dict`,
:class:`~fastreduce.modes.zero_state.RangeShard`): each range written once by its owner,
read back on any world size.

The pieces: :mod:`.checkpoint_folders` (the folder, its marker, damage), :mod:`.checkpoint_ranks`
(rank 0 deciding for all), :mod:`.checkpoint_state` (per-rank trees, ZeRO's ranges, random
generators); this module saves and loads them.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import shutil
import time
from collections import OrderedDict
from typing import Any, Callable

import torch
from torch import nn

from .checks import check_int
from .checkpoint_folders import FORMAT, MARKER, complete_steps, first_difference, fresh_folder, inspect_folder
from .checkpoint_folders import step_folder, step_folders
from .checkpoint_ranks import every_rank_says, on_rank0, current_rank, current_world
from .checkpoint_state import pack_tree, capture_rng_state, restore_rng_state, staged_ranges, load_template, unpack_tree
from .checkpoint_state import _TensorAt  # noqa: F401 - pickled as fastreduce.checkpoint._TensorAt: found here
from .modes.contract import commit_style, mode_name, optimizer_role, state_scope
from .modes.functional import functional_state, load_functional_state
from .nested import map_leaves
from .torch_internals import with_metadata_of

__all__ = ["Checkpointer", "CheckpointDamagedError", "CheckpointMismatchError"]

log = logging.getLogger(__name__)


class CheckpointMismatchError(ValueError):
    """A checkpoint does not fit the job loading it (another model, mode, optimizer or
    world size, or their settings); raised on every rank with nothing changed."""


class CheckpointDamagedError(RuntimeError):
    """A committed checkpoint cannot be read (a file missing, truncated or unreadable);
    raised on every rank with the model, optimizer and mode as they were before the
    call. ``path`` is the checkpoint's folder, ``files`` what was found wrong in it."""

    def __init__(self, message: str, path: str = "", files: list[str] | None = None):
        super().__init__(message)
        self.path, self.files = path, list(files or [])


class Checkpointer:
    """Save and resume a whole training state with ``torch.distributed.checkpoint``.

    Args:
        directory: where the checkpoints go, one folder per step (shared by the ranks:
            a local path on one host, a shared file system across hosts).
        model: the module trained (for gossip, the module inside
            :class:`~fastreduce.DecentralizedDataParallel`, or the wrapper itself).
        optimizer: the torch optimizer, a :class:`~fastreduce.ZeroOptimizer`, or
            ``None`` (gossip: its optimizers are the mode's; LocalSGD and DiLoCo:
            default their inner optimizer).
        mode: the mode object, if any: a :class:`~fastreduce.FusedReducer` (fused or
            ``overlap=True``), :class:`~fastreduce.DecentralizedDataParallel`,
            :class:`~fastreduce.LocalSGD` or :class:`~fastreduce.DiLoCo`. ``None`` for
            ``all_reduce_gradients(model)`` (its reducers' error-feedback residuals are
            saved from the model) and for ZeRO.
        keep: complete checkpoints kept; older ones are removed after each save (and, after
            going back to an earlier one, those of later steps).
        extras: ``{name: object}`` with ``state_dict()`` / ``load_state_dict()`` (LR
            schedulers, a ``GradScaler``, a sampler), saved per rank.

    Build it after the model, optimizer and mode, on every rank, then::

        ckpt = fastreduce.checkpoint.Checkpointer("ckpt", model, opt, mode=reducer)
        start = ckpt.load_latest()          # 0 when there is no complete checkpoint
        for step in range(start, steps):
            ...                             # one training step
            if (step + 1) % 100 == 0:
                ckpt.save(step + 1)         # the number of steps done: where to resume

    Under ``torchrun --max-restarts``, launch with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``:
    a restarted Gloo group can otherwise read a dead attempt's addresses (pytorch#135712).

    World size: fused, overlapped, ``all_reduce_gradients`` and ZeRO checkpoints load
    onto any world size (ZeRO re-cuts its shards; ranks that did not exist keep their
    random generators; error-feedback residuals start at zero); gossip, LocalSGD and
    DiLoCo ones only onto the world size they were saved at.
    """

    def __init__(self, directory: str | os.PathLike, model: nn.Module,
                 optimizer: torch.optim.Optimizer | None = None, mode: Any = None, *, keep: int = 2,
                 extras: dict[str, Any] | None = None):
        if commit_style(model):  # a mode that wraps the module (gossip's DecentralizedDataParallel)
            if mode not in (None, model):
                raise ValueError(f"model is a {type(model).__name__}: pass mode=None (or the same object)")
            mode, model = model, model.trained_module
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
        check_int("keep", keep, 1)
        extras = dict(extras or {})
        for name, obj in extras.items():
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise TypeError(f"extras[{name!r}] ({type(obj).__name__}) has no state_dict()/load_state_dict()")
        # What is saved, and how, is what the mode declares (modes/contract.py): its scope and
        # whose optimizer it steps. No mode: all_reduce_gradients (or nothing), or a ZeroOptimizer.
        the_mode = mode if mode is not None else optimizer if commit_style(optimizer) else None
        if mode is not None and (not commit_style(mode) or optimizer_role(mode) == "self"):
            raise TypeError(f"mode must be a FusedReducer, DecentralizedDataParallel, LocalSGD, DiLoCo or None, "
                            f"got {type(mode).__name__}" + (" (a ZeroOptimizer is a mode of its own: pass it as "
                                                             "optimizer with mode=None)" if commit_style(mode) else ""))
        if commit_style(optimizer) and the_mode is not optimizer:
            raise ValueError(f"a {type(optimizer).__name__} is a mode of its own: pass it as optimizer with mode=None")
        kind, scope = ("fused", "replicated") if the_mode is None else (mode_name(the_mode), state_scope(the_mode))
        role = "user" if the_mode is None else optimizer_role(the_mode)
        if role == "own" and optimizer is not None:
            raise ValueError(f"{type(mode).__name__} steps its own per-bucket optimizers (saved with the mode): "
                             "pass optimizer=None")
        if role == "inner":
            if optimizer is None:
                optimizer = mode.optimizer
            elif optimizer is not mode.optimizer:
                raise ValueError(f"optimizer is not the inner optimizer the {type(mode).__name__} was built with")
        if mode is not None and mode.trained_module is not model:
            raise ValueError(f"the {type(mode).__name__} was built over another module than model")
        self.directory = os.fspath(directory)
        self.model, self.optimizer, self.mode, self.kind = model, optimizer, mode, kind
        self.scope, self.role = scope, role
        self.keep, self.extras = keep, extras

    # ------------------------------------------------------------------ public

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints in :attr:`directory`, oldest first."""
        return [s for s, _ in complete_steps(self.directory)]

    def save(self, step: int) -> str:
        """Write the whole training state as checkpoint ``step`` (collective: every rank).

        ``step`` is what :meth:`load_latest` returns for it: the number of steps done.
        Rank 0 commits it (the marker) only after every rank has written, then removes
        checkpoints beyond ``keep`` and folders of saves that never completed. Returns
        the folder."""
        import torch.distributed.checkpoint as dcp

        check_int("step", step, 0)
        t0 = time.perf_counter()
        path = step_folder(self.directory, step)
        on_rank0(lambda: fresh_folder(path))  # what a killed save of this step left, gone
        state = self._state()
        dcp.save(state, checkpoint_id=path)
        marker = self._fingerprint() | {"step": step, "saved_at": time.time()}
        on_rank0(lambda: self._commit(path, marker))
        if current_rank() == 0:
            log.info("fastreduce: checkpoint step %d saved to %s in %.2fs", step, path, time.perf_counter() - t0)
        return path

    def load_latest(self) -> int:
        """Restore everything from the newest complete checkpoint and return its step
        (collective); return 0 and change nothing if there is none.

        A checkpoint that cannot be read (a file missing or truncated: see :meth:`load`)
        is passed over with a warning for the one before it (``keep=2`` keeps one), as a
        job restarted by torchrun needs; if none of them can be read,
        :class:`CheckpointDamagedError` names what is wrong with each, and nothing is
        changed. A checkpoint from another model, mode, optimizer or (gossip, LocalSGD,
        DiLoCo) world size raises :class:`CheckpointMismatchError` on every rank, naming
        the first difference, before anything is changed."""
        steps = on_rank0(lambda: [s for s, _ in complete_steps(self.directory)])
        damaged: list[CheckpointDamagedError] = []
        for step in reversed(steps):
            try:
                return self.load(step)
            except CheckpointDamagedError as err:
                damaged.append(err)
                if current_rank() == 0:
                    log.warning("fastreduce: %s; trying the checkpoint before it", err)
        if damaged:
            raise CheckpointDamagedError(
                f"fastreduce: no checkpoint in {self.directory} can be read: "
                + "; ".join(str(e) for e in damaged) + ". Nothing was loaded; restore the files, or remove "
                "the damaged folders to start from step 0", self.directory,
                [f for e in damaged for f in e.files])
        if current_rank() == 0:
            log.info("fastreduce: no complete checkpoint in %s: starting from step 0", self.directory)
        return 0

    def load(self, step: int) -> int:
        """Restore everything from checkpoint ``step`` and return it (collective).

        The checkpoint's files are checked against its metadata first (each present and
        as long as what is stored in it), then read into staging tensors on every rank,
        and only once every rank has read all of it are the model, optimizer, mode,
        extras and random generators set. A file missing, truncated or unreadable raises
        :class:`CheckpointDamagedError` on every rank, naming it, with nothing changed.
        (Bytes changed in place, at the same length, are not detected: DCP keeps no
        checksums.)"""
        path = step_folder(self.directory, step)
        saved, problems = on_rank0(lambda: inspect_folder(path))
        if problems:
            raise CheckpointDamagedError(f"checkpoint {path} is damaged: {'; '.join(problems)}", path, problems)
        _agree(self._mismatch(saved, path))
        self._load(path, saved)
        if current_rank() == 0:
            log.info("fastreduce: resumed from %s (step %d, saved at %d ranks)", path, saved["step"],
                     saved["world_size"])
        return int(saved["step"])

    # ------------------------------------------------------------------ what is saved

    def _fingerprint(self) -> dict[str, Any]:
        opt = self.optimizer
        name = None if opt is None else type(opt).__name__
        if self.scope == "sharded":
            name = f"ZeroOptimizer({opt.optimizer_class.__name__})"  # type: ignore[union-attr]
        tensors = [["param", n, list(p.shape), str(p.dtype)] for n, p in self.model.named_parameters()]
        tensors += [["buffer", n, list(b.shape), str(b.dtype)] for n, b in self.model.named_buffers()]
        return {"format": FORMAT, "mode": self.kind, "optimizer": name, "world_size": current_world(),
                "tensors": tensors, "extras": sorted(self.extras)}

    def _state(self) -> dict[str, Any]:
        """The DCP state dict to save (collective: the modes drain what is in flight)."""
        state: dict[str, Any] = {}
        mine: dict[str, Any] = {"rng": capture_rng_state(), "extras": {k: o.state_dict() for k, o in self.extras.items()}}
        per_rank = self.scope == "per_rank"
        if not per_rank:  # the parameters once; the buffers (BatchNorm's statistics) are each rank's own
            model = self.model.state_dict()
            own = _buffer_keys(self.model, model)
            state["model"] = OrderedDict((k, v) for k, v in model.items() if k not in own)
            mine["buffers"] = {k: model[k] for k in own}
        if self.scope == "sharded":
            state["optimizer"] = self.optimizer.sharded_state_dict()  # type: ignore[union-attr]
            mine["wire"] = self.optimizer.wire_state_dict()  # type: ignore[union-attr]
        elif self.optimizer is not None:
            if per_rank:
                mine["optimizer"] = self.optimizer.state_dict()
            else:
                state.update(pack_tree(self.optimizer.state_dict(), "optimizer"))
        if per_rank and self.role != "own":  # (a mode that steps its own optimizers saves the model too)
            mine["model"] = self.model.state_dict()
        if self.mode is not None:
            mine["mode"] = self.mode.state_dict()
        elif self.scope == "replicated":  # all_reduce_gradients: its reducers' residuals live on the model
            mine["mode"] = functional_state(self.model)
        state.update(pack_tree(mine, f"rank{current_rank()}"))
        return state

    def _commit(self, path: str, marker: dict[str, Any]) -> None:
        """Rank 0, after every rank wrote: the marker (write, then rename), then pruning."""
        tmp = os.path.join(path, MARKER + ".tmp")
        with open(tmp, "w") as f:
            json.dump(marker, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(path, MARKER))
        complete = complete_steps(self.directory)
        done = {p for _, p in complete}
        # a save after loading an earlier checkpoint (a rollback) ends the timeline the later ones were of
        stale = [p for s, p in complete if s > marker["step"]]
        stale += [p for _, p in [c for c in complete if c[0] <= marker["step"]][:-self.keep]]
        stale += [p for _, p in step_folders(self.directory) if p not in done]
        for p in stale:
            shutil.rmtree(p, ignore_errors=True)

    # ------------------------------------------------------------------ loading

    def _mismatch(self, saved: dict[str, Any], path: str) -> str | None:
        """Why checkpoint ``saved`` cannot be loaded here (``None``: it can)."""
        mine = self._fingerprint()
        why = None
        if saved.get("format") != FORMAT:
            why = f"it is in format {saved.get('format')!r}, this fastreduce reads {FORMAT}"
        elif saved["mode"] != mine["mode"]:
            why = f"it was saved in mode {saved['mode']!r}, this job runs mode {mine['mode']!r}"
        elif saved["tensors"] != mine["tensors"]:
            why = first_difference(saved["tensors"], mine["tensors"])
        elif saved["optimizer"] != mine["optimizer"]:
            why = f"its optimizer is {saved['optimizer']}, this job's is {mine['optimizer']}"
        elif saved["extras"] != mine["extras"]:
            why = f"its extras are {saved['extras']}, this job's are {mine['extras']}"
        elif saved["world_size"] != mine["world_size"] and self.scope == "per_rank":
            why = (f"it holds the per-rank state of {saved['world_size']} ranks (mode {self.kind}: every rank's "
                   f"parameters differ) and this job has {mine['world_size']}; resume it on "
                   f"{saved['world_size']} ranks")
        if why is None:
            return None
        return (f"checkpoint {path} does not fit this job: {why}. Nothing was loaded; resume with the "
                "model, mode and optimizer it was saved from, or point the Checkpointer at another directory")

    def _load(self, path: str, saved: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp

        rank = current_rank()
        src = rank if rank < saved["world_size"] else 0  # a rank that did not exist: rank 0's extras
        metadata = dcp.FileSystemReader(path).read_metadata()
        per_rank = self.scope == "per_rank"
        # Everything is read into staging tensors, and set only once every rank has read
        # all of it: a load that fails leaves the job as it was.
        state: dict[str, Any] = {}
        ranges: list[tuple[torch.Tensor, torch.Tensor]] = []  # ZeRO: (live range, staged copy)
        if not per_rank:  # (a checkpoint of an earlier fastreduce holds the buffers once, with the parameters)
            live = self.model.state_dict()
            own = {k for k in _buffer_keys(self.model, live) if f"model.{k}" not in metadata.state_dict_metadata}
            state["model"] = OrderedDict((k, v.detach().clone()) for k, v in live.items() if k not in own)
        if self.scope == "sharded":
            state["optimizer"] = staged_ranges(self.optimizer.sharded_state_dict(), ranges)  # type: ignore[union-attr]
            if "optimizer.fresh" not in metadata.state_dict_metadata:  # saved before fastreduce kept it
                del state["optimizer"]["fresh"]
        elif self.optimizer is not None and not per_rank:
            state.update(load_template(metadata, "optimizer"))
        state.update(load_template(metadata, f"rank{src}"))
        failure = None
        try:
            dcp.load(state, checkpoint_id=path)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            failure = f"{type(err).__name__}: {err}".strip()
        bad = every_rank_says(failure)
        missing = next((m for _, f in bad if (m := _MISSING.search(f))), None)
        if missing:  # an intact checkpoint of other settings (an optimizer's amsgrad, say): not damage
            raise CheckpointMismatchError(f"checkpoint {path} does not fit this job: this job's state has "
                                          f"{missing.group(1)}, the checkpoint does not (saved with other "
                                          "optimizer or mode settings). Nothing was loaded")
        if bad:
            why = "; ".join(f"rank {r}: {_cause(f)}" for r, f in bad)
            raise CheckpointDamagedError(f"checkpoint {path} could not be read ({why}). Nothing was "
                                         "changed", path, [path])
        undo = self._undo_point(ranges, src == rank)
        try:
            self._apply(path, saved, state, ranges, src)
            failure = None
        except Exception as err:  # noqa: BLE001 - this job's optimizer, extras or mode refuse the state
            failure = f"{type(err).__name__}: {err}"
        refused = every_rank_says(failure)
        if refused:
            undo()
            why = "; ".join(f"rank {r}: {f}" for r, f in refused)
            raise CheckpointMismatchError(f"checkpoint {path} does not fit this job ({why}). Nothing was changed; "
                                          "resume with the settings it was saved with")

    def _undo_point(self, ranges: list[tuple[torch.Tensor, torch.Tensor]], rng: bool) -> Callable[[], None]:
        """What :meth:`_apply` sets, as it is now (copies in host memory; a torch optimizer's
        state by reference: its ``load_state_dict`` puts new tensors in, never writes into
        its own); the callable returned sets it all back. The mode's state is not kept: it
        is loaded last, and a mode checks a state before it changes anything."""
        model = map_leaves(self.model.state_dict(), _to_host)
        kept = [(live, _to_host(live)) for live, _ in ranges]
        sharded = map_leaves(self.optimizer.sharded_state_dict(), _to_host,  # type: ignore[union-attr]
                             leaf=_plain_tensor) if self.scope == "sharded" else None
        opt = self.optimizer.state_dict() if self.optimizer is not None and sharded is None else None
        extras = {k: copy.deepcopy(o.state_dict()) for k, o in self.extras.items()}
        generators = capture_rng_state() if rng else None

        def undo() -> None:
            self.model.load_state_dict(model)
            for live, host in kept:
                live.copy_(host)
            if sharded is not None:
                self.optimizer.load_sharded_state_dict(sharded)  # type: ignore[union-attr]
            elif opt is not None:
                self.optimizer.load_state_dict(opt)
            for k, o in self.extras.items():
                o.load_state_dict(extras[k])
            if generators is not None:
                restore_rng_state(generators)

        return undo

    def _apply(self, path: str, saved: dict[str, Any], state: dict[str, Any],
               ranges: list[tuple[torch.Tensor, torch.Tensor]], src: int) -> None:
        """Set what every rank has read (:meth:`_load`): the model, optimizer, extras, random
        generators, and last the mode's state."""
        rank, world = current_rank(), current_world()
        same_world, per_rank = saved["world_size"] == world, self.scope == "per_rank"
        mine = unpack_tree(state, f"rank{src}")
        if not per_rank:
            model = with_metadata_of(OrderedDict(state["model"]), self.model)
            model.update(mine.get("buffers", {}))
            self.model.load_state_dict(model)
        for live, staged in ranges:
            live.copy_(staged)
        if self.scope == "sharded":
            self.optimizer.load_sharded_state_dict(state["optimizer"])  # type: ignore[union-attr]
        elif self.optimizer is not None and not per_rank:
            self.optimizer.load_state_dict(unpack_tree(state, "optimizer"))
        if "model" in mine:
            self.model.load_state_dict(mine["model"])
        if per_rank and self.optimizer is not None:
            self.optimizer.load_state_dict(mine["optimizer"])
        for name, obj in self.extras.items():
            obj.load_state_dict(mine["extras"][name])
        if src == rank:
            restore_rng_state(mine["rng"])
        if same_world or per_rank:
            if self.scope == "sharded":
                self.optimizer.load_wire_state_dict(mine.get("wire", {}))  # type: ignore[union-attr]
            if self.mode is not None:
                self.mode.load_state_dict(mine["mode"])
            elif self.scope == "replicated":
                load_functional_state(self.model, mine["mode"])
        elif rank == 0 and (mine.get("mode", {}).get("residuals") or mine.get("wire") or world > saved["world_size"]):
            log.warning("fastreduce: checkpoint %s was saved at %d ranks, this job has %d: error-feedback "
                        "residuals start at zero%s", path, saved["world_size"], world,
                        f"; ranks {saved['world_size']}.. keep their random generators and take rank 0's "
                        "extras" if world > saved["world_size"] else "")


def _buffer_keys(model: nn.Module, state: dict[str, Any]) -> set[str]:
    """The keys of ``model``'s state dict ``state`` that are buffers (persistent ones)."""
    return {n for n, _ in model.named_buffers()} & set(state)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def _plain_tensor(x: Any) -> bool:
    """A tensor to copy (a ZeRO range's view is kept as it is: its tensor is copied apart)."""
    from .modes.zero_state import RangeShard

    return isinstance(x, torch.Tensor) and not isinstance(x, RangeShard)


_MISSING = re.compile(r"Error: Missing key in checkpoint state_dict: (\S+?)\.?(?:'|\n|$)")


def _cause(failure: str) -> str:
    """A read's failure in one line: the last ``SomeError: ...`` line of it (DCP's message
    opens with its ranks' tracebacks)."""
    lines = [ln.strip() for ln in failure.splitlines() if re.match(r"\s*\w+(Error|Exception): ", ln)]
    return (lines[-1] if lines else failure)[:500]


# ---------------------------------------------------------------------- ranks agree


def _agree(problem: str | None) -> None:
    """Raise on every rank if any rank has a ``problem`` (so none goes on into a collective)."""
    for r, p in every_rank_says(problem)[:1]:
        raise CheckpointMismatchError(p if r == current_rank() or current_world() == 1 else f"on rank {r}: {p}")
