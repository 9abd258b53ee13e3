"""Copies whose stores bypass the CPU caches (non-temporal stores), for KV blocks.

A pool hit copies tens to hundreds of MiB in segments of 64-256 KiB (one layer of one block).
For copies that size glibc's `memcpy`, which numpy uses, writes through the caches: every
destination line is first read from memory (read for ownership), then written back, so each
byte crosses the memory bus three times. `memcpy` switches to non-temporal stores only above a
threshold of a few MiB (`glibc.cpu.x86_non_temporal_threshold`, 3/4 of the shared cache), which
one contiguous copy of the same bytes reaches and a block's segments never do. Measured on a
2-vCPU AVX2 EPYC: 96 MiB in 1536 segments of 64 KiB took 17-19 ms, one contiguous copy 9.7 ms,
and the same segments with non-temporal stores 12.5 ms; inside vLLM an 8K-token fp32 hit's load
(192 MiB) went from 42-46 ms to 25-28 ms. The bytes are not wanted in the caches anyway: a
load's blocks are read by attention later, a save's by some later request, and a hit of a few
MiB costs a few hundred microseconds more to read back from memory. (Checked again on a Xeon
with a 480 MiB L3, where a cache might have kept a 4K hit for the attention that reads it next:
with ordinary stores the load inside vLLM took 5.4 ms instead of 4.4 and the +1 TTFT did not
fall.)

The kernel is a few lines of LLVM IR compiled once per process by llvmlite (about 10 ms):
64-byte non-temporal stores to 64-byte aligned lines (the bytes before the first such line and
after the last are copied one by one), unaligned loads, and a fence at the end so that the
stores are visible to other threads (the forward pass) before the caller reports the copy done.
Enabled on x86-64, where it was measured; elsewhere, or without llvmlite, copies stay numpy's.

A second entry point, `copy_segments_team`, runs one table on the calling thread's OpenMP team
(libgomp's `GOMP_parallel`, resolved in the process where torch or vLLM loaded it), each member
taking a run of whole segments with about the same number of bytes. In vLLM's CPU worker those
are the threads vLLM computes with, pinned one to a core, which busy-wait for their next
parallel region: copy threads of our own on their cores got half a core each, and a 4K hit's
load (48 MiB) took 6.4 ms on two Python threads or one, 3.3 ms on the team of two.

Invariant: after `copy_segments` or `copy_segments_team`, every destination range holds its
source range's bytes, and they are visible to every thread. Callers (`buffers.scatter`,
`buffers.gather`) fall back to numpy's copy where `kernel()` is None, with the same result;
`CopyEngine` falls back to its own threads where `team_threads()` is below 2.
"""

from __future__ import annotations

import ctypes
import logging
import platform
import threading
from collections.abc import Callable, Sequence

import numpy as np

logger = logging.getLogger(__name__)

# Values smaller than this are copied by numpy: setting up a kernel call costs a few
# microseconds, as much as copying a few KiB, and so small a copy evicts nothing that matters.
MIN_BYTES = 16 << 10

