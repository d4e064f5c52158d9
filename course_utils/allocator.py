"""PyTorch's CUDA caching allocator, simulated in plain Python, and its out-of-memory message, read.

A small model of ``c10/cuda/CUDACachingAllocator.cpp``: each rule names the constant or function of that file it
copies. It replays an allocation trace (``Timeline.trace()``, or a snapshot's: ``snapshot_trace()``) and reports
requested, allocated and reserved bytes over time, on any machine. Not modelled: streams and events, CUDA graph pools,
``roundup_power2_divisions``, ``garbage_collection_threshold``.
"""
from __future__ import annotations

import itertools
import os
import re
from dataclasses import dataclass, field

from .hardware import CUDA_CONTEXT_BYTES
from .paths import data_file
from .units import GIB, KIB, MIB
from .validation import byte_counts, positive_int

# The constants at the top of CUDACachingAllocator.cpp
K_MIN_BLOCK_SIZE = 512        # kMinBlockSize: all sizes are rounded to at least 512 bytes
K_SMALL_SIZE = 1 * MIB        # kSmallSize: the largest "small" allocation is 1 MiB
K_SMALL_BUFFER = 2 * MIB      # kSmallBuffer: "small" allocations are packed in 2 MiB segments
K_LARGE_BUFFER = 20 * MIB     # kLargeBuffer: allocations between 1 and 10 MiB may use 20 MiB segments
K_MIN_LARGE_ALLOC = 10 * MIB  # kMinLargeAlloc
K_ROUND_LARGE = 2 * MIB       # kRoundLarge: larger allocations are rounded up to 2 MiB
_ADDRESS_SPACE = 1 << 46      # an expandable segment reserves far more addresses than a card has bytes


