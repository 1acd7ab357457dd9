"""``fastreduce info``: what fastreduce would do on this machine, found without doing it.

Sections, each answered by the code that decides it at run time (never retyped here):

* device: torch's version, the device and process-group backend
  :func:`fastreduce.init_distributed` would pick (:func:`~fastreduce.backends.detect_device`,
  ``$FASTREDUCE_DEVICE``, ``$LOCAL_RANK``), and how many CUDA devices and HPUs there are;
* graph capture: whether CUDA graphs and HPU graphs (lazy mode only) can be used here,
  and the pack/unpack backend the fused reducer's defaults select
  (:func:`~fastreduce.backends.select_backend`);
* transport: ``$FASTREDUCE_TRANSPORT`` (:func:`~fastreduce.comm.resolve_transport`), and
  whether shared memory carries CPU ranks' bytes here: a one-page segment is created in
  ``/dev/shm`` and removed, as the shared-memory transport creates its own; with the
  size and free space of ``/dev/shm``;
* modes: each mode's defaults, read from its signature or :class:`~fastreduce.ReducerConfig`,
  with the values left to run time (bucket sizes per backend, the transport) resolved
  for the backend above;
* integrations: which optional packages import (transformers, accelerate, Lightning,
  optimum-habana, habana_frameworks), and why not where one fails.

No process group is started and no accelerator is needed: the only device work is
torch's own availability queries. ``--json`` prints one JSON object and nothing else.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import logging
import os
import platform
import shutil
import sys
import textwrap
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import __version__, reach
from .backends import detect_device, select_backend
from .buckets import default_bucket_mb, first_bucket_mb
from .sizing import AUTO, AUTO_RULE, GOSSIP_AUTO_RULE, ZERO_AUTO_RULE
from .comm.transport import TRANSPORT_ENV, resolve_transport
from .comm.shm import PAGE, SHM_DIR, create_segment
from .modes.diloco import DiLoCo
from .modes.fused import ReducerConfig
from .modes.gossip import DecentralizedDataParallel
from .modes.localsgd import LocalSGD
from .modes.zero import ZeroOptimizer

__all__ = ["INTEGRATIONS", "add_arguments", "collect", "format_text", "run"]

INTEGRATIONS: tuple[tuple[str, str, str], ...] = (
    # (name shown, module imported, distribution whose version is shown)
    ("transformers", "transformers", "transformers"),
    ("accelerate", "accelerate", "accelerate"),
    ("lightning", "lightning.pytorch", "lightning"),
    ("optimum-habana", "optimum.habana", "optimum-habana"),
    ("habana_frameworks", "habana_frameworks.torch", "habana-torch-plugin"),
)
"""Optional packages probed by importing them (only when ``info`` runs)."""

_NOT_SETTINGS = frozenset({"self", "group", "module", "scaler", "lr_scheduler_fn"})
"""Constructor arguments that are objects of the user's, not settings with a default."""


# ---------------------------------------------------------------------- helpers


