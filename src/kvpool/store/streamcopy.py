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

A third, `copy_hash_team`, is the team copy of a `server` read, which is checked against the
checksum its writer committed: each member copies whole values with ordinary stores and hashes
each segment (XXH3-64, xxhash's own C entry points) right after copying it, while it is still
in the caches. In vLLM that read's Python copy threads had the same half cores.

Invariant: after `copy_segments`, `copy_segments_team` or `copy_hash_team`, every destination
range holds its source range's bytes, and they are visible to every thread; `copy_hash_team`'s
digests are `buffers.checksum` of the destinations. Callers (`buffers.scatter`,
`buffers.gather`) fall back to numpy's copy where `kernel()` is None, with the same result;
`CopyEngine` falls back to its own threads where `team_threads()` is below 2.
"""

from __future__ import annotations

import ctypes
import dataclasses
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

define internal ptr @word(ptr %h, i64 %i) nounwind alwaysinline {
  %v = call i64 @field(ptr %h, i64 %i)
  %p = inttoptr i64 %v to ptr
  ret ptr %p
}

; One team member's share of a call with header %h: part q is [bounds[q], bounds[q + 1]) of
; what %body walks (segments, values), and member t of n runs %body(%h, lo, hi, t) for parts
; t, t + n, ...: every part exactly once even if the runtime gave fewer threads than asked.
define internal void @each_part(ptr %h, ptr %bp, i64 %parts, ptr %body) nounwind alwaysinline {
entry:
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
  call void %body(ptr %h, i64 %lo, i64 %hi, i64 %t)
  %q_next = add i64 %q, %n
  br label %check
done:
  fence seq_cst
  ret void
}

; The copy's header is five words: the dsts, srcs, sizes and bounds tables and the number of
; parts; a part is a run of segments.
define internal void @copy_part(ptr %h, i64 %lo, i64 %hi, i64 %t) nounwind {
  %dp = call ptr @word(ptr %h, i64 0)
  %sp = call ptr @word(ptr %h, i64 1)
  %np = call ptr @word(ptr %h, i64 2)
  call void @copy_range(ptr %dp, ptr %sp, ptr %np, i64 %lo, i64 %hi)
  ret void
}

"""


def _team_entry(name: str, body: str, bounds_word: int, parts_word: int) -> str:
    """IR of the exported function `name(header, threads)`: runs `body` over the parts of the
    call on an OpenMP team, the bounds table and the number of parts being those words of the
    header."""
    return f"""
define internal void @{name}_member(ptr %h) nounwind {{
  %bp = call ptr @word(ptr %h, i64 {bounds_word})
  %parts = call i64 @field(ptr %h, i64 {parts_word})
  call void @each_part(ptr %h, ptr %bp, i64 %parts, ptr @{body})
  ret void
}}

define void @{name}(ptr %h, i32 %threads) nounwind {{
entry:
  call void @GOMP_parallel(ptr @{name}_member, ptr %h, i32 %threads, i32 0)
  fence seq_cst
  ret void
}}
"""


_TEAM_IR += _team_entry("kvpool_stream_copy_team", "copy_part", bounds_word=3, parts_word=4)

# Copy and hash on the team: for a `server` read, whose copy is checked against the checksum its
# writer committed (`buffers.scatter_summed`, XXH3-64 of the reader's own destination buffers).
# Each member takes a run of whole values; a value's segments are copied with ordinary stores
# (the hash reads each right back, so its bytes should stay in the caches) and hashed one by one
# right after their copy. XXH3 comes from the xxhash module the rest of kvpool hashes with, so
# the digests are the same by construction. Checked and rejected (48 / 96 MiB on the 2-vCPU Xeon,
# two threads): non-temporal stores with the hash reading each segment back took 4.5 ms instead
# of 2.5 for 48 MiB; hashing chunks in a cached bounce buffer and streaming them out with
# non-temporal stores was 9% faster at 96 MiB of cold data and no faster at 48 MiB.
_HASH_IR = r"""
declare i32 @XXH3_64bits_reset(ptr)
declare i32 @XXH3_64bits_update_dispatch(ptr, ptr, i64)
declare i64 @XXH3_64bits_digest(ptr)
declare void @llvm.memcpy.p0.p0.i64(ptr, ptr, i64, i1)

; Value v: copy and hash segments [firsts[v], firsts[v + 1]), its digest into digests[v].
define internal void @hash_value(ptr %dp, ptr %sp, ptr %np, ptr %fp, ptr %gp, ptr %state, i64 %v) nounwind {
entry:
  call i32 @XXH3_64bits_reset(ptr %state)
  %lo = call i64 @field(ptr %fp, i64 %v)
  %v1 = add i64 %v, 1
  %hi = call i64 @field(ptr %fp, i64 %v1)
  br label %check
check:
  %j = phi i64 [%lo, %entry], [%j_next, %seg]
  %more = icmp ult i64 %j, %hi
  br i1 %more, label %seg, label %done
seg:
  %da = call i64 @field(ptr %dp, i64 %j)
  %sa = call i64 @field(ptr %sp, i64 %j)
  %n = call i64 @field(ptr %np, i64 %j)
  %d = inttoptr i64 %da to ptr
  %s = inttoptr i64 %sa to ptr
  call void @llvm.memcpy.p0.p0.i64(ptr %d, ptr %s, i64 %n, i1 false)
  call i32 @XXH3_64bits_update_dispatch(ptr %state, ptr %d, i64 %n)
  %j_next = add i64 %j, 1
  br label %check
done:
  %digest = call i64 @XXH3_64bits_digest(ptr %state)
  %g = getelementptr i64, ptr %gp, i64 %v
  store i64 %digest, ptr %g, align 8
  ret void
}

; The header is eight words: the dsts, srcs, sizes, firsts, bounds and digests tables, the
; number of parts and the states table (one XXH3 state per member); a part is a run of values.
define internal void @hash_part(ptr %h, i64 %lo, i64 %hi, i64 %t) nounwind {
entry:
  %dp = call ptr @word(ptr %h, i64 0)
  %sp = call ptr @word(ptr %h, i64 1)
  %np = call ptr @word(ptr %h, i64 2)
  %fp = call ptr @word(ptr %h, i64 3)
  %gp = call ptr @word(ptr %h, i64 5)
  %xp = call ptr @word(ptr %h, i64 7)
  %state = call ptr @word(ptr %xp, i64 %t)
  br label %check
check:
  %v = phi i64 [%lo, %entry], [%v_next, %value]
  %more = icmp ult i64 %v, %hi
  br i1 %more, label %value, label %done
value:
  call void @hash_value(ptr %dp, ptr %sp, ptr %np, ptr %fp, ptr %gp, ptr %state, i64 %v)
  %v_next = add i64 %v, 1
  br label %check
done:
  ret void
}

"""
_HASH_IR += _team_entry("kvpool_copy_hash_team", "hash_part", bounds_word=4, parts_word=6)

_Kernel = Callable[[int, int, int, int], None]
_TeamKernel = Callable[[int, int], None]
_OPENMP = ("GOMP_parallel", "omp_get_thread_num", "omp_get_num_threads")
_XXH3 = ("XXH3_64bits_reset", "XXH3_64bits_update_dispatch", "XXH3_64bits_digest")
_lock = threading.Lock()
_team_lock = threading.Lock()
_kernel: _Kernel | None = None
_tried = False
_team: _Team | None = None
_team_failed = False  # no kernel, or the team kernel did not compile: never try again
_engines: list[object] = []  # the JITs that own the kernels' code: kept alive as long as the process
_why_not = ""


@dataclasses.dataclass
class _Team:
    """The team kernels and what they need from the process."""

    copy: _TeamKernel
    max_threads: Callable[[], int]
    copy_hash: _TeamKernel | None  # None where xxhash's XXH3 entry points could not be resolved
    new_state: Callable[[], int | None] | None
    states: list[int] = dataclasses.field(default_factory=list)  # one XXH3 state per member, kept
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)  # one hashed call at a time


