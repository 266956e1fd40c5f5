"""Same-host transfer: the sender writes each version once into shared memory; generators on its
host copy it from there instead of joining the round's broadcast.

The segment is a file in `/dev/shm` that both ends map (`torch.from_file(shared=True)`). The
sender unlinks it as soon as it is mapped, so its memory is freed when the sender's process ends
(even by SIGKILL); members open it as `/proc/<sender pid>/fd/<fd>` (same host, same pid namespace
and user; any other member takes the broadcast):

    bytes [0, 4096)        header, int64 words: MAGIC, nonce (2 words), then per slot s in {0, 1}:
                           seq_s, version_s (at words 3 + 2s, 4 + 2s)
    slot 0, slot 1         one version each, laid out as the manifest's buckets one after another
                           (bucket i at `bases(manifest)[i]`)

Version v is written into slot v % 2 under a seqlock: the writer makes seq_s odd, writes the
bytes, sets version_s, makes seq_s even again. A reader copies the slot into its own buckets and
accepts the copy only if seq_s was even, unchanged from before to after the copy, and version_s
is the round's version: a half-written version is never loaded. With two slots a reader of v is
disturbed only when the writer laps it (writes v + 2 while the reader still copies v); it then
raises `RoundMissed` and catches up at the next poll.

Who takes this path: the round's `RoundInfo.shm` names the segment, its nonce and the sender's
host identity (`host_id`: hostname and boot id). A member takes it when its own host identity is
the same and the segment it can open carries the same nonce (a container on the same host with a
private `/dev/shm` sees no such file and joins the broadcast). `weight_sync.same_host` forces
either side: `broadcast` never offers the segment, `shm` makes a same-host member that cannot
open it fail instead of falling back.

GPU: a sender whose learner runs on CUDA (backend nccl) moves the slot to its device once a
round's member asks for that when it joins (a CUDA member that sees the sender's device, whose
UUID the header carries, or a member on the sender's very GPU, which no NCCL group can hold:
`route`); a CPU member or one reading the host file never moves it (`Segment.served`). Then it
keeps one slot there, and the file holds the header alone: the round's `SameHost.ipc` carries a
CUDA IPC handle of the slot (`cuda_ipc_handle`: torch's own `reduce_tensor` fields,
msgpack-encoded, the device named by its UUID, as colocated trainers share weights with their
engines), and a member on a CUDA device of the same host maps it (`open_cuda_ipc`, once per
segment) and copies the version device to device (a vLLM worker straight into its weights,
`slot.load_in_place`), under the same seqlock. A member that cannot map it
(a CPU member, a device it cannot reach) takes the broadcast. A CPU slot serves CUDA members too:
they copy it host to device.
"""

from __future__ import annotations

import os
import secrets
import socket
from typing import NamedTuple, Sequence

from weight_sync import buckets as bk
from weight_sync.round import RoundMissed

MAGIC = 0x434F4E5659575331  # "CONVYWS1"
HEADER = 4096  # bytes
_SEQ, _VERSION = 3, 4  # word of slot 0's seq and version; slot s adds 2s
_UUID, UUID_BYTES = 1024, 64  # bytes of the header: the sender's CUDA device UUID, utf-8, zero-padded


def host_id() -> str:
    """This machine's identity: hostname and kernel boot id (two containers of one host agree)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def slot_device(backend: str):
    """Where a sender's same-host slot may move (`Segment.served`): its CUDA device when it sends
    over NCCL (members that asked for it map it by CUDA IPC); None: the slot stays in the file."""
    if backend != "nccl":
        return None
    import torch

    return torch.device("cuda", torch.cuda.current_device())


def device_uuid(device) -> str:
    """A CUDA device's UUID as torch names it (`get_device_properties(i).uuid`): the same string in
    every process of the host, whatever its `CUDA_VISIBLE_DEVICES` (indices are not); "" for a
    device that is not CUDA."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return ""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return str(torch.cuda.get_device_properties(index).uuid)