_IR = r"""
; Bytes [from, to) one at a time, with ordinary stores: the parts of a segment outside whole lines.
define internal void @copy_bytes(ptr %dst, ptr %src, i64 %from, i64 %to) nounwind alwaysinline {
entry:
  br label %check
check:
  %b = phi i64 [%from, %entry], [%b_next, %byte]
  %more = icmp ult i64 %b, %to
  br i1 %more, label %byte, label %done
byte:
  %s = getelementptr i8, ptr %src, i64 %b
  %d = getelementptr i8, ptr %dst, i64 %b
  %v = load i8, ptr %s, align 1
  store i8 %v, ptr %d, align 1
  %b_next = add i64 %b, 1
  br label %check
done:
  ret void
}

; One segment: the bytes up to dst's first 64-byte line, whole lines with non-temporal stores, the rest.
define internal void @copy_one(ptr %dst, ptr %src, i64 %n) nounwind alwaysinline {
entry:
  %addr = ptrtoint ptr %dst to i64
  %neg = sub i64 0, %addr
  %to_line = and i64 %neg, 63
  %short = icmp ult i64 %n, %to_line
  %head = select i1 %short, i64 %n, i64 %to_line
  %rest = sub i64 %n, %head
  %body = and i64 %rest, -64
  %tail_at = add i64 %head, %body
  call void @copy_bytes(ptr %dst, ptr %src, i64 0, i64 %head)
  %none = icmp eq i64 %body, 0
  br i1 %none, label %tail, label %line
line:
  %i = phi i64 [0, %entry], [%i_next, %line]
  %off = add i64 %head, %i
  %s = getelementptr i8, ptr %src, i64 %off
  %d = getelementptr i8, ptr %dst, i64 %off
  %v = load <8 x i64>, ptr %s, align 1
  store <8 x i64> %v, ptr %d, align 64, !nontemporal !0
  %i_next = add i64 %i, 64
  %l_more = icmp ult i64 %i_next, %body
  br i1 %l_more, label %line, label %tail
tail:
  call void @copy_bytes(ptr %dst, ptr %src, i64 %tail_at, i64 %n)
  ret void
}

; Segments [lo, hi) of the table, one after another.
define internal void @copy_range(ptr %dsts, ptr %srcs, ptr %sizes, i64 %lo, i64 %hi) nounwind alwaysinline {
entry:
  %any = icmp ult i64 %lo, %hi
  br i1 %any, label %each, label %done
each:
  %j = phi i64 [%lo, %entry], [%j_next, %each]
  %dp = getelementptr i64, ptr %dsts, i64 %j
  %sp = getelementptr i64, ptr %srcs, i64 %j
  %np = getelementptr i64, ptr %sizes, i64 %j
  %da = load i64, ptr %dp, align 8
  %sa = load i64, ptr %sp, align 8
  %n = load i64, ptr %np, align 8
  %d = inttoptr i64 %da to ptr
  %s = inttoptr i64 %sa to ptr
  call void @copy_one(ptr %d, ptr %s, i64 %n)
  %j_next = add i64 %j, 1
  %more = icmp ult i64 %j_next, %hi
  br i1 %more, label %each, label %done
done:
  ret void
}

define void @kvpool_stream_copy(ptr %dsts, ptr %srcs, ptr %sizes, i64 %k) nounwind {
entry:
  call void @copy_range(ptr %dsts, ptr %srcs, ptr %sizes, i64 0, i64 %k)
  fence seq_cst
  ret void
}
!0 = !{i32 1}
"""

# The same copies on an OpenMP team: the calling thread's, i.e. in vLLM's CPU worker the threads
# vLLM computes with, one pinned to each of its cores. Compiled only where the process has an
# OpenMP runtime with libgomp's entry points (torch brings one), which are resolved to it.
_TEAM_IR = r"""
declare void @GOMP_parallel(ptr, ptr, i32, i32)
declare i32 @omp_get_thread_num()
declare i32 @omp_get_num_threads()

define internal i64 @field(ptr %h, i64 %i) nounwind alwaysinline {
  %p = getelementptr i64, ptr %h, i64 %i
  %v = load i64, ptr %p, align 8
  ret i64 %v
}

; One member's share. The header is five words: the dsts, srcs, sizes and bounds tables and the
; number of parts; part q is segments [bounds[q], bounds[q + 1]). Member t of n copies parts
; t, t + n, ...: every part exactly once even if the runtime gave fewer threads than asked.
define internal void @team_member(ptr %h) nounwind {
entry:
  %dsts = call i64 @field(ptr %h, i64 0)
  %srcs = call i64 @field(ptr %h, i64 1)
  %sizes = call i64 @field(ptr %h, i64 2)
  %bounds = call i64 @field(ptr %h, i64 3)
  %parts = call i64 @field(ptr %h, i64 4)
  %dp = inttoptr i64 %dsts to ptr
  %sp = inttoptr i64 %srcs to ptr
  %np = inttoptr i64 %sizes to ptr
  %bp = inttoptr i64 %bounds to ptr
  %t32 = call i32 @omp_get_thread_num()
  %n32 = call i32 @omp_get_num_threads()
  %t = zext i32 %t32 to i64
  %n = zext i32 %n32 to i64
  br label %check
check:
  %q = phi i64 [%t, %entry], [%q_next, %part]
  %more = icmp ult i64 %q, %parts
  br i1 %more, label %part, label %done
part:
  %lo = call i64 @field(ptr %bp, i64 %q)
  %q1 = add i64 %q, 1
  %hi = call i64 @field(ptr %bp, i64 %q1)
  call void @copy_range(ptr %dp, ptr %sp, ptr %np, i64 %lo, i64 %hi)
  %q_next = add i64 %q, %n
  br label %check
done:
  fence seq_cst
  ret void
}

define void @kvpool_stream_copy_team(ptr %h, i32 %threads) nounwind {
entry:
  call void @GOMP_parallel(ptr @team_member, ptr %h, i32 %threads, i32 0)
  fence seq_cst
  ret void
}
"""