def _compile(ir: str, symbols: dict[str, int], names: Sequence[str]) -> list[int]:
    """The addresses of functions ``names`` in ``ir``, compiled for this CPU; ``symbols`` are
    the external functions the IR calls, by address."""
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
    return [int(engine.get_function_address(name)) for name in names]


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
        [address] = _compile(_IR, {}, ["kvpool_stream_copy"])
    except Exception as exc:  # noqa: BLE001 - any failure leaves numpy's copy in place
        _why_not = f"llvmlite could not compile the kernel: {exc}"
        logger.warning("kvpool: non-temporal copies are off (%s); numpy copies instead", _why_not)
        return None
    # CFUNCTYPE, not PYFUNCTYPE: the call releases the GIL, so copy threads run in parallel.
    return ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(address)


def _symbols(lib: ctypes.CDLL, names: Sequence[str]) -> dict[str, int]:
    """The addresses of ``names`` in ``lib``; AttributeError where one is missing."""
    found = {name: int(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0) for name in names}
    if not all(found.values()):
        raise AttributeError(f"no address for {[n for n, a in found.items() if not a]}")
    return found


def _xxh3() -> tuple[dict[str, int], Callable[[], int | None]] | None:
    """XXH3's streaming entry points in the xxhash module kvpool hashes with, and its
    `XXH3_createState`; None where that module does not export them."""
    try:
        import xxhash._xxhash as binding

        lib = ctypes.CDLL(binding.__file__)
        symbols = _symbols(lib, _XXH3)
        create = lib.XXH3_createState
    except (ImportError, AttributeError, OSError):
        return None
    create.restype, create.argtypes = ctypes.c_void_p, []
    return symbols, create