def visible_uuids() -> set[str]:
    """The UUIDs of this process's CUDA devices (empty without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return set()
    return {str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())}


# How a member takes a round (`route`)
IPC, SHM, BROADCAST, REFUSE = "ipc", "shm", "broadcast", "refuse"


def route(backend: str, same_device: bool, shm_usable: bool, ipc_usable: bool) -> str:
    """How a member takes a round: from the sender's device slot (`IPC`), from its host slot
    (`SHM`), through the group's broadcast (`BROADCAST`), or not at all (`REFUSE`).

    `same_device`: the member's engine is on the very GPU of the sender (their CUDA UUIDs are
    equal). NCCL refuses two ranks of one communicator on one device (its communicator set-up
    fails), so such a member never joins an NCCL group: it takes a slot, or nothing (and
    the sender says why, `same_device_error`). Gloo moves host tensors and has no such rule. A
    slot is preferred whenever one is usable: it costs no group set-up, and the device slot is a
    device-to-device copy.

        backend  same_device  shm  ipc  ->
        any      any          any  yes     ipc
        any      any          yes  no      shm
        nccl     yes          no   no      refuse
        nccl     no           no   no      broadcast
        gloo     any          no   no      broadcast
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"route: backend {backend!r} has no group (gloo or nccl)")
    if ipc_usable:
        return IPC
    if shm_usable:
        return SHM
    if backend == "nccl" and same_device:
        return REFUSE
    return BROADCAST


def same_device_error(rank: int, uuid: str, shm_dir: str, slot_bytes: int, device_slot_tried: bool) -> str:
    """What a member refused by `route` is told: why, and the settings that fix it."""
    how = ("it did not map the sender's device slot by CUDA IPC (run it in the learner's container, or "
           "with docker --ipc=host)" if device_slot_tried else
           "no device slot could be made on the learner's GPU")
    return (f"rank {rank}: its engine is on GPU {uuid}, the GPU of learner rank 0, and NCCL refuses two ranks "
            f"on one device, so it cannot take the broadcast; it needs the same-host slot instead, but "
            f"{shm_dir} has no room for the host slot ({slot_bytes} bytes a version, two versions) and {how}. "
            f"Fix: give {shm_dir} room (Docker: --shm-size), put the generator on another GPU, or set "
            f"weight_sync.backend=gloo")


def bases(manifest: bk.Manifest) -> list[int]:
    """Byte offset of each bucket inside a slot (buckets back to back, each `bk.ALIGN`-aligned)."""
    out, pos = [], 0
    for n in manifest.buckets:
        out.append(pos)
        pos += (n + bk.ALIGN - 1) // bk.ALIGN * bk.ALIGN
    return out + [pos]


def _map(path: str, nbytes: int):
    import torch

    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


