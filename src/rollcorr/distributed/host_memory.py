"""The trainer's own collectives through shared memory, for CPU ranks that all run on one host.

gloo moves every collective through a TCP socket, even between two processes on one machine: a 4 MB gradient
all-reduce takes 1.3–6 ms there, and a reduction of one number 0.1–1.7 ms (a 2-core machine, where a data-parallel
step of the built-in model makes about a dozen of them). Here each rank writes its tensor into its own slot of a
mapping every rank shares, a barrier says that every rank has written, and each rank then reduces (or copies)
every rank's slot itself — a memory copy and a read instead of a socket round trip.

    slots      ``2 × world × chunk_bytes`` bytes: two halves, used by alternate collectives. A rank writes
               half h only after the barrier of the collective before, which every rank reached after reading
               half h the time before: one barrier per chunk, no second one to free the slots
    order      every rank reduces the slots in rank order with the same kernel, so every rank gets the same bits
               (a replicated learner's ranks stay equal)
    barrier    ``SpinBarrier``: arrival counts in the mapping, a few microseconds; a rank that exits fails it at
               once, a wait longer than the group's collective timeout fails it, as with gloo. Where the CPU
               does not keep stores in order (not x86), gloo's barrier, whose socket round trip orders them
    large      a tensor larger than a slot goes through in slot-sized chunks, each with its barrier; an object
               whose pickle does not fit a slot goes through gloo (every rank learns every size first)

The mapping is a file in /dev/shm that rank 0 creates and unlinks as soon as every rank has mapped it, so nothing
is left behind when a rank is killed. Used by ``group.ProcessGroup`` when every rank can map it (they run on this
host) and their device is the CPU; where /dev/shm cannot hold the slots it is not used (gloo carries everything,
as before), and ``ROLLCORR_HOST_MEMORY=0`` turns it off. FSDP2's own collectives stay gloo's.
"""

from __future__ import annotations

import os
import pickle
import platform
import time
import uuid
from pathlib import Path

import torch
from torch import Tensor

SHM_DIR = Path("/dev/shm")
CHUNK_BYTES = 8 << 20  # one rank's slot: a 2 M-parameter fp32 gradient in one piece
MIN_CHUNK_BYTES = 1 << 20  # below this the barriers of many chunks cost more than gloo's socket
HEADER_BYTES = 8  # an object's pickled size, ahead of its bytes in the slot; rank 0's mark, ahead of the flags
LINE_BYTES = 64  # a cache line: the mapping's header, then each rank's flags on a line of their own
ARRIVED, PID, SIZE = 0, 1, 2  # a rank's flags: how many barriers it has reached, its process id, and (at
# SIZE + half) the bytes it wrote to that half: ranks that pass tensors of different sizes fail, not mix them up
# Stores become visible to other cores in program order (x86's total store order; glibc's non-temporal copies end
# with a store fence), and loads are not reordered with older loads: a rank that sees another's arrival count
# sees the slot it wrote before. Other architectures need fences Python cannot issue: gloo's barrier there.
SPIN_ORDERED = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
SPIN_S = 100e-6  # a barrier's wait: spinning this long, then yielding the core until YIELD_S, then sleeping
YIELD_S = 2e-3  # a hundredth of the time waited so far, between SLEEP_S and MAX_SLEEP_S (a rank that waits
SLEEP_S = 50e-6  # seconds for rank 0's evaluation or checkpoint wakes ~1000 times a second, not 20 000)
MAX_SLEEP_S = 1e-3
CHECK_S = 0.5  # how often a waiting rank checks that the ranks it waits for still run
_REDUCE = {"sum": torch.sum, "max": torch.amax, "min": torch.amin}  # over the ranks' slots (dim 0), into ``out``


class CollectiveFailed(RuntimeError):
    """A collective could not complete: a rank it waited for exited, the wait passed the collective timeout, or
    the ranks passed different sizes — what gloo raises as its backend's RuntimeError, so the run stops as it
    does when gloo's collective fails (the launcher names the rank that died)."""


def chunk_bytes_for(world: int, free_bytes: int, chunk_bytes: int = CHUNK_BYTES) -> int | None:
    """The largest slot (halving from ``chunk_bytes`` down to ``MIN_CHUNK_BYTES``) whose ``2 × world`` slots take
    at most half of /dev/shm's ``free_bytes``; None when even the smallest does not fit."""
    while chunk_bytes >= MIN_CHUNK_BYTES:
        if 2 * world * chunk_bytes <= free_bytes // 2:
            return chunk_bytes
        chunk_bytes //= 2
    return None