def _build_team() -> _Team | None:
    """The team kernels and the runtime's `omp_get_max_threads`, where the process has loaded an
    OpenMP runtime into its global namespace (vLLM's CPU worker preloads torch's libgomp; torch
    itself loads it globally); None without one. The hashing kernel is left out (None) where
    xxhash's entry points are not found."""
    global _team_failed
    if kernel() is None:
        _team_failed = True
        return None
    try:
        runtime = ctypes.CDLL(None)
        symbols = _symbols(runtime, _OPENMP)
        max_threads = runtime.omp_get_max_threads
    except (AttributeError, OSError):
        return None  # no OpenMP runtime in this process (yet): copies use Python threads
    max_threads.restype, max_threads.argtypes = ctypes.c_int, []
    xxh3 = _xxh3()
    ir, names = _IR + _TEAM_IR, ["kvpool_stream_copy_team"]
    if xxh3 is not None:
        ir, names = ir + _HASH_IR, [*names, "kvpool_copy_hash_team"]
        symbols.update(xxh3[0])
    try:
        addresses = _compile(ir, symbols, names)
    except Exception as exc:  # noqa: BLE001 - the single-thread kernel and Python threads remain
        _team_failed = True
        logger.warning("kvpool: copies on the OpenMP team are off (could not compile: %s)", exc)
        return None
    kind = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int32)
    return _Team(copy=kind(addresses[0]), max_threads=max_threads,
                 copy_hash=kind(addresses[1]) if xxh3 is not None else None,
                 new_state=xxh3[1] if xxh3 is not None else None)


def kernel() -> _Kernel | None:
    """The compiled kernel (built on first use), or None where copies stay numpy's."""
    global _kernel, _tried
    if not _tried:
        with _lock:
            if not _tried:
                _kernel = _build()
                _tried = True
    return _kernel