def round_size(nbytes: int) -> int:
    """round_size(): a request rounded up to a multiple of kMinBlockSize (512 bytes)."""
    return max(K_MIN_BLOCK_SIZE, -(-nbytes // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE)


def allocation_size(size: int) -> int:
    """get_allocation_size(): the new segment cudaMalloc asks the driver for when no cached block fits."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


@dataclass(eq=False)
class Block:
    addr: int
    size: int
    segment: Segment = field(repr=False)
    allocated: bool = False
    mapped: bool = True  # False: addresses of an expandable segment with no memory behind them
    requested: int = 0


@dataclass(eq=False)
class Segment:
    addr: int
    small: bool
    expandable: bool = False
    blocks: list[Block] = field(default_factory=list)  # in address order, covering the segment

    size = property(lambda self: sum(b.size for b in self.blocks if b.mapped))


class OutOfMemory(RuntimeError):
    """The simulated allocator ran out; ``str()`` is the message PyTorch would print."""


@dataclass
class CachingAllocator:
    """Segments (memory from cudaMalloc) cut into blocks, allocated or cached."""

    capacity: int | None = None
    max_split_size: int | None = None
    expandable_segments: bool = False
    segments: list[Segment] = field(default_factory=list)
    live: dict = field(default_factory=dict)     # key -> allocated Block
    events: list = field(default_factory=list)   # (action, address, bytes), in the snapshot format's words
    peak_allocated: int = 0
    peak_reserved: int = 0
    num_alloc_retries: int = 0
    num_ooms: int = 0
    _next_addr: int = 1 << 32
    # running sums, kept as each block and segment changes: memory_allocated(): bytes of allocated blocks (rounded
    # sizes and unsplit remainders included); memory_reserved(): bytes of all segments, allocated or cached
    allocated: int = field(default=0, init=False)
    reserved: int = field(default=0, init=False)

    def __post_init__(self):
        for name in ("capacity", "max_split_size"):
            if getattr(self, name) is not None:
                positive_int(getattr(self, name), name, "a number of bytes, or None")
        if not isinstance(self.expandable_segments, bool):
            raise TypeError(f"expandable_segments must be True or False, not {self.expandable_segments!r}.")

    def memory_stats(self) -> dict:
        """A few of torch.cuda.memory_stats()'s counters, under the same names."""
        return {"allocated_bytes.all.current": self.allocated, "allocated_bytes.all.peak": self.peak_allocated,
                "reserved_bytes.all.current": self.reserved, "reserved_bytes.all.peak": self.peak_reserved,
                "requested_bytes.all.current": sum(b.requested for b in self.live.values()),
                "inactive_split_bytes.all.current": sum(b.size for s in self.segments if len(s.blocks) > 1
                                                        for b in s.blocks if b.mapped and not b.allocated),
                "num_alloc_retries": self.num_alloc_retries, "num_ooms": self.num_ooms}

    def malloc(self, nbytes: int, key=None) -> Block:
        """malloc(): a cached block, else a new segment, else free cached segments and retry, else OOM."""
        byte_counts(nbytes=nbytes)
        key = len(self.events) if key is None else key
        if key in self.live:
            raise ValueError(f"key {key!r} is already allocated; free it first or use a new key.")
        size = round_size(nbytes)
        small = size <= K_SMALL_SIZE  # get_pool(): small and large requests never share a segment
        block = (self._cached_block(size, small) or self._new_block(size, small)
                 or (self._release(size, small, oversize_only=True) and self._new_block(size, small))
                 or (self._release(size, small) and self._new_block(size, small)))
        if not block:
            self.num_ooms += 1
            raise OutOfMemory(oom_message(allocation_size(size), total=self.capacity or 0, allocated=self.allocated,
                                          free=(self.capacity or 0) - self.reserved, reserved=self.reserved,
                                          this_process=self.reserved))
        if self._should_split(block, size):  # alloc_found_block(): the remainder stays cached
            blocks = block.segment.blocks
            blocks.insert(blocks.index(block) + 1, Block(block.addr + size, block.size - size, block.segment))
            block.size = size
        block.allocated, block.requested = True, nbytes
        self.live[key], self.allocated = block, self.allocated + block.size
        self.events.append(("alloc", block.addr, nbytes))
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def free(self, key) -> None:
        """free() and free_block(): the block goes back to the cache, merged with free neighbours; still reserved."""
        if key not in self.live:
            raise KeyError(f"key {key!r} is not allocated (freed twice, or never allocated).")
        block = self.live.pop(key)
        self.allocated -= block.size
        self.events += [("free_requested", block.addr, block.requested), ("free_completed", block.addr, block.requested)]
        block.allocated, block.requested = False, 0
        self._merge(block)

    def empty_cache(self) -> int:
        """torch.cuda.empty_cache(): release_cached_blocks(). Returns the bytes given back to the driver."""
        before = self.reserved
        self._release(0, None)
        return before - self.reserved

    def _cached_block(self, size: int, small: bool) -> Block | None:
        """get_free_block(): the smallest cached block that fits (best fit; ties to the lowest address)."""
        fits = [b for s in self.segments if s.small == small for b in s.blocks
                if b.mapped and not b.allocated and b.size >= size]
        block = min(fits, key=lambda b: (b.size, b.addr), default=None)
        limit = self.max_split_size
        if block and limit and size < limit <= block.size:
            return None  # "Do not return an oversized block for a large request"
        if block and limit and size >= limit and block.size >= size + K_LARGE_BUFFER:  # max_non_split_rounding_mb
            return None  # "Allow oversized block size to be rounded up but within a limit"
        return block

    def _should_split(self, block: Block, size: int) -> bool:
        """should_split(): small pool or expandable: any remainder >= 512 B; large pool: over 1 MiB, not oversize."""
        remaining = block.size - size
        if block.segment.small or block.segment.expandable:
            return remaining >= K_MIN_BLOCK_SIZE
        return (self.max_split_size is None or size < self.max_split_size) and remaining > K_SMALL_SIZE

    def _new_block(self, size: int, small: bool) -> Block | None:
        """alloc_block(): a new segment of get_allocation_size() bytes, if the card (or the cap) has room."""
        if self.expandable_segments:
            return self._expand(size, small)
        alloc = allocation_size(size)
        if self.capacity is not None and self.reserved + alloc > self.capacity:
            return None
        segment = Segment(self._next_addr, small)
        segment.blocks.append(Block(segment.addr, alloc, segment))
        self._next_addr += -(-alloc // K_SMALL_BUFFER) * K_SMALL_BUFFER
        self.segments.append(segment)
        self.reserved += alloc
        self.events.append(("segment_alloc", segment.addr, alloc))
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return segment.blocks[0]

    def _expand(self, size: int, small: bool) -> Block | None:
        """try_allocate_expandable_block(): one segment per pool, mapped page by page (2 MiB small, 20 MiB large)
        at the lowest address where free and unmapped space together fit the request (find_expandable_block())."""
        page = K_SMALL_BUFFER if small else K_LARGE_BUFFER
        segment = next((s for s in self.segments if s.expandable and s.small == small), None)
        if segment is None:
            segment = Segment(self._next_addr, small, expandable=True)
            segment.blocks.append(Block(segment.addr, _ADDRESS_SPACE, segment, mapped=False))
            self._next_addr += _ADDRESS_SPACE
            self.segments.append(segment)
        blocks = segment.blocks
        for i, b in enumerate(blocks):
            start = i - 1 if i and not blocks[i - 1].allocated else i
            if not b.mapped and sum(x.size for x in itertools.takewhile(lambda x: not x.allocated, blocks[start:])) >= size:
                break
        plan, covered = [], 0  # map_block(): whole pages, just enough of them
        for b in itertools.takewhile(lambda _: covered < size, blocks[start:]):
            plan.append((b, b.size if b.mapped else min(b.size, -(-(size - covered) // page) * page)))
            covered += plan[-1][1]
        if self.capacity is not None and self.reserved + sum(n for b, n in plan if not b.mapped) > self.capacity:
            return None
        for b, n in plan:
            if not b.mapped:
                if n < b.size:
                    blocks.insert(blocks.index(b) + 1, Block(b.addr + n, b.size - n, segment, mapped=False))
                    b.size = n
                b.mapped, self.reserved = True, self.reserved + n
                self.events.append(("segment_map", b.addr, n))
        blocks[start:start + len(plan)] = [Block(plan[0][0].addr, covered, segment)]
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return blocks[start]

    def _release(self, size: int, small: bool | None, oversize_only: bool = False) -> bool:
        """release_cached_blocks(): give the driver every cached segment with no block in use, and with expandable
        segments every free page (unmap_block()); counted in num_alloc_retries. With ``oversize_only``,
        release_available_cached_blocks(): cached oversize segments only (max_split_size), the smallest that
        covers the request, else the largest ones until they do."""
        before = self.reserved
        cached = [s for s in self.segments if not s.expandable and len(s.blocks) == 1 and not s.blocks[0].allocated]
        if oversize_only:
            if not self.max_split_size:
                return False
            target = max(size, self.max_split_size)
            big = sorted((s for s in cached if s.small == small and s.size >= self.max_split_size), key=lambda s: -s.size)
            cached = [s for s in big if s.size >= target][-1:] or \
                [s for i, s in enumerate(big) if sum(x.size for x in big[:i]) < target]
        else:
            self.num_alloc_retries += small is not None
        for s in cached:
            self.segments.remove(s)
            self.reserved -= s.size
            self.events.append(("segment_free", s.addr, s.size))
        for s in [] if oversize_only else [s for s in self.segments if s.expandable]:
            for b in [b for b in s.blocks if b.mapped and not b.allocated]:
                self._unmap(b, K_SMALL_BUFFER if s.small else K_LARGE_BUFFER)
        return before - self.reserved >= target if oversize_only else True  # then malloc() tries once more

    def _unmap(self, block: Block, page: int) -> None:
        """unmap_block(): give back the whole pages inside a free block of an expandable segment."""
        base = block.segment.addr
        lo = base + -(-(block.addr - base) // page) * page
        hi = base + (block.addr + block.size - base) // page * page
        if hi > lo:
            blocks, i = block.segment.blocks, block.segment.blocks.index(block)
            parts = [Block(block.addr, lo - block.addr, block.segment), Block(lo, hi - lo, block.segment, mapped=False),
                     Block(hi, block.addr + block.size - hi, block.segment)]
            blocks[i:i + 1] = [p for p in parts if p.size]
            self.reserved -= hi - lo
            self.events.append(("segment_unmap", lo, hi - lo))
            self._merge(parts[1])

    def _merge(self, block: Block) -> None:
        """try_merge_blocks(): join a free block with its free neighbours (both mapped, or both unmapped)."""
        blocks = block.segment.blocks
        for other in [blocks[j] for j in (blocks.index(block) - 1, blocks.index(block) + 1) if 0 <= j < len(blocks)]:
            if not other.allocated and other.mapped == block.mapped:
                block.addr, block.size = min(block.addr, other.addr), block.size + other.size
                blocks.remove(other)

    def segments_snapshot(self) -> list[dict]:
        """The segments (mapped parts) in the format of torch.cuda.memory._snapshot()['segments']."""
        out = []
        for s in self.segments:
            for mapped, run in itertools.groupby(s.blocks, key=lambda b: b.mapped):
                run = list(run)
                if mapped:
                    used = [b for b in run if b.allocated]
                    out.append({"device": 0, "address": run[0].addr, "total_size": sum(b.size for b in run), "stream": 0,
                                "segment_type": "small" if s.small else "large", "is_expandable": s.expandable,
                                "allocated_size": sum(b.size for b in used), "active_size": sum(b.size for b in used),
                                "requested_size": sum(b.requested for b in used), "frames": [],
                                "blocks": [{"address": b.addr, "size": b.size, "requested_size": b.requested, "frames": [],
                                            "state": "active_allocated" if b.allocated else "inactive"} for b in run]})
        return out


def options_from_env(conf: str | None = None) -> dict:
    """CachingAllocator options from PYTORCH_CUDA_ALLOC_CONF, e.g. 'expandable_segments:True,max_split_size_mb:128'."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_ALLOC_CONF", "")) if conf is None else conf
    settings = dict(item.split(":", 1) for item in conf.replace(" ", "").split(",") if ":" in item)
    options = {"expandable_segments": True} if settings.get("expandable_segments", "").lower() == "true" else {}
    if settings.get("max_split_size_mb", "").isdigit():
        options["max_split_size"] = int(settings["max_split_size_mb"]) * MIB
    return options


def replay(trace, **options):
    """Replay ``(action, key, bytes)`` events ('alloc' or 'free', as ``Timeline.trace()`` gives) in a simulated allocator."""
    import pandas as pd

    sim, rows, requested = CachingAllocator(**options), [], 0
    for action, key, nbytes in trace:
        if action not in ("alloc", "free"):
            raise ValueError(f"trace actions are 'alloc' or 'free', not {action!r}.")
        if action == "alloc":
            requested += sim.malloc(int(nbytes), key).requested
        else:
            requested -= sim.live[key].requested if key in sim.live else 0
            sim.free(key)
        rows.append((requested, sim.allocated, sim.reserved))
    return pd.DataFrame(rows, columns=["requested", "allocated", "reserved"]), sim


def snapshot_trace(snapshot: dict, device: int = 0) -> list[tuple]:
    """A memory snapshot's trace (a pickle of ``torch.cuda.memory._snapshot()``, or ``timeline.to_snapshot()``) as
    :func:`replay`'s events. Each alloc gets its own key (addresses are reused). Blocks alive before the recording
    began (freed with no alloc before, or allocated at the end with none) are allocated first, in address order,
    under the keys ``("before", address)``."""
    if not isinstance(snapshot, dict) or not {"segments", "device_traces"} <= set(snapshot):
        raise ValueError("A snapshot is a dict with 'segments' and 'device_traces': pickle.load() the file that "
                         "torch.cuda.memory._dump_snapshot() wrote, or pass timeline.to_snapshot().")
    if not 0 <= device < len(snapshot["device_traces"]):
        raise ValueError(f"device {device} has no trace; this snapshot has {len(snapshot['device_traces'])}.")
    live, before, trace = {}, {}, []
    for n, event in enumerate(snapshot["device_traces"][device]):
        if event["action"] == "alloc":
            live[event["addr"]] = n
            trace.append(("alloc", n, event["size"]))
        elif event["action"] == "free_completed":
            if event["addr"] not in live:
                before[event["addr"]] = event["size"]
            trace.append(("free", live.pop(event["addr"], ("before", event["addr"])), 0))
    for segment in snapshot["segments"]:
        for b in segment["blocks"] if segment.get("device", device) == device else []:
            if b["state"] == "active_allocated" and b["address"] not in live:
                before[b["address"]] = b.get("requested_size") or b["size"]
    return [("alloc", ("before", addr), size) for addr, size in sorted(before.items())] + trace


def what_if(trace, *, capacity: int | None = None, batch_scale: float = 1.0, **options) -> dict:
    """Replay ``trace`` under other settings: allocator ``options`` (``expandable_segments=True``, ``max_split_size``),
    a card of ``capacity`` bytes, a micro-batch ``batch_scale`` times as large (it scales the tensors the trace both
    allocates and frees, activations and temporaries; not those alive before it or still alive at its end). Returns
    whether it fits, the peaks of allocated and reserved bytes, and the out-of-memory message if it does not."""
    if isinstance(batch_scale, bool) or not isinstance(batch_scale, (int, float)) or not batch_scale > 0:
        raise ValueError(f"batch_scale must be a positive number (0.5: half the micro-batch), not {batch_scale!r}.")
    trace = list(trace)
    freed = {key for action, key, _ in trace if action == "free"}
    scaled = {key for action, key, _ in trace if action == "alloc" and key in freed
              and not (isinstance(key, tuple) and key[:1] == ("before",))}
    sim, oom = CachingAllocator(capacity=capacity, **options), None
    try:
        for action, key, nbytes in trace:
            sim.malloc(round(nbytes * batch_scale) if key in scaled else int(nbytes), key) if action == "alloc" else sim.free(key)
    except OutOfMemory as err:
        oom = str(err)
    return {"fits": oom is None, "peak_allocated": sim.peak_allocated, "peak_reserved": sim.peak_reserved, "oom": oom}


def format_size(nbytes: int) -> str:
    """format_size() of CUDACachingAllocator.cpp: '1024 bytes', '1.00 KiB', '20.00 MiB', '1.50 GiB'."""
    if nbytes <= KIB:
        return f"{nbytes} bytes"
    unit, scale = ("KiB", KIB) if nbytes <= MIB else ("MiB", MIB) if nbytes <= GIB else ("GiB", GIB)
    return f"{nbytes / scale:.2f} {unit}"


def oom_message(tried: int, *, total: int, free: int, allocated: int, reserved: int, this_process: int) -> str:
    """The text of PyTorch's OutOfMemoryError, in the wording of DeviceCachingAllocator::malloc() (torch 2.x)."""
    return (f"CUDA out of memory. Tried to allocate {format_size(tried)}. GPU 0 has a total capacity of "
            f"{format_size(total)} of which {format_size(free)} is free. Including non-PyTorch memory, this process "
            f"has {format_size(this_process)} memory in use. Of the allocated memory "
            f"{format_size(allocated)} is allocated by PyTorch, and {format_size(reserved - allocated)} is reserved "
            "by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
            "Management  (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)")


_SIZE = r"(\d+(?:\.\d+)? (?:bytes|[KMGT]i?B))"
_UNIT = {"b": 1, "K": KIB, "M": MIB, "G": GIB, "T": 1024 * GIB}  # a size's unit, by its first letter
_FIELDS = {  # the current wording first, then PyTorch's older one ("already allocated", "reserved in total", "cached")
    "tried": [r"Tried to allocate " + _SIZE], "allowed": [_SIZE + " allowed"],
    "total": [r"total capac\w* of " + _SIZE, _SIZE + " total capacity"],
    "free": ["of which " + _SIZE + " is free", _SIZE + " free[;)]"],
    "this_process": ["this process has " + _SIZE + " memory in use"],
    "allocated": [_SIZE + " is allocated by PyTorch", _SIZE + " already allocated"],
    "unallocated": [_SIZE + " is reserved by PyTorch but unallocated"],
    "reserved": [_SIZE + " reserved in total by PyTorch", _SIZE + r" cached\)"],
}


@dataclass
class OomMessage:
    """The numbers of one out-of-memory message, in bytes; None where the message does not give one."""

    tried: int
    total: int
    free: int
    allocated: int
    reserved: int
    this_process: int | None = None
    allowed: int | None = None

    @property
    def unallocated(self) -> int:
        """Reserved by PyTorch but not allocated: cached blocks, pieces of partly used segments."""
        return self.reserved - self.allocated

    def others(self) -> int:
        """Bytes the card gives to anything but this process: total - free - this process. Older messages do not
        say what this process holds; there it is its reserved memory plus an estimated CUDA context."""
        mine = self.this_process if self.this_process is not None else self.reserved + CUDA_CONTEXT_BYTES
        return max(0, self.total - self.free - mine)


def parse_oom(text: str) -> OomMessage:
    """Every number of a CUDA out-of-memory message, in the current and in older PyTorch wordings."""
    if not isinstance(text, str):
        raise TypeError(f"parse_oom takes the message text (str(error)), not {type(text).__name__}.")
    if "out of memory" not in text:
        raise ValueError("This is not an out-of-memory message (no 'out of memory' in it): pass str(error) of a "
                         "torch.OutOfMemoryError.")
    found = {}
    for name, patterns in _FIELDS.items():
        match = next((m for m in (re.search(p, text) for p in patterns) if m), None)
        if match:
            number, unit = match.group(1).split()
            found[name] = round(float(number) * _UNIT[unit[0]])
    missing = [k for k in ("tried", "total", "free", "allocated") if k not in found]
    if missing or not {"reserved", "unallocated"} & set(found):
        raise ValueError(f"Could not find {', '.join(missing) or 'the reserved memory'} in this message: paste the "
                         "whole message, from 'CUDA out of memory' to its end.")
    return OomMessage(tried=found["tried"], total=found["total"], free=found["free"], allocated=found["allocated"],
                      reserved=found.get("reserved", found["allocated"] + found.get("unallocated", 0)),
                      this_process=found.get("this_process"), allowed=found.get("allowed"))


def real_oom_messages() -> list[tuple[str, str]]:
    """The real out-of-memory messages shipped with the course: (diagnosis, message text) pairs."""
    chunks = re.split(r"^== ", data_file("oom_messages.txt").read_text(encoding="utf-8"), flags=re.M)[1:]
    return [(label.strip(), " ".join(body.split())) for label, _, body in (c.partition("\n") for c in chunks)]
