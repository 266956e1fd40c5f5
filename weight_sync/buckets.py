"""Flat buckets: the layout a member receives a version into, and the collectives that fill it.

Both ends hold a version as a few contiguous byte buffers, its buckets, kept between rounds. The
sender's gather copies each of the learner's tensors into its place in the sender's buckets as it
arrives (`gather`: the one copy a version costs it), and a round broadcasts each bucket whole
(`sent`, `targets`), straight into the same place in every member's buckets, which hand the
engine views into them (no copy). The manifest says where each tensor lives.

Layout rules:
- tensors are placed in the order given, each at an offset aligned to `ALIGN` bytes (so a view of
  any dtype is legal: `storage_offset` must be a multiple of the element size);
- a bucket is closed when the next tensor would not fit in `bucket_bytes`;
- a tensor larger than `bucket_bytes` gets a bucket of its own, exactly its size (views stay
  zero-copy; the price is one oversized buffer, e.g. a large embedding).

The manifest is a `Manifest` (a msgspec Struct, so it travels inside the control messages as
they are): bucket sizes, and per tensor `[name, dtype, shape, bucket, offset]` on the wire. Its
type bounds every count and size, so a peer's manifest is checked field by field in constant time
before any product is taken; `Manifest.__post_init__` then checks that the layout is consistent.
"""


from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated, Iterable, Literal, Sequence

import msgspec

from common.wire import ProtocolError, short

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
DType = Literal["float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool",
                "float8_e4m3fn", "float8_e5m2"]

# Bounds a peer's manifest meets before anything is multiplied: a shape of 65,535 dims of 2**64-1
# would otherwise cost seconds of big-integer products.
MAX_TENSORS = 1 << 16
MAX_NDIM = 16
MAX_DIM = 1 << 40  # one dimension's size, exclusive
MAX_BUCKET_BYTES = 1 << 40
MAX_MODEL_BYTES = 1 << 42  # all buckets together (4 TiB)
MAX_NAME = 1 << 12


class TensorSpec(msgspec.Struct, array_like=True):
    """Where one tensor lives: `[name, dtype, shape, bucket, offset]` on the wire."""

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME)]
    dtype: DType
    shape: Annotated[list[Annotated[int, msgspec.Meta(ge=0, lt=MAX_DIM)]], msgspec.Meta(max_length=MAX_NDIM)]
    bucket: Annotated[int, msgspec.Meta(ge=0)]
    offset: Annotated[int, msgspec.Meta(ge=0)]  # bytes into the bucket

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


TENSOR_FIELDS = TensorSpec.__struct_fields__  # names of the positions on the wire, for error messages


class Manifest(msgspec.Struct):
    """The bucket layout of one version: `buckets[i]` bytes each, and where every tensor lives."""

    buckets: Annotated[list[Annotated[int, msgspec.Meta(ge=0, le=MAX_BUCKET_BYTES)]],
                       msgspec.Meta(max_length=MAX_TENSORS)]
    tensors: Annotated[list[TensorSpec], msgspec.Meta(max_length=MAX_TENSORS)]

    def __post_init__(self):
        """The layout is consistent: known dtypes, unique names, every tensor inside its bucket.
        (Raises `ProtocolError` naming `manifest.<part>`.) The type has bounded every number."""
        total = sum(self.buckets)
        if total > MAX_MODEL_BYTES:
            raise ProtocolError("manifest.buckets", f"{total} bytes in all > limit {MAX_MODEL_BYTES}")
        names = set()
        for i, t in enumerate(self.tensors):
            w = f"manifest.tensors[{i}]"
            if t.name in names:
                raise ProtocolError(f"{w}.name", f"duplicate tensor {short(t.name)}")
            names.add(t.name)
            if t.dtype not in ITEMSIZE:  # (the type says so on the wire; this covers local construction)
                raise ProtocolError(f"{w}.dtype", f"unknown dtype {short(t.dtype)}")
            if not t.bucket < len(self.buckets):
                raise ProtocolError(f"{w}.bucket", f"{t.bucket} not in [0, {len(self.buckets)})")
            if t.offset % ITEMSIZE[t.dtype]:
                raise ProtocolError(f"{w}.offset", f"offset {t.offset} is not aligned for {t.dtype}")
            if t.offset + t.nbytes > self.buckets[t.bucket]:
                raise ProtocolError(w, f"{short(t.name)} ends past bucket {t.bucket} ({self.buckets[t.bucket]} bytes)")

    @property
    def total_bytes(self) -> int:
        return int(sum(self.buckets))

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tensors]


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def dtype_name(dtype) -> str:
    """`torch.float32` -> "float32" (raises for a dtype that cannot be sent)."""
    name = str(dtype).removeprefix("torch.")
    if name not in ITEMSIZE:
        raise ValueError(f"dtype {dtype} cannot be sent (known: {sorted(ITEMSIZE)})")
    return name


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan(specs: Sequence[tuple[str, str, Sequence[int]]], bucket_bytes: int) -> Manifest:
    """The manifest for tensors `(name, dtype_name, shape)` packed into buckets of `bucket_bytes`."""
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be >= {ALIGN}")
    buckets: list[int] = []  # bytes used in each bucket
    tensors: list[TensorSpec] = []
    open_idx = None  # the bucket small tensors are being added to
    for name, dtype, shape in specs:
        if dtype not in ITEMSIZE:
            raise ValueError(f"tensor {name!r}: dtype {dtype!r} cannot be sent (known: {sorted(ITEMSIZE)})")
        n = math.prod(shape) * ITEMSIZE[dtype]
        if n > bucket_bytes:
            # oversized: a bucket of its own, exactly its size; the open bucket stays open
            buckets.append(n)
            tensors.append(TensorSpec(name, dtype, list(shape), len(buckets) - 1, 0))
            continue
        off = _aligned(buckets[open_idx]) if open_idx is not None else 0
        if open_idx is None or off + n > bucket_bytes:
            buckets.append(0)
            open_idx, off = len(buckets) - 1, 0
        tensors.append(TensorSpec(name, dtype, list(shape), open_idx, off))
        buckets[open_idx] = off + n
    return Manifest(buckets, tensors)


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