def team_threads(hashed: bool = False) -> int:
    """How many threads `copy_segments_team` (``hashed``: `copy_hash_team`) would copy on for
    the calling thread: the size of its OpenMP team, or 0 where it cannot be used. Only the
    process's main thread uses its team: in vLLM's CPU worker that is the thread whose team
    vLLM pinned one to a core and computes with, while any other thread calling into OpenMP
    would start a team of its own."""
    if threading.current_thread() is not threading.main_thread():
        return 0
    team = _team_kernel()
    if team is None or (hashed and team.copy_hash is None):
        return 0
    return max(0, int(team.max_threads()))


def _team_kernel() -> _Team | None:
    """Built once an OpenMP runtime is there; until then looked for again on each call (a few
    microseconds), so that a process that imports torch after its first copy still gets it."""
    global _team, _team_failed
    if _team is None and not _team_failed:
        with _team_lock:  # not `_lock`: building the team kernel takes `kernel()` first
            if _team is None and not _team_failed:
                _team = _build_team()
    return _team


def _tables(dsts: list[int], srcs: list[int], sizes: list[int]) -> tuple[np.ndarray, list[int]]:
    """The three tables as rows of one uint64 array, and the rows' addresses."""
    table = np.array((dsts, srcs, sizes), dtype=np.uint64)
    row = table.strides[0]
    return table, [table.ctypes.data + i * row for i in range(3)]


def copy_segments_team(dsts: list[int], srcs: list[int], sizes: list[int], threads: int) -> None:
    """`copy_segments` on the calling thread's OpenMP team of ``threads`` (the caller checked
    `team_threads()`), split into one run of consecutive segments per thread with about the same
    number of bytes. Returns when every thread has finished and its stores are visible."""
    assert _team is not None
    if not sizes:
        return
    table, rows = _tables(dsts, srcs, sizes)
    parts = max(1, min(threads, len(sizes)))
    bounds = split_bounds(table[2], parts)
    header = np.array((*rows, bounds.ctypes.data, parts), dtype=np.uint64)
    _team.copy(header.ctypes.data, parts)


def copy_hash_team(dsts: list[int], srcs: list[int], sizes: list[int], firsts: list[int],
                   threads: int) -> np.ndarray:
    """Copy segments as `copy_segments` does (ordinary stores), on the calling thread's OpenMP
    team of ``threads`` (the caller checked `team_threads(hashed=True)`), and return each
    value's XXH3-64 of what its destinations now hold: `buffers.checksum` of them. Value v is
    segments ``firsts[v]`` to ``firsts[v + 1]`` (``firsts`` has one entry more than there are
    values); each thread takes a run of whole values with about the same number of bytes."""
    team = _team
    assert team is not None and team.copy_hash is not None and team.new_state is not None
    values = len(firsts) - 1
    digests = np.zeros(max(values, 0), dtype=np.uint64)
    if values <= 0:
        return digests
    table, rows = _tables(dsts, srcs, sizes)
    starts = np.asarray(firsts, dtype=np.uint64)
    ends = np.concatenate(([0], np.cumsum(table[2], dtype=np.uint64)))  # bytes before segment j
    value_bytes = ends[starts[1:].astype(np.intp)] - ends[starts[:-1].astype(np.intp)]
    parts = max(1, min(threads, values))
    bounds = split_bounds(value_bytes, parts)
    with team.lock:
        while len(team.states) < parts:
            state = team.new_state()
            if not state:
                raise MemoryError("XXH3_createState returned NULL")
            team.states.append(state)
        states = np.array(team.states[:parts], dtype=np.uint64)
        header = np.array((*rows, starts.ctypes.data, bounds.ctypes.data, digests.ctypes.data, parts,
                           states.ctypes.data), dtype=np.uint64)
        team.copy_hash(header.ctypes.data, parts)
    return digests


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
        hashed = " (checked `server` reads too)" if team_threads(hashed=True) > 1 else ""
        where = (f"; a batch from the main thread runs on its OpenMP team of {team}{hashed}" if team > 1 else "")
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
    table, rows = _tables(dsts, srcs, sizes)  # `table` holds the rows' memory until the call returns
    fn(*rows, len(sizes))