_Kernel = Callable[[int, int, int, int], None]
_TeamKernel = Callable[[int, int], None]
_OPENMP = ("GOMP_parallel", "omp_get_thread_num", "omp_get_num_threads")
_lock = threading.Lock()
_team_lock = threading.Lock()
_kernel: _Kernel | None = None
_tried = False
_team: tuple[_TeamKernel, Callable[[], int]] | None = None
_team_failed = False  # no kernel, or the team kernel did not compile: never try again
_engines: list[object] = []  # the JITs that own the kernels' code: kept alive as long as the process
_why_not = ""


def _compile(ir: str, symbols: dict[str, int], name: str) -> int:
    """The address of function ``name`` in ``ir``, compiled for this CPU; ``symbols`` are the
    external functions the IR calls, by address."""
    import llvmlite.binding as llvm

    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    for sym, addr in symbols.items():
        llvm.add_symbol(sym, addr)
    module = llvm.parse_assembly(ir)
    module.verify()
    target = llvm.Target.from_default_triple().create_target_machine(
        cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(), opt=3)
    engine = llvm.create_mcjit_compiler(module, target)
    engine.finalize_object()
    _engines.append(engine)
    return int(engine.get_function_address(name))


def _build() -> _Kernel | None:
    global _why_not
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        _why_not = f"not measured on {machine}"
        return None
    try:
        import llvmlite.binding  # noqa: F401
    except ImportError:
        _why_not = "llvmlite is not installed"
        return None
    try:
        address = _compile(_IR, {}, "kvpool_stream_copy")
    except Exception as exc:  # noqa: BLE001 - any failure leaves numpy's copy in place
        _why_not = f"llvmlite could not compile the kernel: {exc}"
        logger.warning("kvpool: non-temporal copies are off (%s); numpy copies instead", _why_not)
        return None
    # CFUNCTYPE, not PYFUNCTYPE: the call releases the GIL, so copy threads run in parallel.
    return ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(address)


def _build_team() -> tuple[_TeamKernel, Callable[[], int]] | None:
    """The team kernel and the runtime's `omp_get_max_threads`, where the process has loaded an
    OpenMP runtime into its global namespace (vLLM's CPU worker preloads torch's libgomp; torch
    itself loads it globally); None without one."""
    global _team_failed
    if kernel() is None:
        _team_failed = True
        return None
    try:
        runtime = ctypes.CDLL(None)
        symbols = {name: int(ctypes.cast(getattr(runtime, name), ctypes.c_void_p).value or 0) for name in _OPENMP}
        max_threads = runtime.omp_get_max_threads
    except (AttributeError, OSError):
        return None  # no OpenMP runtime in this process (yet): copies use Python threads
    if not all(symbols.values()):
        return None
    max_threads.restype, max_threads.argtypes = ctypes.c_int, []
    try:
        address = _compile(_IR + _TEAM_IR, symbols, "kvpool_stream_copy_team")
    except Exception as exc:  # noqa: BLE001 - the single-thread kernel and Python threads remain
        _team_failed = True
        logger.warning("kvpool: copies on the OpenMP team are off (could not compile: %s)", exc)
        return None
    return ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int32)(address), max_threads


def kernel() -> _Kernel | None:
    """The compiled kernel (built on first use), or None where copies stay numpy's."""
    global _kernel, _tried
    if not _tried:
        with _lock:
            if not _tried:
                _kernel = _build()
                _tried = True
    return _kernel