def pack(manifest: Manifest, tensors: Sequence["torch.Tensor"], out: Sequence["torch.Tensor"] | None = None) -> list:
    """Flat uint8 CPU buckets holding `tensors` (in manifest order) at their planned offsets.

    `out`: buckets of a previous round to overwrite when their sizes match (fresh host memory
    costs a page fault per 4 KiB on first touch: more than the copy itself).
    """
    import torch

    if out is not None and [b.numel() for b in out] == list(manifest.buckets):
        buckets = list(out)
    else:
        buckets = [torch.empty(n, dtype=torch.uint8) for n in manifest.buckets]
    for spec, t in zip(manifest.tensors, tensors, strict=True):
        src = t.detach()
        if src.device.type != "cpu":
            src = src.cpu()
        # (numel,) bytes of the tensor; contiguous() copies only when the source is strided
        buckets[spec.bucket][spec.offset:spec.offset + spec.nbytes].copy_(src.contiguous().view(-1).view(torch.uint8))
    return buckets


def tensor_view(t, bucket: "torch.Tensor") -> "torch.Tensor":
    """Manifest entry `t`'s tensor as it lies in `bucket` (its bucket's bytes, wherever they are)."""
    return bucket[t.offset:t.offset + t.nbytes].view(torch_dtype(t.dtype)).view(t.shape)


def unpack(manifest: Manifest, buckets: Sequence["torch.Tensor"]) -> list[tuple[str, "torch.Tensor"]]:
    """`(name, tensor)` views into `buckets` (any device), in manifest order."""
    return [(t.name, tensor_view(t, buckets[t.bucket])) for t in manifest.tensors]


def sent(manifest: Manifest) -> list[int]:
    """The buckets a round moves, in order, one collective each: every non-empty one, whole (both
    ends hold the version as flat buckets, so a bucket goes out as it is and lands where it belongs)."""
    return [b for b, n in enumerate(manifest.buckets) if n]


def as_bytes(t: "torch.Tensor") -> "torch.Tensor":
    """(nbytes,) uint8 view of a tensor (a copy only when it is strided)."""
    import torch

    return t.detach().contiguous().view(-1).view(torch.uint8)


def targets(manifest: Manifest, buffers: Sequence["torch.Tensor"]) -> list:
    """The buffers of `sent(manifest)`: what the sender sends from, or a member receives into."""
    return [buffers[b] for b in sent(manifest)]


def sync_device(device) -> None:
    """Wait for what is queued on `device` (CUDA: copies into or out of buckets there) before its
    buffers are read or written again; nothing elsewhere."""
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def _same(spec: TensorSpec, name: str, t: "torch.Tensor") -> bool:
    return spec.name == name and spec.shape == list(t.shape) and spec.dtype == dtype_name(t.dtype)


def gather(named_tensors: Iterable[tuple[str, "torch.Tensor"]], bucket_bytes: int,
           prev: tuple[Manifest, list] | None = None) -> tuple[Manifest, list]:
    """A version as flat CPU buckets, `(manifest, buckets)`, from `(name, tensor)` pairs.

    Each tensor is copied as it arrives, before the next is asked for, so an iterator may hand out
    a view that lives only until then (a ZeRO-3 parameter gathered for the moment, a live
    parameter). When the tensors are `prev`'s, in its order (every publish of a run after the
    first), they are copied straight into `prev`'s buckets, which come back: one copy in all, and
    the round sends the buckets as they are. Otherwise (the first publish, or another model) each is
    copied aside, then planned and packed into new buckets.
    """
    import torch

    manifest, buckets = prev if prev is not None else (None, None)
    expected = manifest.tensors if manifest is not None else []
    i = 0
    aside: list | None = None if expected else []  # (name, own copy) once the layout does not hold
    for name, t in named_tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name!r}: expected a torch.Tensor, got {type(t).__name__}")
        try:
            dtype_name(t.dtype)
        except ValueError as e:
            raise ValueError(f"{name!r}: {e}") from None
        if aside is None and i < len(expected) and _same(expected[i], name, t):
            e = expected[i]
            buckets[e.bucket][e.offset:e.offset + e.nbytes].copy_(as_bytes(t))
            i += 1
            continue
        if aside is None:  # the layout does not hold: what was copied so far is kept as views
            aside = unpack(Manifest(manifest.buckets, expected[:i]), buckets)
        aside.append((name, t.detach().to("cpu", copy=True)))
    if aside is None and i == len(expected):
        return manifest, buckets
    if aside is None:  # fewer tensors than before
        aside = unpack(Manifest(manifest.buckets, expected[:i]), buckets)
    manifest = plan([(n, dtype_name(t.dtype), list(t.shape)) for n, t in aside], bucket_bytes)
    return manifest, pack(manifest, [t for _, t in aside])


def total_bytes(manifest: Manifest) -> int:
    return manifest.total_bytes