class Segment:
    """The sender's segment: created for a slot size, written once per version."""

    def __init__(self, folder: str = "/dev/shm", tag: str = "ws", device=None, then=None, uuid: str = ""):
        """`device`: a CUDA device to keep the slot on (shared by CUDA IPC); None: in the file.
        `then`: the device the slot moves to once a round's member asked for a device slot
        (`served`): a model's worth of the learner's device memory is spent only for a member
        that maps it. `uuid`: the sender's CUDA device UUID, written into the header, where a
        member reads it (`sender_uuid`) to tell whether it could map a device slot."""
        self.folder, self.tag, self.device, self.then, self.uuid = folder, tag, device, then, uuid
        self.slots = 1 if device is not None else 2
        self.ipc = b""  # the device slot's CUDA IPC handle (`cuda_ipc_handle`)
        self._dev = None
        self.path = ""
        self.nonce = 0
        self.slot_bytes = 0
        self._mem = None
        self._fd: int | None = None
        self.written: int | None = None  # the last version written
        self.direct = False  # the sender's gather writes into the slot itself (`begin`/`end`)
        self._open: tuple[int, int] | None = None  # (slot, version) being gathered into

    def ensure(self, manifest: bk.Manifest) -> None:
        """A segment whose slots hold `manifest` (a new file, new nonce, when the size changes)."""
        import torch

        need = bases(manifest)[-1]
        if self._mem is not None and need == self.slot_bytes:
            return
        self.close()
        size = HEADER + (0 if self.device is not None else self.slots * need)
        st = os.statvfs(self.folder)
        if st.f_bavail * st.f_frsize < size:
            # a tmpfs without room would fail the writer's page faults with SIGBUS, not an error
            raise OSError(f"{self.folder} has {st.f_bavail * st.f_frsize} bytes free, the segment needs {size}")
        if self.device is not None:
            self._dev = torch.empty(need, dtype=torch.uint8, device=self.device)
            self.ipc = cuda_ipc_handle(self._dev) if self._dev.is_cuda else b""
        self.nonce = secrets.randbits(62)
        name = os.path.join(self.folder, f"conveyor-{self.tag}-{os.getpid()}-{self.nonce:x}")
        self._fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(self._fd, size)
            self._mem = _map(name, size)
        finally:
            # unlinked at once: the memory goes back when this process ends, however it ends;
            # readers open it through this process's descriptor
            os.unlink(name)
        self.path = f"/proc/{os.getpid()}/fd/{self._fd}"
        self.slot_bytes, self.direct = need, False
        words = self._mem[:HEADER].view(torch.int64)
        words[0], words[1], words[2] = MAGIC, self.nonce, 0
        for s in (0, 1):
            words[_SEQ + 2 * s], words[_VERSION + 2 * s] = 0, -1
        uuid = self.uuid.encode()[:UUID_BYTES]
        if uuid:
            self._mem[_UUID:_UUID + len(uuid)].copy_(torch.tensor(list(uuid), dtype=torch.uint8))
        self.written = None

    def write(self, version: int, manifest: bk.Manifest, buckets: Sequence) -> float:
        """Version `version` into slot version % 2 (`buckets`: the sender's, `bk.gather`'s)."""
        import time

        import torch

        t0 = time.monotonic()
        self.ensure(manifest)
        s = self._start(version)
        slot = self._dev if self._dev is not None else self._slot(s)
        base = bases(manifest)
        for b in bk.sent(manifest):
            slot[base[b]:base[b] + manifest.buckets[b]].copy_(buckets[b], non_blocking=True)
        if self._dev is not None and self._dev.is_cuda:
            torch.cuda.synchronize(self._dev.device)  # the bytes are on the device before the version says so
        self._finish(s, version)
        return time.monotonic() - t0

    def _slot(self, s: int):
        return self._mem[HEADER + s * self.slot_bytes:HEADER + (s + 1) * self.slot_bytes]

    def _start(self, version: int) -> int:
        """Slot `version % slots` marked being written (odd seq); returns its index."""
        import torch

        s = version % self.slots
        self._mem[:HEADER].view(torch.int64)[_SEQ + 2 * s] += 1
        return s

    def _finish(self, s: int, version: int) -> None:
        """Slot `s` complete (even seq), holding `version` (-1: none)."""
        import torch

        words = self._mem[:HEADER].view(torch.int64)
        words[_VERSION + 2 * s] = version
        words[_SEQ + 2 * s] += 1
        if version >= 0:
            self.written = version

    def served(self, device_wanted: bool = False) -> None:
        """A round had same-host members. `device_wanted`: one of them asked for a device slot
        (a CUDA member that sees the sender's device, `RoundStore.join`'s `ipc`, or one on the
        sender's very GPU, which only a slot can serve: `route`). Then, from the next round, the
        slot is on `then` (if set: a model's worth of the learner's device memory, made by the
        next `ensure`). Otherwise it stays in the file, and the sender gathers each version
        straight into a host slot (`begin`), its pages reserved now (a tmpfs that fills up later
        would otherwise kill the sender with SIGBUS mid-copy). A CPU member, or one reading the
        host file, never moves the slot to the device."""
        if device_wanted and self.then is not None and self.device is None:
            self.close()
            self.device, self.slots = self.then, 1
        elif self.device is None and not self.direct and self._fd is not None:
            try:
                os.posix_fallocate(self._fd, 0, HEADER + self.slots * self.slot_bytes)
                self.direct = True
            except OSError:
                pass  # no room: the slot keeps being written per round, as long as that fits

    def begin(self, version: int, manifest: bk.Manifest) -> list | None:
        """Slot `version % slots` as `manifest`'s buckets, marked being written, for the sender's
        gather to fill (then `end`); None unless the segment is `direct` and sized for `manifest`."""
        if not self.direct or self._mem is None or bases(manifest)[-1] != self.slot_bytes:
            return None
        s = self._start(version)
        self._open = (s, version)
        slot = self._slot(s)
        return [slot[b:b + n] for b, n in zip(bases(manifest), manifest.buckets)]

    def end(self, ok: bool) -> None:
        """The gather into the slot `begin` gave is over: the version is complete (`ok`), or the
        slot holds no version (the learner's tensors did not fit the layout, or it failed)."""
        s, version = self._open
        self._open = None
        self._finish(s, version if ok else -1)

    def close(self) -> None:
        self._mem = self._dev = None
        self.ipc = b""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.path = ""