class HostMemory:
    """Collectives over shared slots for ``world`` CPU ranks of one host; every rank calls them in the same order.

    ``barrier``: what every rank calls between writing its slot and reading the others' (``SpinBarrier`` on
    x86, gloo's ``barrier`` elsewhere). Build it with ``open`` (every rank)."""

    def __init__(self, flags: Tensor, slots: Tensor, rank: int, world: int, barrier) -> None:
        self.flags = flags  # (world, 8) int64: each rank's line (``ARRIVED``, ``PID``, ``SIZE``), shared
        self.slots = slots  # (2, world, chunk_bytes) uint8, shared by every rank
        self.rank, self.world, self.barrier = rank, world, barrier
        self.chunk_bytes = slots.shape[-1]
        self._half = 0  # the half the next chunk uses

    @classmethod
    def open(cls, rank: int, world: int, broadcast, all_true, barrier, timeout_s: float,
             chunk_bytes: int = CHUNK_BYTES) -> HostMemory | None:
        """Every rank's ``HostMemory`` over one mapping (a collective); None on every rank when /dev/shm cannot
        hold it or a rank cannot map it (another host). ``broadcast(obj)`` → rank 0's ``obj`` on every rank,
        ``all_true(flag)`` → whether ``flag`` holds on every rank, ``barrier()`` (the group's, over gloo);
        ``timeout_s`` bounds a wait at the spin barrier; ``chunk_bytes``: the largest slot to try."""
        plan = None
        if rank == 0:
            chunk = chunk_bytes_for(world, _free_bytes(SHM_DIR), chunk_bytes)
            path, mark = SHM_DIR / f"rollcorr-{os.getpid()}-{uuid.uuid4().hex[:8]}", os.urandom(HEADER_BYTES)
            made = chunk is not None and _create(path, _mapping_bytes(world, chunk), mark)
            plan = (str(path), chunk, mark) if made else None
        plan = broadcast(plan)
        if plan is None:
            return None
        path, chunk, mark = plan
        memory = None
        if os.path.exists(path):  # another host has no such file (and from_file would make one)
            try:
                memory = torch.from_file(path, shared=True, size=_mapping_bytes(world, chunk), dtype=torch.uint8)
            except (OSError, RuntimeError):
                pass
        if memory is not None and bytes(memory[:HEADER_BYTES].tolist()) != mark:  # not rank 0's memory
            memory = None
        if memory is not None:
            flags = memory[LINE_BYTES : LINE_BYTES * (1 + world)].view(torch.int64).view(world, LINE_BYTES // 8)
            flags[rank, PID] = os.getpid()
        mapped = all_true(memory is not None)  # every rank mapped the file and wrote its pid (or gave up)
        if rank == 0:
            Path(path).unlink(missing_ok=True)
        if not mapped:
            return None
        slots = memory[LINE_BYTES * (1 + world) :].view(2, world, chunk)
        slots[:, rank].zero_()  # this rank's pages faulted in now, not inside a collective later
        if SPIN_ORDERED:
            barrier = SpinBarrier(flags, rank, timeout_s)
        return cls(flags, slots, rank, world, barrier)

    def _exchange(self, payload: Tensor, same_size: bool = True) -> Tensor:
        """This rank's bytes (≤ a slot) written to its slot of the next half, the barrier, and that half:
        (world, chunk_bytes) uint8, every rank's slot (read it before the next exchange but one).
        ``same_size``: ``CollectiveFailed`` when another rank wrote another number of bytes (a tensor collective
        called with different shapes: gloo refuses it too)."""
        half_index = self._half
        half = self.slots[half_index]
        self._half ^= 1
        half[self.rank, : payload.numel()].copy_(payload)
        self.flags[self.rank, SIZE + half_index] = payload.numel()
        self.barrier()
        if same_size:
            sizes = self.flags[:, SIZE + half_index].tolist()
            if len(set(sizes)) > 1:
                raise CollectiveFailed(f"a collective got tensors of different sizes on the ranks ({sizes} bytes "
                                       "in rank order): every rank must pass the same shape and dtype")
        return half

    def _exchanged(self, flat: Tensor):
        """``flat`` (1-D, contiguous; the same size and dtype on every rank) exchanged slot-sized piece by piece:
        yields (start, count, every rank's piece as a (world, count) view of ``flat``'s dtype), to be read before
        the next piece is asked for."""
        per_chunk = self.chunk_bytes // flat.element_size()
        for start in range(0, max(flat.numel(), 1), per_chunk):
            piece = flat[start : start + per_chunk]
            half = self._exchange(piece.view(torch.uint8))
            yield start, piece.numel(), half[:, : piece.numel() * flat.element_size()].view(flat.dtype)

    def all_reduce(self, x: Tensor, op: str = "sum", out: Tensor | None = None) -> Tensor:
        """``x`` (CPU; the same shape and dtype on every rank) reduced over the ranks (sum | max | min), slot-sized
        chunk by chunk, every rank's slots in rank order: into ``out`` (contiguous, like ``x``; ``x`` itself
        may be it), or a new tensor."""
        flat = x.detach().contiguous().reshape(-1)
        out = torch.empty_like(flat) if out is None else out.view(-1)
        for start, count, pieces in self._exchanged(flat):
            _REDUCE[op](pieces, 0, out=out[start : start + count])
        return out.view(x.shape)

    def all_gather(self, x: Tensor) -> Tensor:
        """(world, *x.shape): every rank's ``x`` (the same shape and dtype on every rank), rank 0's first."""
        flat = x.detach().contiguous().reshape(-1)
        out = torch.empty((self.world, flat.numel()), dtype=flat.dtype)
        for start, count, pieces in self._exchanged(flat):
            out[:, start : start + count] = pieces
        return out.view(self.world, *x.shape)

    def all_gather_object(self, obj, fallback) -> list:
        """Every rank's ``obj`` (pickled), in rank order; through ``fallback(obj)`` (gloo's) on every rank when
        any rank's pickle does not fit a slot."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        fits = len(data) + HEADER_BYTES <= self.chunk_bytes
        payload = torch.empty(HEADER_BYTES + (len(data) if fits else 0), dtype=torch.uint8)
        payload[:HEADER_BYTES].view(torch.int64)[0] = len(data)
        if fits:
            payload[HEADER_BYTES:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        half = self._exchange(payload, same_size=False)
        sizes = [int(s) for s in half[:, :HEADER_BYTES].contiguous().view(torch.int64).reshape(-1)]
        if any(size + HEADER_BYTES > self.chunk_bytes for size in sizes):
            return fallback(obj)
        return [obj if r == self.rank else pickle.loads(half[r, HEADER_BYTES : HEADER_BYTES + size].numpy().tobytes())
                for r, size in enumerate(sizes)]


class SpinBarrier:
    """Every rank waits until every rank has arrived: each rank counts its arrivals in its own cache line of the
    shared mapping and waits until every count reaches its own — a few microseconds when the ranks arrive
    together, against 0.1–0.7 ms for gloo's barrier through a socket. A wait spins ``SPIN_S``, then yields the
    core, then sleeps in steps growing with the wait (a rank that waits long leaves the core to others); every
    ``CHECK_S`` it checks that the ranks it waits for still run (a killed rank fails the barrier at once, as a
    closed socket fails gloo's) and after ``timeout_s`` it gives up, as gloo's collectives do."""

    def __init__(self, flags: Tensor, rank: int, timeout_s: float) -> None:
        self.flags, self.rank, self.timeout_s = flags, rank, timeout_s
        self.arrived = flags[:, ARRIVED]  # (world,) int64 view
        self.pids = [int(pid) for pid in flags[:, PID]]
        self.round = 0

    def __call__(self) -> None:
        self.round += 1
        self.flags[self.rank, ARRIVED] = self.round
        if int(self.arrived.min()) >= self.round:
            return
        start = time.perf_counter()
        checked = start
        while int(self.arrived.min()) < self.round:
            now = time.perf_counter()
            if now - start < SPIN_S:
                continue
            if now - start < YIELD_S:
                os.sched_yield()
            else:
                time.sleep(min(max(SLEEP_S, (now - start) / 100), MAX_SLEEP_S))
            if now - checked > CHECK_S:
                checked = now
                self._check(now - start)

    def _check(self, waited_s: float) -> None:
        """``CollectiveFailed`` when a rank this one waits for has exited, or the wait passed ``timeout_s``."""
        late = [r for r, count in enumerate(self.arrived.tolist()) if count < self.round]
        for r in late:
            if not _running(self.pids[r]):
                raise CollectiveFailed(f"rank {r} (process {self.pids[r]}) exited while rank {self.rank} waited for it "
                                       "in a collective")
        if waited_s > self.timeout_s:
            raise CollectiveFailed(f"rank(s) {', '.join(map(str, late))} did not reach a collective within "
                                   f"{self.timeout_s:.0f} s (rank {self.rank} waited)")


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie, not yet reaped by its parent, has)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)  # no /proc: whether it exists at all
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return state not in ("Z", "X")


def _mapping_bytes(world: int, chunk: int) -> int:
    """The mapping: a header line, a line of flags per rank, two halves of a slot per rank."""
    return LINE_BYTES * (1 + world) + 2 * world * chunk


def _create(path: Path, size: int, mark: bytes) -> bool:
    """A new file of ``size`` bytes at ``path`` that starts with ``mark`` (False: it could not be made)."""
    try:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return False
    try:
        os.ftruncate(descriptor, size)
        os.pwrite(descriptor, mark, 0)
        return True
    except OSError:
        path.unlink(missing_ok=True)
        return False
    finally:
        os.close(descriptor)


def _free_bytes(folder: Path) -> int:
    """Free bytes of the file system at ``folder`` (0: there is none)."""
    try:
        stats = os.statvfs(folder)
    except OSError:
        return 0
    return stats.f_bavail * stats.f_frsize
