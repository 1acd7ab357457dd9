"""Bucket layout of the overlapped mode, in-process: sizes, order, aliasing."""

from __future__ import annotations

import torch
from torch import nn

from fastreduce.buffer import FusedBuffer
from fastreduce.layout import GradLayout
from fastreduce.buckets import first_bucket_mb, make_buckets

MB = 2**20


def stack(n_layers: int = 12, width: int = 256, dtype: torch.dtype = torch.float32) -> list:
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(n_layers)]).to(dtype)
    # backward order: last layer first, as the overlapped mode learns it
    return list(reversed(list(model.named_parameters())))


def buckets_of(named, wire=torch.float32, bucket_bytes=MB, first_bytes=None):
    layout = GradLayout(named, first_dtype=wire)
    buffer = FusedBuffer(layout, wire, torch.device("cpu"))
    return layout, buffer, make_buckets(layout, buffer, bucket_bytes, first_bytes)


def test_buckets_cover_every_param_once_in_backward_order():
    layout, _, buckets = buckets_of(stack())
    flat = [i for b in buckets for i in b.slots]
    assert sorted(flat) == list(range(len(layout)))
    assert flat == sorted(flat, key=lambda i: layout.position[i])
    assert len(buckets) > 1


def test_bucket_size_is_about_the_limit():
    _, _, buckets = buckets_of(stack(), bucket_bytes=MB)
    sizes = [b.wire.numel() * b.wire.element_size() for b in buckets]
    one_layer = (256 * 256 + 256) * 4
    assert all(s <= MB + one_layer + 4 * 32 for s in sizes[:-1]), sizes
    assert all(s >= MB for s in sizes[:-1]), sizes


def test_first_bucket_is_small_only_when_asked():
    _, _, plain = buckets_of(stack(), bucket_bytes=2 * MB)
    _, _, small_first = buckets_of(stack(), bucket_bytes=2 * MB, first_bytes=1)
    assert len(small_first[0].slots) == 1 < len(plain[0].slots)
    assert [b.slots for b in small_first[1:]][-1][-1] == plain[-1].slots[-1]
    assert first_bucket_mb("nccl") == 1.0 and first_bucket_mb("gloo") is None


def test_wire_dtype_buckets_alias_their_storage_and_others_cast():
    _, _, same = buckets_of(stack(), wire=torch.float32)
    assert all(b.flat is b.wire for b in same)
    _, _, cast = buckets_of(stack(), wire=torch.bfloat16)
    assert all(b.flat is not b.wire and b.wire.dtype == torch.bfloat16 for b in cast)


def test_mixed_dtypes_launch_by_readiness_not_by_dtype():
    named = stack(4)
    named[0][1].data = named[0][1].data.bfloat16()  # the earliest grad is bf16, the rest fp32
    layout, _, buckets = buckets_of(named, wire=torch.float32, bucket_bytes=1)
    ready = [max(layout.position[i] for i in b.slots) for b in buckets]
    assert ready == sorted(ready)
    assert layout.params[buckets[0].slots[0]].dtype == torch.bfloat16