def sender_uuid(shm) -> str:
    """The sender's CUDA device UUID written in segment `shm`'s header ("": none, or no such
    segment here)."""
    try:
        if shm is None or not os.path.isfile(shm.path):
            return ""
        import torch

        head = _map(shm.path, HEADER)
        words = head[:HEADER].view(torch.int64)
        if int(words[0]) != MAGIC or int(words[1]) != shm.nonce:
            return ""
        raw = bytes(head[_UUID:_UUID + UUID_BYTES].tolist())
    except (OSError, RuntimeError):
        return ""
    return raw.rstrip(b"\0").decode("utf-8", "replace")


def usable(shm, device="cpu") -> bool:
    """Whether this member, receiving onto `device`, can take a round through the segment `shm` (a
    `messages.SameHost`); with `shm.force`, a same-host member that cannot raises `RoundMissed`."""
    import torch

    if shm is None or shm.host != host_id():
        return False
    try:  # (mapping a missing file would create it)
        if not os.path.isfile(shm.path):
            raise OSError(f"no file {shm.path}")
        words = _map(shm.path, HEADER)[:HEADER].view(torch.int64)
        ok = int(words[0]) == MAGIC and int(words[1]) == shm.nonce
        if ok and shm.ipc:  # the slot is on the sender's device: a CUDA member maps it
            ok = str(device).startswith("cuda") and _device_slot(shm) is not None
    except (OSError, RuntimeError):
        ok = False
    if not ok and shm.force:
        raise RoundMissed(f"weight_sync.same_host='shm' but segment {shm.path} cannot be used here")
    return ok


_OPENED: dict[tuple[str, int], object] = {}  # (path, nonce) -> the mapped device slot, or None if it failed


def _device_slot(shm):
    """The sender's device slot behind `shm.ipc`, mapped once per segment; None if it cannot be."""
    key = (shm.path, shm.nonce)
    if key not in _OPENED:
        try:
            _OPENED.clear()  # an older segment's mapping goes (the sender made a new one)
            _OPENED[key] = open_cuda_ipc(shm.ipc)
        except Exception:  # another container's device, no CUDA here, a handle from another torch
            _OPENED[key] = None
    return _OPENED[key]


_MAPPED: dict[tuple[str, int], object] = {}  # (path, nonce) -> this member's mapping of a host segment


def _mapping(shm, nbytes: int):
    """This member's mapping of the host segment `shm`, kept between rounds: a fresh mapping of a
    model's slot costs a page fault per 4 KiB at first touch (~a third of the copy itself). Mapping
    another segment drops the last one (the sender made a new one)."""
    key = (shm.path, shm.nonce)
    mem = _MAPPED.get(key)
    if mem is None or mem.numel() < nbytes:
        _MAPPED.clear()
        mem = _MAPPED[key] = _map(shm.path, nbytes)
    return mem


class SlotRead(NamedTuple):
    """A complete version found in a host slot: its buckets as views of the slot (no copy). Valid
    as long as `intact` says so after they were read."""
    version: int
    buckets: list
    slot: int
    seq: int


def _words(shm, manifest: bk.Manifest):
    """This member's mapping of segment `shm` and its header words (a device slot's file is the
    header alone)."""
    import torch

    mem = _mapping(shm, HEADER + (0 if shm.ipc else 2 * bases(manifest)[-1]))
    return mem, mem[:HEADER].view(torch.int64)