def team_threads() -> int:
    """How many threads `copy_segments_team` would copy on for the calling thread: the size of
    its OpenMP team, or 0 where it cannot be used. Only the process's main thread uses its team:
    in vLLM's CPU worker that is the thread whose team vLLM pinned one to a core and computes
    with, while any other thread calling into OpenMP would start a team of its own."""
    if threading.current_thread() is not threading.main_thread():
        return 0
    team = _team_kernel()
    return 0 if team is None else max(0, int(team[1]()))


def _team_kernel() -> tuple[_TeamKernel, Callable[[], int]] | None:
    """Built once an OpenMP runtime is there; until then looked for again on each call (a few
    microseconds), so that a process that imports torch after its first copy still gets it."""
    global _team, _team_failed
    if _team is None and not _team_failed:
        with _team_lock:  # not `_lock`: building the team kernel takes `kernel()` first
            if _team is None and not _team_failed:
                _team = _build_team()
    return _team


def copy_segments_team(dsts: list[int], srcs: list[int], sizes: list[int], threads: int) -> None:
    """`copy_segments` on the calling thread's OpenMP team of ``threads`` (the caller checked
    `team_threads()`), split into one run of consecutive segments per thread with about the same
    number of bytes. Returns when every thread has finished and its stores are visible."""
    assert _team is not None
    if not sizes:
        return
    fn = _team[0]
    table = np.array((dsts, srcs, sizes), dtype=np.uint64)
    parts = max(1, min(threads, len(sizes)))
    bounds = split_bounds(table[2], parts)
    row = table.strides[0]
    header = np.array((table.ctypes.data, table.ctypes.data + row, table.ctypes.data + 2 * row,
                       bounds.ctypes.data, parts), dtype=np.uint64)
    fn(header.ctypes.data, parts)


def split_bounds(sizes: Sequence[int] | np.ndarray, parts: int) -> np.ndarray:
    """Where to cut a table of segments into ``parts`` runs of whole segments with about the same
    number of bytes: ``parts + 1`` ascending indices from 0 to ``len(sizes)`` (uint64), run q
    being segments [bounds[q], bounds[q + 1]). Each cut is the segment boundary nearest its
    share of the bytes; a run may be empty where one segment outweighs a share."""
    starts = np.concatenate(([0], np.cumsum(np.asarray(sizes, dtype=np.float64))))
    shares = starts[-1] * np.arange(1, parts) / parts
    after = np.minimum(np.searchsorted(starts, shares, side="left"), len(starts) - 1)
    before = np.maximum(after - 1, 0)
    nearer = np.where(shares - starts[before] < starts[after] - shares, before, after)
    cuts = np.concatenate(([0], nearer, [len(starts) - 1]))
    return np.maximum.accumulate(cuts).astype(np.uint64)


def describe() -> str:
    """One phrase for start-up logs: how values are copied."""
    if kernel() is not None:
        team = team_threads()
        where = (f"; a batch from the main thread runs on its OpenMP team of {team}" if team > 1 else "")
        return (f"unhashed copies of values of {MIN_BYTES >> 10} KiB and more (the local backend's) "
                f"use non-temporal stores{where}")
    return f"numpy copies ({_why_not})"


def address(arr: np.ndarray) -> int:
    """The address of a contiguous array's first byte. `from_buffer` takes ~1 us where
    `arr.ctypes.data` takes ~3; it needs a writable buffer."""
    if arr.flags.writeable:
        return ctypes.addressof(ctypes.c_char.from_buffer(arr))
    return int(arr.ctypes.data)


def copy_segments(dsts: list[int], srcs: list[int], sizes: list[int]) -> None:
    """Copy ``sizes[j]`` bytes from address ``srcs[j]`` to ``dsts[j]`` for every j, in one call
    of the kernel (the caller checked that `kernel()` exists and that the ranges are valid:
    the kernel trusts its addresses, and ranges must not overlap). One call per value, not per
    segment: a call from Python costs about as much as copying a 16 KiB segment."""
    fn = kernel()
    assert fn is not None
    table = np.array((dsts, srcs, sizes), dtype=np.uint64)
    base = table.ctypes.data
    row = table.strides[0]
    fn(base, base + row, base + 2 * row, len(sizes))
