"""The benchmark's device suite on a GPU: it runs, covers every method, and reports the
pack/unpack bandwidth against the device's own copy bandwidth (printed, never asserted:
speed is the bench's business, not a test's). Skipped without a CUDA GPU."""

from __future__ import annotations

import time

import pytest
import torch

from fastreduce.bench.device import format_text, run_device_bench

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _copy_bandwidth(nbytes: int) -> float:
    """GB/s of one device-to-device copy of ``nbytes`` (read + write counted)."""
    src = torch.empty(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * nbytes * 10 / (time.perf_counter() - t0) / 1e9


def test_device_suite_runs_on_cuda_and_reports_bandwidth() -> None:
    report = run_device_bench("cuda", params_m=12.0, iters=3)
    print(format_text(report))
    rows = report["pack_unpack_ms"]
    assert set(rows) == {"200 tensors", "2000 tensors"}
    for row in rows.values():
        assert set(row) == {"ohabana_loop", "fastreduce_eager", "fastreduce_cuda_graph"}
        assert all(v > 0 for v in row.values())
    assert {"adamw_fused_all", "zero_shard_1_of_8"} <= set(report["optimizer_step_ms"])
    assert set(report["local_sync_ms"]) == {"torch_average_parameters", "fastreduce_localsgd",
                                            "fastreduce_diloco_anchor_on_device", "fastreduce_diloco_anchor_on_cpu"}
    # pack + unpack: fp32 grads read and bf16 wire written, then the reverse: 12 bytes per parameter
    moved = 12 * report["params"]
    achieved = moved / (rows["200 tensors"]["fastreduce_cuda_graph"] / 1e3) / 1e9
    print(f"pack+unpack {achieved:.0f} GB/s against a plain copy's {_copy_bandwidth(4 * report['params']):.0f} GB/s")