def open_slot(shm, version: int, manifest: bk.Manifest) -> SlotRead:
    """Version `version` where it lies in segment `shm` (its host slot, or the sender's device
    slot); raises `RoundMissed` when the slot does not hold a complete copy of it, or the device
    slot cannot be mapped here. Read the views, then ask `intact`."""
    mem, words = _words(shm, manifest)
    s = version % (1 if shm.ipc else 2)
    seq, held = int(words[_SEQ + 2 * s]), int(words[_VERSION + 2 * s])
    if seq % 2 or held != version:
        raise RoundMissed(f"shared-memory slot {s} holds v{held} (seq {seq}), not v{version}")
    base = bases(manifest)
    data, start = (_device_slot(shm), 0) if shm.ipc else (mem, HEADER + s * base[-1])
    if data is None or data.numel() < start + base[-1]:
        raise RoundMissed(f"the device slot of segment {shm.path} cannot be mapped here")
    return SlotRead(version, [data[start + b:start + b + n] for b, n in zip(base, manifest.buckets)], s, seq)


def intact(shm, read: SlotRead, manifest: bk.Manifest) -> bool:
    """Whether the slot of `read` was left alone since it was opened (the seqlock's second look)."""
    return int(_words(shm, manifest)[1][_SEQ + 2 * read.slot]) == read.seq


def newest(shm, manifest: bk.Manifest, at_least: int) -> SlotRead | None:
    """The newest complete version >= `at_least` in the segment's slots (None: none is), to load
    again after a read the sender overwrote."""
    _, words = _words(shm, manifest)
    held = sorted(((int(words[_VERSION + 2 * s]), s) for s in range(1 if shm.ipc else 2)
                   if int(words[_SEQ + 2 * s]) % 2 == 0), reverse=True)
    for version, _ in held:
        if version >= at_least:
            try:
                return open_slot(shm, version, manifest)
            except RoundMissed:  # the writer started on it meanwhile
                continue
    return None


def read(shm, version: int, manifest: bk.Manifest, buffers: Sequence) -> None:
    """Copy version `version` out of the segment into `buffers` (one per bucket); raises
    `RoundMissed` when the slot does not hold a complete copy of that version."""
    import torch

    slot = open_slot(shm, version, manifest)
    for view, buf in zip(slot.buckets, buffers):
        buf.copy_(view, non_blocking=True)
    if shm.ipc or any(b.is_cuda for b in buffers):
        torch.cuda.synchronize()  # copied before the seq is read again
    if not intact(shm, slot, manifest):
        raise RoundMissed(f"v{version} was overwritten in shared memory while it was being read")


def cuda_ipc_handle(tensor) -> bytes:
    """A CUDA tensor's IPC handle as bytes another process of this host opens with `open_cuda_ipc`:
    the fields of torch's `reduce_tensor` (what `torch.multiprocessing` pickles), msgpack-encoded,
    with the device named by its UUID (device indices differ between processes' visible devices)."""
    import msgspec
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    _, (_cls, size, stride, offset, _scls, dtype, device, handle, size_bytes, offset_bytes, _grad,
        ref_handle, ref_offset, event_handle, event_sync) = reduce_tensor(tensor.detach())
    if dtype != torch.uint8 or list(stride) != [1]:
        raise ValueError("a flat uint8 tensor is shared")
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return msgspec.msgpack.encode([uuid, list(size), offset, handle, size_bytes, offset_bytes, ref_handle,
                                   ref_offset, event_handle, bool(event_sync)])


def open_cuda_ipc(blob: bytes):
    """The sender's device tensor behind `blob` (`cuda_ipc_handle`), mapped into this process with
    no copy; raises when no device of this process has the sender's UUID."""
    import msgspec
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    uuid, size, offset, handle, size_bytes, offset_bytes, ref_handle, ref_offset, event_handle, event_sync = \
        msgspec.msgpack.decode(blob)
    devices = [i for i in range(torch.cuda.device_count()) if str(torch.cuda.get_device_properties(i).uuid) == uuid]
    if not devices:
        raise RuntimeError(f"no visible CUDA device is {uuid}")
    return rebuild_cuda_tensor(torch.Tensor, torch.Size(size), (1,), offset, torch.UntypedStorage, torch.uint8,
                               devices[0], handle, size_bytes, offset_bytes, False, ref_handle, ref_offset,
                               event_handle, event_sync)
