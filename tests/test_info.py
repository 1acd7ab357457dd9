"""``fastreduce info`` (also ``python -m fastreduce info``, ``--json``): what fastreduce would
do on this machine, run as a user runs it, in a subprocess (its variants under other
environment variables collected in this process: :data:`AS_RUN`).

Every expectation is computed here, independently of the command: the process-group
backend from torch's own availability queries, the transport from whether ``/dev/shm``
is a writable directory, each mode's defaults from its signature (or
:class:`fastreduce.ReducerConfig`'s fields). The environment variables the command reads
(``FASTREDUCE_TRANSPORT``, ``FASTREDUCE_DEVICE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``)
are set per test, so the file passes under CI's ``FASTREDUCE_TRANSPORT=process_group``
rerun too. The optional integrations are probed against stand-in packages on
``PYTHONPATH`` (one that fails to import as optimum-habana does without Habana's
software, one that prints while importing); the real packages only where installed.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.util
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import fastreduce
from fastreduce.cli import main
from fastreduce.buckets import default_bucket_mb
from fastreduce.info import INTEGRATIONS, format_text

pytestmark = pytest.mark.timeout(120)

_ENV = ("FASTREDUCE_TRANSPORT", "FASTREDUCE_DEVICE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def _run(*args: str, env: dict[str, str] | None = None, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in _ENV}
    if pythonpath is not None:
        base["PYTHONPATH"] = os.pathsep.join(p for p in (str(pythonpath), base.get("PYTHONPATH")) if p)
    base.update(env or {})
    proc = subprocess.run([sys.executable, "-m", "fastreduce", "info", *args], capture_output=True, text=True,
                          env=base, timeout=100)
    assert proc.returncode == 0, proc.stderr
    return proc


AS_RUN = {"FASTREDUCE_DEVICE": "cpu"}
"""The environment under which ``info --no-integrations --json`` runs as a user runs it, in a
subprocess; under the others, what it reports is collected here (the same function, its
environment variables set for the call): each subprocess costs seconds, an interpreter
importing torch."""


def _json(env: dict[str, str] | None = None) -> dict[str, Any]:
    """What ``info --no-integrations --json`` says under ``env``: one run per environment,
    shared by the tests that read it (the integrations' imports would take four times the CPU:
    the tests that read them run them)."""
    return copy.deepcopy(_json_under(tuple(sorted((env or {}).items()))))


@functools.cache
def _json_under(env: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    if dict(env) == AS_RUN:
        return json.loads(_run("--json", "--no-integrations", env=dict(env)).stdout)  # stdout: one JSON object
    from fastreduce.info import collect

    with mock.patch.dict(os.environ):  # (restored whole on the way out)
        for k in _ENV:
            os.environ.pop(k, None)
        os.environ.update(env)
        return json.loads(json.dumps(collect(integrations=False)))


def _shm_writable() -> bool:
    return os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK)


def _accelerator_here() -> bool:
    return torch.cuda.is_available() or importlib.util.find_spec("habana_frameworks") is not None


def _as_json(value: Any) -> Any:
    """A default as the command writes it (dtypes as torch prints them)."""
    return str(value) if isinstance(value, torch.dtype) else value


# ---------------------------------------------------------------------- must show


def test_json_names_backend_and_transport() -> None:
    """The must-show: ``info --json`` parses and names the backend and the transport."""
    info = _json()
    assert info["fastreduce"] == fastreduce.__version__
    assert info["torch"]["version"] == torch.__version__
    if _accelerator_here():
        assert info["backend"]["name"] in ("nccl", "hccl")
        return
    assert info["backend"]["name"] == "gloo"  # a CPU-only machine, like this one
    assert info["device"]["type"] == "cpu"
    assert info["transport"]["setting"] == "auto"
    assert info["transport"]["name"] == ("shm" if _shm_writable() else "process_group")
    assert info["graphs"]["reducer_backend"] == "eager"
    assert info["graphs"]["cuda_graphs"]["available"] is False
    assert info["graphs"]["hpu_graphs"]["available"] is False
    assert info["backend"]["initialized"] is False


def test_forced_cpu_is_gloo_with_shared_memory() -> None:
    """``FASTREDUCE_DEVICE=cpu`` (any machine): Gloo, and shm where /dev/shm is writable."""
    info = _json({"FASTREDUCE_DEVICE": "cpu"})
    assert info["device"]["type"] == "cpu" and info["device"]["FASTREDUCE_DEVICE"] == "cpu"
    assert info["backend"]["name"] == "gloo"
    tr = info["transport"]
    assert tr["name"] == ("shm" if _shm_writable() else "process_group"), tr
    assert tr["shm"]["dir"] == "/dev/shm"
    if os.path.isdir("/dev/shm"):
        st = os.statvfs("/dev/shm")
        assert tr["shm"]["size_bytes"] == st.f_blocks * st.f_frsize


def test_transport_from_the_environment() -> None:
    info = _json({"FASTREDUCE_DEVICE": "cpu", "FASTREDUCE_TRANSPORT": "process_group"})
    tr = info["transport"]
    assert (tr["name"], tr["setting"], tr["FASTREDUCE_TRANSPORT"]) == ("process_group", "process_group",
                                                                       "process_group")
    assert "gloo" in tr["reason"]
    for name, mode in info["modes"].items():
        assert mode["resolved"]["transport"] == "process_group", name
    assert info["modes"]["fused"]["defaults"]["transport"] == "process_group"  # ReducerConfig's factory


def test_bad_settings_are_reported_not_raised() -> None:
    info = _json({"FASTREDUCE_TRANSPORT": "carrier-pigeon", "FASTREDUCE_DEVICE": "tpu"})
    assert info["transport"]["name"] is None and "carrier-pigeon" in info["transport"]["error"]
    assert info["device"]["type"] is None and "tpu" in info["device"]["error"]
    assert info["backend"]["name"] is None
    info = _json({"FASTREDUCE_DEVICE": "cpu", "GLOO_SOCKET_IFNAME": "nope0"})  # (a Membership would refuse it)
    assert info["backend"]["name"] == "gloo" and "'nope0' names no interface" in info["backend"]["problem"]
    assert _json({"FASTREDUCE_DEVICE": "cpu"})["backend"]["problem"] is None


# ---------------------------------------------------------------------- defaults


def _signature_defaults(fn: Any) -> dict[str, Any]:
    return {n: p.default for n, p in inspect.signature(fn).parameters.items() if p.default is not p.empty}


def test_mode_defaults_are_the_codes() -> None:
    info = _json({"FASTREDUCE_DEVICE": "cpu"})
    modes = info["modes"]
    assert set(modes) == {"fused", "overlapped", "zero", "local_sgd", "diloco", "decentralized"}

    config = {f.name: f.default for f in dataclasses.fields(fastreduce.ReducerConfig)
              if f.default is not dataclasses.MISSING}
    for key, value in config.items():
        assert modes["overlapped"]["defaults"][key] == (True if key == "overlap" else _as_json(value)), key
        if key != "bucket_mb":
            assert modes["fused"]["defaults"][key] == _as_json(value), key
    assert modes["fused"]["defaults"]["overlap"] is False
    # all_reduce_gradients passes ReducerConfig's defaults under optimum-habana's names
    arg = _signature_defaults(fastreduce.all_reduce_gradients)
    assert modes["fused"]["defaults"]["wire_dtype"] == str(arg["fusion_buffer_dtype"])
    assert modes["fused"]["defaults"]["use_graphs"] == arg["use_hpu_graphs"]

    for name, cls in (("zero", fastreduce.ZeroOptimizer), ("local_sgd", fastreduce.LocalSGD),
                      ("diloco", fastreduce.DiLoCo), ("decentralized", fastreduce.DecentralizedDataParallel)):
        code = _signature_defaults(cls.__init__)
        shown = modes[name]["defaults"]
        for key, value in shown.items():
            assert key in code, (name, key)
            if isinstance(value, str) and value.startswith("torch.optim."):
                assert code[key] is getattr(torch.optim, value.rsplit(".", 1)[1]), (name, key)
            else:
                assert value == _as_json(code[key]), (name, key)
        required = [n for n, p in inspect.signature(cls.__init__).parameters.items()
                    if p.default is p.empty and n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        assert modes[name]["required"] == required, name

    # spelled out, against the code as a user would read it
    local = inspect.signature(fastreduce.LocalSGD).parameters
    assert modes["local_sgd"]["defaults"]["warmup_steps"] == local["warmup_steps"].default
    assert modes["local_sgd"]["defaults"]["buffers"] == local["buffers"].default
    assert "sync_every" in modes["local_sgd"]["required"] and "sync_every" not in modes["local_sgd"]["defaults"]
    diloco = inspect.signature(fastreduce.DiLoCo).parameters
    assert modes["diloco"]["defaults"]["wire_dtype"] == str(diloco["wire_dtype"].default)
    assert modes["diloco"]["defaults"]["fragments"] == diloco["fragments"].default
    assert modes["zero"]["defaults"]["optimizer_class"] == "torch.optim.AdamW"
    # the sizes left to run time, for Gloo
    assert modes["overlapped"]["defaults"]["bucket_mb"] == "auto" == modes["overlapped"]["resolved"]["bucket_mb"]
    assert "shared memory" in modes["overlapped"]["resolved"]["auto"]
    assert modes["overlapped"]["resolved"]["fixed_bucket_mb"] == default_bucket_mb("gloo")
    assert modes["zero"]["resolved"]["bucket_mb"] == "auto" and "built" in modes["zero"]["resolved"]["auto"]
    assert modes["decentralized"]["defaults"]["bucket_mb"] == "auto"
    assert modes["decentralized"]["resolved"]["auto"].startswith("one bucket")


def test_local_world_size_reaches_the_decentralized_mode() -> None:
    info = _json({"FASTREDUCE_DEVICE": "cpu", "LOCAL_WORLD_SIZE": "4"})
    assert info["modes"]["decentralized"]["resolved"]["local_world_size"] == "4"


# ---------------------------------------------------------------------- text


def test_text_mentions_the_same() -> None:
    env = {"FASTREDUCE_DEVICE": "cpu"}
    info = _json(env)
    text = _run(env=env).stdout  # with the integrations' section
    assert not text.lstrip().startswith("{")
    for section in ("device", "graph capture", "transport", "modes", "integrations"):
        assert f"\n{section}" in text, section
    lines = {line.split()[0]: line for line in text.splitlines() if line.startswith("  ") and line.split()}
    assert info["backend"]["name"] in lines["process"]
    assert lines["transport"].split()[1] == info["transport"]["name"]
    assert info["torch"]["version"] in text
    assert "/dev/shm" in text
    for name, mode in info["modes"].items():
        assert lines[name].split(None, 1)[1].strip() == mode["call"]
    assert f"warmup_steps={info['modes']['local_sgd']['defaults']['warmup_steps']}" in text
    assert "bucket_mb=auto," in text and f"auto: {info['modes']['overlapped']['resolved']['auto']}" in text
    assert "bucket_mb=None (auto here)" in text
    assert "wire_dtype=bfloat16" in text
    for name, _, _ in INTEGRATIONS:
        assert name in lines, name


# ---------------------------------------------------------------------- integrations


NOISE = ("[Gloo] Rank 0 is connected to 0 peer ranks, on file descriptor 1", "a child process says hello")


def _stand_ins(root: Path) -> Path:
    """optimum-habana failing as it does without Habana's software; an accelerate that
    prints while importing, from Python, from below Python onto file descriptor 1 (as
    torch 2.9's Gloo does) and from a child process (``--json``'s stdout must stay one
    object)."""
    (root / "optimum" / "habana").mkdir(parents=True)
    (root / "optimum" / "__init__.py").write_text("")
    (root / "optimum" / "habana" / "__init__.py").write_text(
        "raise RuntimeError('check_synapse_version: no Habana software here\\nsecond line')\n")
    (root / "accelerate").mkdir()
    (root / "accelerate" / "__init__.py").write_text(
        "import os, subprocess, sys\n"
        "print('accelerate says hello')\n"
        f"os.write(1, {NOISE[0]!r}.encode() + b'\\n')\n"
        f"subprocess.run([sys.executable, '-c', {f'print({NOISE[1]!r})'!r}], check=True)\n"
        "__version__ = '0.0.test'\n")
    return root


def test_integrations_report_why_they_fail(tmp_path: Path) -> None:
    root = _stand_ins(tmp_path)
    proc = _run("--json", env={"FASTREDUCE_DEVICE": "cpu"}, pythonpath=root)
    info = json.loads(proc.stdout)  # what was written on descriptor 1 went to stderr
    assert all(noise in proc.stderr for noise in NOISE), proc.stderr
    oh = info["integrations"]["optimum-habana"]
    assert oh["installed"] is True and oh["imports"] is False
    assert oh["error"] == "RuntimeError: check_synapse_version: no Habana software here"
    acc = info["integrations"]["accelerate"]
    assert acc["installed"] is True and acc["imports"] is True and acc["version"]
    text = format_text(info)  # the text run's stdout is as clean as --json's (test_text_mentions_the_same)
    assert "fails to import: RuntimeError: check_synapse_version" in " ".join(text.split())  # wrapped
    assert "accelerate says hello" not in text
    for name, module in (("transformers", "transformers"), ("lightning", "lightning")):
        assert info["integrations"][name]["installed"] == (importlib.util.find_spec(module) is not None)


def test_no_integrations_flag() -> None:
    assert "integrations" not in _json({"FASTREDUCE_DEVICE": "cpu"})


# ---------------------------------------------------------------------- cost


def test_no_process_group_no_leftovers() -> None:
    """In process: no process group, no segment of this process left in /dev/shm, no
    bench import. (Segments are named ``fastreduce-<pid>-...``: the ranks of tests running
    beside this one under xdist make their own meanwhile, which are not this test's.)"""
    from fastreduce import info as info_mod

    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    got = info_mod.collect(integrations=False)
    after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert not (dist.is_available() and dist.is_initialized())
    assert not [f for f in after - before if f.startswith(f"fastreduce-{os.getpid()}-")]
    json.dumps(got)  # serializable as it is


def test_lazy() -> None:
    """The command imports neither the bench suites nor anything that starts a device, and
    without its integrations' report none of the trainers' packages (what keeps it quick:
    the run's time is the bench's to measure, not an assertion's)."""
    code = ("import io, sys, contextlib; from fastreduce.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()): rc = main(['info', '--json', '--no-integrations'])\n"
            "assert rc == 0; assert 'fastreduce.bench' not in sys.modules, 'bench imported'\n"
            "heavy = sorted(m for m in ('transformers', 'lightning', 'accelerate', 'optimum') if m in sys.modules)\n"
            "assert not heavy, f'imported {heavy}'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr


def test_bench_subcommand_still_parses(capsys: pytest.CaptureFixture[str]) -> None:
    """The dispatcher adds a subcommand's arguments when it is used: bench's help and
    its argument errors are what they were."""
    with pytest.raises(SystemExit) as e:
        main(["bench", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--suite" in out and "--quick" in out
    with pytest.raises(SystemExit) as e:
        main(["bench", "--no-such-flag"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["info", "--help"])
    assert e.value.code == 0
    assert "--json" in capsys.readouterr().out
