"""Flat buckets: many named tensors packed into a few contiguous byte buffers, and back.

A round broadcasts buckets, not tensors: one collective per bucket instead of one per tensor
(hundreds for a Llama), each large enough to run at link speed. The manifest says where each
tensor lives, so a receiver gets its tensors back as views into the received buckets (no copy).

Layout rules:
- tensors are placed in the order given, each at an offset aligned to `ALIGN` bytes (so a view of
  any dtype is legal: `storage_offset` must be a multiple of the element size);
- a bucket is closed when the next tensor would not fit in `bucket_bytes`;
- a tensor larger than `bucket_bytes` gets a bucket of its own, exactly its size (views stay
  zero-copy; the price is one oversized buffer, e.g. a large embedding).

Manifest (plain msgpack-able data; checked by `validate_manifest`):
    {"buckets": [nbytes, ...],
     "tensors": [[name, dtype, [shape...], bucket_index, byte_offset], ...]}
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Iterable, Sequence

if TYPE_CHECKING:
    import torch

ALIGN = 64  # bytes; a multiple of every element size, and of a cache line

# Element types that may cross the wire: `torch.<name>` and its size in bytes. Kept free of torch
# so that the service (which only validates manifests) never imports it.
ITEMSIZE = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
}


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def dtype_name(dtype) -> str:
    """`torch.float32` -> "float32" (raises for a dtype that cannot be sent)."""
    name = str(dtype).removeprefix("torch.")
    if name not in ITEMSIZE:
        raise ValueError(f"dtype {dtype} cannot be sent (known: {sorted(ITEMSIZE)})")
    return name


class ManifestError(ValueError):
    """A manifest that does not describe a valid bucket layout; `field` names the bad part."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _nbytes(dtype: str, shape: Sequence[int]) -> int:
    return math.prod(shape) * ITEMSIZE[dtype]


def plan(specs: Sequence[tuple[str, str, Sequence[int]]], bucket_bytes: int) -> dict:
    """The manifest for tensors `(name, dtype_name, shape)` packed into buckets of `bucket_bytes`."""
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be >= {ALIGN}")
    buckets: list[int] = []  # bytes used in each bucket
    tensors: list[list] = []
    open_idx = None  # the bucket small tensors are being added to
    for name, dtype, shape in specs:
        if dtype not in ITEMSIZE:
            raise ValueError(f"tensor {name!r}: dtype {dtype!r} cannot be sent (known: {sorted(ITEMSIZE)})")
        n = _nbytes(dtype, shape)
        if n > bucket_bytes:
            # oversized: a bucket of its own, exactly its size; the open bucket stays open
            buckets.append(n)
            tensors.append([name, dtype, list(shape), len(buckets) - 1, 0])
            continue
        off = _aligned(buckets[open_idx]) if open_idx is not None else 0
        if open_idx is None or off + n > bucket_bytes:
            buckets.append(0)
            open_idx, off = len(buckets) - 1, 0
        tensors.append([name, dtype, list(shape), open_idx, off])
        buckets[open_idx] = off + n
    return {"buckets": buckets, "tensors": tensors}


def specs_of(named_tensors: Iterable[tuple[str, "torch.Tensor"]]) -> tuple[list, list]:
    """`(name, dtype_name, shape)` specs and the tensors themselves (as given: no copy yet)."""
    import torch

    specs, tensors = [], []
    for name, t in named_tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name!r}: expected a torch.Tensor, got {type(t).__name__}")
        try:
            specs.append((name, dtype_name(t.dtype), list(t.shape)))
        except ValueError as e:
            raise ValueError(f"{name!r}: {e}") from None
        tensors.append(t)
    return specs, tensors


def pack(manifest: dict, tensors: Sequence["torch.Tensor"], out: Sequence["torch.Tensor"] | None = None) -> list:
    """Flat uint8 CPU buckets holding `tensors` (in manifest order) at their planned offsets.

    `out`: buckets of a previous round to overwrite when their sizes match (fresh host memory
    costs a page fault per 4 KiB on first touch: more than the copy itself).
    """
    import torch

    if out is not None and [b.numel() for b in out] == list(manifest["buckets"]):
        buckets = list(out)
    else:
        buckets = [torch.empty(n, dtype=torch.uint8) for n in manifest["buckets"]]
    for (name, dtype, shape, b, off), t in zip(manifest["tensors"], tensors, strict=True):
        n = _nbytes(dtype, shape)
        src = t.detach()
        if src.device.type != "cpu":
            src = src.cpu()
        # (numel,) bytes of the tensor; contiguous() copies only when the source is strided
        buckets[b][off:off + n].copy_(src.contiguous().view(-1).view(torch.uint8))
    return buckets


def unpack(manifest: dict, buckets: Sequence["torch.Tensor"]) -> list[tuple[str, "torch.Tensor"]]:
    """`(name, tensor)` views into `buckets` (any device), in manifest order."""
    out = []
    for name, dtype, shape, b, off in manifest["tensors"]:
        n = _nbytes(dtype, shape)
        view = buckets[b][off:off + n].view(torch_dtype(dtype)).view(shape)
        out.append((name, view))
    return out


def total_bytes(manifest: dict) -> int:
    return int(sum(manifest["buckets"]))


def validate_manifest(m: Any, where: str = "manifest", max_tensors: int = 1 << 16,
                      max_bucket_bytes: int = 1 << 40) -> dict:
    """Check that `m` is a well-formed manifest whose tensors fit their buckets; return it."""
    if not isinstance(m, dict):
        raise ManifestError(where, f"expected map, got {type(m).__name__}")
    buckets = m.get("buckets")
    tensors = m.get("tensors")
    if not isinstance(buckets, list):
        raise ManifestError(f"{where}.buckets", "expected list of byte counts")
    if not isinstance(tensors, list):
        raise ManifestError(f"{where}.tensors", "expected list")
    if len(tensors) > max_tensors:
        raise ManifestError(f"{where}.tensors", f"{len(tensors)} entries > limit {max_tensors}")
    for i, n in enumerate(buckets):
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= max_bucket_bytes:
            raise ManifestError(f"{where}.buckets[{i}]", f"bad byte count {n!r}")
    names = set()
    for i, t in enumerate(tensors):
        w = f"{where}.tensors[{i}]"
        if not (isinstance(t, list) and len(t) == 5):
            raise ManifestError(w, "expected [name, dtype, shape, bucket, offset]")
        name, dtype, shape, b, off = t
        if not isinstance(name, str) or not name:
            raise ManifestError(f"{w}.name", f"expected non-empty str, got {name!r}")
        if name in names:
            raise ManifestError(f"{w}.name", f"duplicate tensor {name!r}")
        names.add(name)
        if dtype not in ITEMSIZE:
            raise ManifestError(f"{w}.dtype", f"unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                  for s in shape):
            raise ManifestError(f"{w}.shape", f"expected list of sizes, got {shape!r}")
        if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < len(buckets):
            raise ManifestError(f"{w}.bucket", f"{b!r} not in [0, {len(buckets)})")
        if isinstance(off, bool) or not isinstance(off, int) or off < 0 or off % ITEMSIZE[dtype]:
            raise ManifestError(f"{w}.offset", f"bad offset {off!r} for {dtype}")
        if off + _nbytes(dtype, shape) > buckets[b]:
            raise ManifestError(f"{w}", f"{name!r} ends past bucket {b} ({buckets[b]} bytes)")
    return m