def _jsonable(value: Any) -> Any:
    """A default as JSON: dtypes and devices as torch prints them, classes by dotted name."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, type):
        public = getattr(torch.optim, value.__name__, None)
        if public is value:
            return f"torch.optim.{value.__name__}"
        return f"{value.__module__}.{value.__qualname__}"
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return repr(value)


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


@contextlib.contextmanager
def _quiet(name: str):
    """Silence logger ``name`` (e.g. a backend's warn-once) while asking it a question."""
    log = logging.getLogger(name)
    disabled, log.disabled = log.disabled, True
    try:
        yield
    finally:
        log.disabled = disabled


def _env(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value else None


# ---------------------------------------------------------------------- sections


def _hpu() -> dict[str, Any]:
    """HPUs: whether habana_frameworks is installed, sees devices, runs in lazy mode."""
    from .backends import hpu  # the backend's own checks

    out: dict[str, Any] = {"installed": importlib.util.find_spec("habana_frameworks") is not None,
                           "available": False, "count": 0, "lazy_mode": None}
    if not out["installed"]:
        return out
    out["available"] = hpu.available()
    out["lazy_mode"] = hpu.lazy_mode()
    if out["available"]:
        try:
            import habana_frameworks.torch.hpu as hthpu  # noqa: PLC0415 - lazy by design

            out["count"] = int(hthpu.device_count())
        except (ImportError, AttributeError, RuntimeError) as err:
            out["error"] = _one_line(err)
    return out


def _cuda() -> dict[str, Any]:
    built = torch.version.cuda or getattr(torch.version, "hip", None)
    available = torch.cuda.is_available()
    return {"built": built, "hip": getattr(torch.version, "hip", None) is not None,
            "available": available, "count": torch.cuda.device_count() if available else 0}


def _device(cuda: dict[str, Any], hpu: dict[str, Any]) -> tuple[dict[str, Any], torch.device | None, str | None]:
    """What :func:`fastreduce.init_distributed` would pick: its device and process-group backend."""
    local_rank_env = _env("LOCAL_RANK")
    out: dict[str, Any] = {"FASTREDUCE_DEVICE": _env("FASTREDUCE_DEVICE"), "LOCAL_RANK": local_rank_env,
                           "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                           else os.cpu_count()}
    device = pg = None
    try:
        device, pg = detect_device(int(local_rank_env or "0"))
    except (ValueError, RuntimeError) as err:
        out["error"] = str(err)
    out["type"] = device.type if device is not None else None
    out["name"] = str(device) if device is not None else None
    out["count"] = {"cuda": cuda["count"], "hpu": hpu["count"], "cpu": 1}.get(out["type"], 0)
    if device is not None and device.type == "cuda":
        try:
            out["model"] = torch.cuda.get_device_name(device)
        except (RuntimeError, AssertionError) as err:
            out["model_error"] = _one_line(err)
    return out, device, pg


def _backend(pg: str | None) -> dict[str, Any]:
    built = {"gloo": dist.is_available() and dist.is_gloo_available(),
             "nccl": dist.is_available() and dist.is_nccl_available(),
             "hccl": importlib.util.find_spec("habana_frameworks") is not None}
    return {"name": pg, "built": built.get(pg) if pg is not None else None, "distributed": dist.is_available(),
            "initialized": dist.is_available() and dist.is_initialized(),
            "problem": reach.transport_problem(pg) if pg is not None and dist.is_available() else None}


def _graphs(device: torch.device | None, cuda: dict[str, Any], hpu: dict[str, Any]) -> dict[str, Any]:
    cfg = _reducer_defaults()
    if not cuda["built"]:
        cuda_graphs = {"available": False, "reason": "torch built without CUDA"}
    elif not cuda["available"]:
        cuda_graphs = {"available": False, "reason": "no CUDA device visible"}
    else:
        ok = hasattr(torch.cuda, "CUDAGraph")
        cuda_graphs = {"available": ok, "reason": "torch.cuda.CUDAGraph" if ok else "this torch lacks torch.cuda.CUDAGraph"}
    if not hpu["installed"]:
        hpu_graphs = {"available": False, "reason": "habana_frameworks not installed"}
    elif not hpu["available"]:
        hpu_graphs = {"available": False, "reason": "no Gaudi device visible"}
    elif not hpu["lazy_mode"]:
        hpu_graphs = {"available": False, "reason": "eager mode (PT_HPU_LAZY_MODE=0); HPU graphs need lazy mode"}
    else:
        hpu_graphs = {"available": True, "reason": "lazy mode"}
    reducer = None
    if device is not None:
        with _quiet("fastreduce.backends"):
            reducer = select_backend(cfg["backend"], device, cfg["use_graphs"]).name
    return {"cuda_graphs": cuda_graphs, "hpu_graphs": hpu_graphs, "reducer_backend": reducer,
            "reducer_settings": {"backend": cfg["backend"], "use_graphs": cfg["use_graphs"]}}


def _shm() -> dict[str, Any]:
    """``/dev/shm``: size, free space, and whether a segment can be made there (the
    shared-memory transport's own ``create_segment``, one page, removed at once)."""
    out: dict[str, Any] = {"dir": SHM_DIR, "exists": os.path.isdir(SHM_DIR), "size_bytes": None,
                           "free_bytes": None, "usable": False, "reason": None}
    if out["exists"]:
        usage = shutil.disk_usage(SHM_DIR)
        out["size_bytes"], out["free_bytes"] = usage.total, usage.free
    path, why = create_segment(PAGE)
    if path is not None:
        os.unlink(path)
        out["usable"] = True
    out["reason"] = why
    return out


def _transport(device: torch.device | None, pg: str | None) -> dict[str, Any]:
    """The transport a multi-rank run on this host would use for ``device``'s buffers
    (the rule of :class:`~fastreduce.comm.Comm`: ``shm`` for CPU tensors where a segment
    can be made, else the process group)."""
    raw = _env(TRANSPORT_ENV)
    out: dict[str, Any] = {"name": None, "setting": None, TRANSPORT_ENV: raw, "reason": None, "error": None,
                           "shm": _shm()}
    try:
        setting = out["setting"] = resolve_transport(None)
    except ValueError as err:
        out["error"] = str(err)
        return out
    shm = out["shm"]
    if setting == "process_group":
        out["name"], out["reason"] = "process_group", f"the process group's collectives ({pg})"
    elif device is None:
        out["error"] = "no device (see the device's error)"
    elif device.type != "cpu":
        if setting == "shm":
            out["error"] = (f"transport 'shm' carries CPU tensors only, these are on {device.type}: "
                            "the modes raise ValueError")
        else:
            out["name"], out["reason"] = "process_group", f"{device.type} tensors go through {pg}"
    elif shm["usable"]:
        out["name"] = "shm"
        out["reason"] = f"CPU ranks on this host average through {SHM_DIR} (ranks on several hosts: {pg})"
    elif setting == "shm":
        out["error"] = f"transport 'shm' is not possible ({shm['reason']}): the modes raise RuntimeError"
    else:
        out["name"], out["reason"] = "process_group", f"{shm['reason']}: {pg} instead"
    return out


def _reducer_defaults() -> dict[str, Any]:
    """``ReducerConfig``'s fields and their defaults (a factory's value as it is now)."""
    out = {}
    for f in dataclasses.fields(ReducerConfig):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def _signature(fn: Callable[..., Any]) -> tuple[list[str], dict[str, Any]]:
    """``fn``'s required arguments and its settings' defaults, from its signature."""
    required, defaults = [], {}
    for p in inspect.signature(fn).parameters.values():
        if p.name in _NOT_SETTINGS or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.default is p.empty:
            required.append(p.name)
        else:
            defaults[p.name] = p.default
    return required, defaults


def _overlap_buckets(pg: str) -> dict[str, Any]:
    """The overlapped mode's bucket sizes on ``pg``: ``"auto"``'s rule, and the backend's
    sizes where "auto" does not apply (its first bucket like the rest unless
    :func:`~fastreduce.buckets.first_bucket_mb` says otherwise)."""
    bucket = default_bucket_mb(pg)
    first = first_bucket_mb(pg)
    return {"bucket_mb": AUTO, "auto": AUTO_RULE, "fixed_bucket_mb": bucket,
            "fixed_first_bucket_mb": bucket if first is None else first}


def _modes(pg: str | None, transport: dict[str, Any]) -> dict[str, Any]:
    """Each mode: how it is built, its defaults, and what they come to with backend ``pg``."""
    tr = {"transport": transport["name"]} if transport["name"] else {}
    per_pg = pg is not None
    modes: dict[str, Any] = {}
    cfg = _reducer_defaults()
    modes["fused"] = {"call": "FusedReducer(model) / all_reduce_gradients(model)", "required": ["model"],
                      "defaults": {k: v for k, v in cfg.items() if k != "bucket_mb"}, "resolved": dict(tr)}
    over = dict(cfg, overlap=True)
    modes["overlapped"] = {"call": "FusedReducer(model, overlap=True)", "required": ["model"], "defaults": over,
                           "resolved": {**(_overlap_buckets(pg) if per_pg else {}), **tr}}
    for name, cls, resolve in (
            ("zero", ZeroOptimizer, lambda: {"bucket_mb": AUTO, "auto": ZERO_AUTO_RULE}),
            ("local_sgd", LocalSGD, dict),
            ("diloco", DiLoCo, dict),
            ("decentralized", DecentralizedDataParallel,
             lambda: {"bucket_mb": AUTO, "auto": GOSSIP_AUTO_RULE, "local_world_size": _env("LOCAL_WORLD_SIZE")})):
        required, defaults = _signature(cls.__init__)
        resolved = resolve() if per_pg else {}
        resolved = {k: v for k, v in resolved.items() if defaults.get(k, None) is None}
        modes[name] = {"call": f"{cls.__name__}({', '.join(required)})", "required": required,
                       "defaults": defaults, "resolved": {**resolved, **tr}}
    for mode in modes.values():
        mode["defaults"] = _jsonable(mode["defaults"])
        mode["resolved"] = _jsonable(mode["resolved"])
    return modes


def _probe(module: str, distribution: str) -> dict[str, Any]:
    """Import ``module``: whether it is installed, imports, and its version; never raises."""
    out: dict[str, Any] = {"module": module, "installed": False, "imports": False, "version": None,
                           "error": None, "seconds": 0.0}
    try:
        out["installed"] = importlib.util.find_spec(module.split(".")[0]) is not None
    except (ImportError, ValueError):
        pass
    if not out["installed"]:
        return out
    try:
        out["version"] = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        pass
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(sys.stderr):  # what a module prints is not the report
            mod = importlib.import_module(module)
        out["imports"] = True
        out["version"] = out["version"] or getattr(mod, "__version__", None)
    except (Exception, SystemExit) as err:  # noqa: BLE001 - the reason is the answer
        out["error"] = _one_line(err)
    out["seconds"] = round(time.perf_counter() - t0, 3)
    return out


def collect(integrations: bool = True) -> dict[str, Any]:
    """Everything ``fastreduce info`` reports, as one JSON-serializable dict."""
    cuda, hpu = _cuda(), _hpu()
    device, dev, pg = _device(cuda, hpu)
    transport = _transport(dev, pg)
    info: dict[str, Any] = {
        "fastreduce": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": {"version": torch.__version__, "cuda": torch.version.cuda,
                  "hip": getattr(torch.version, "hip", None)},
        "device": device,
        "cuda": cuda,
        "hpu": hpu,
        "backend": _backend(pg),
        "graphs": _graphs(dev, cuda, hpu),
        "transport": transport,
        "modes": _modes(pg, transport),
    }
    if integrations:
        info["integrations"] = {name: _probe(module, distribution) for name, module, distribution in INTEGRATIONS}
    return info


# ---------------------------------------------------------------------- text


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


def _value(v: Any) -> str:
    if isinstance(v, str) and v.startswith("torch.") and "." not in v[6:]:
        return v[6:]  # torch.bfloat16 -> bfloat16
    return str(v)


def _mode_parts(mode: dict[str, Any]) -> list[str]:
    parts = []
    for k, v in mode["defaults"].items():
        if k in mode["resolved"] and mode["resolved"][k] != v:
            got = mode["resolved"][k]
            parts.append(f"{k}={_value(v)} ({_value(got)} here)")
        else:
            parts.append(f"{k}={_value(v)}")
    parts += [f"{k}: {_value(v)}" for k, v in mode["resolved"].items() if k not in mode["defaults"]]
    return parts


def format_text(info: dict[str, Any]) -> str:
    """The human-readable report: aligned sections."""
    dev, cuda, hpu, be, gr, tr = (info[k] for k in ("device", "cuda", "hpu", "backend", "graphs", "transport"))
    sections: list[tuple[str, list[tuple[str, str]]]] = []

    if dev.get("error"):
        device = f"none: {dev['error']}"
    else:
        device = dev["name"] + (f" ({dev['model']})" if dev.get("model") else "")
    env = ", ".join(f"{k}={dev[k]}" for k in ("FASTREDUCE_DEVICE", "LOCAL_RANK") if dev[k] is not None)
    if cuda["available"]:
        cuda_line = f"{cuda['count']} device(s), {'ROCm' if cuda['hip'] else 'CUDA'} {cuda['built']}"
    else:
        cuda_line = "none (torch built without CUDA)" if not cuda["built"] else f"none (torch built with {cuda['built']})"
    if hpu["available"]:
        hpu_line = f"{hpu['count']} device(s), {'lazy' if hpu['lazy_mode'] else 'eager'} mode"
    else:
        hpu_line = "none (habana_frameworks installed)" if hpu["installed"] else "none (habana_frameworks not installed)"
    pg = be["name"] or "none: init_distributed() would raise (see device)"
    sections.append(("device", [
        ("torch", f"{info['torch']['version']} (Python {info['python']})"),
        ("device", device + (f"  ({env})" if env else "  (FASTREDUCE_DEVICE=cpu|cuda|hpu overrides)")),
        ("cuda", cuda_line),
        ("hpu", hpu_line),
        ("cpu cores", str(dev["cpu_cores"])),
        ("process group", f"{pg}  (cannot make its transport here: {be['problem']})" if be.get("problem") else
         f"{pg}  (init_distributed's pick; init_distributed(backend=...) overrides)" if be["name"] else pg),
    ]))

    def yes(g: dict[str, Any]) -> str:
        return ("yes: " if g["available"] else "no: ") + g["reason"]

    rs = gr["reducer_settings"]
    sections.append(("graph capture", [
        ("cuda graphs", yes(gr["cuda_graphs"])),
        ("hpu graphs", yes(gr["hpu_graphs"])),
        ("pack/unpack", f"{gr['reducer_backend'] or 'none'}  (backend={rs['backend']!r}, use_graphs={rs['use_graphs']})"),
    ]))

    shm = tr["shm"]
    shm_line = (f"{_gib(shm['size_bytes'])}, {_gib(shm['free_bytes'])} free" if shm["exists"] else "missing")
    shm_line += "; segments can be created" if shm["usable"] else f"; unusable: {shm['reason']}"
    raw = tr[TRANSPORT_ENV]
    source = f"${TRANSPORT_ENV}={raw}" if raw is not None else f"${TRANSPORT_ENV} unset"
    setting = f"{tr['setting']} ({source})" if tr["setting"] else source
    sections.append(("transport", [
        ("transport", tr["name"] or "none"),
        ("setting", setting),
        ("why" if tr["name"] else "error", tr["reason"] if tr["name"] else tr["error"]),
        (shm["dir"], shm_line),
    ]))

    sections.append(("modes (defaults; 'here': as resolved on this host)",
                     [(name, [m["call"], _mode_parts(m)]) for name, m in info["modes"].items()]))

    if "integrations" in info:
        rows = []
        for name, p in info["integrations"].items():
            if not p["installed"]:
                rows.append((name, "not installed"))
            elif p["imports"]:
                slow = f", {p['seconds']:.1f} s to import" if p["seconds"] >= 1 else ""
                rows.append((name, f"imports ({p['version'] or 'version unknown'}{slow})"))
            else:
                rows.append((name, f"installed ({p['version'] or 'version unknown'}) but fails to import: "
                                   f"{p['error']}"))
        sections.append(("integrations", rows))

    width = max(len(k) for _, rows in sections for k, _ in rows) + 2
    wrap = max(60, shutil.get_terminal_size((100, 24)).columns) - width - 2
    lines = [f"fastreduce {info['fastreduce']} on {info['platform']}"]
    for title, rows in sections:
        lines += ["", title]
        for key, value in rows:
            paras = value if isinstance(value, list) else [value]
            out: list[str] = []
            for para in paras:
                if isinstance(para, list):  # settings: wrapped between them, never inside one
                    out.append("")
                    for part in para:
                        sep = ", " if out[-1] else ""
                        if out[-1] and len(out[-1]) + len(sep) + len(part) > wrap:
                            out[-1] += ","
                            out.append(part)
                        else:
                            out[-1] += sep + part
                else:
                    out += textwrap.wrap(para, wrap, break_on_hyphens=False) or [""]
            lines += [f"  {key if i == 0 else '':<{width}}{chunk}" for i, chunk in enumerate(out)]
    return "\n".join(lines)


# ---------------------------------------------------------------------- command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout and nothing else")
    parser.add_argument("--no-integrations", dest="integrations", action="store_false",
                        help="skip importing the optional integrations (the slowest part where they are installed)")


def run(args: argparse.Namespace) -> int:
    """The ``info`` subcommand."""
    info = collect(integrations=args.integrations)
    print(json.dumps(info, indent=1) if args.json else format_text(info), file=getattr(args, "stdout", sys.stdout))
    return 0
