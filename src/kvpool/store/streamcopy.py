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
MiB costs a few hundred microseconds more to read back from memory.

The kernel is a few lines of LLVM IR compiled once per process by llvmlite (about 10 ms):
64-byte non-temporal stores to 64-byte aligned lines (the bytes before the first such line and
after the last are copied one by one), unaligned loads, and a fence at the end so that the
stores are visible to other threads (the forward pass) before the caller reports the copy done.
Enabled on x86-64, where it was measured; elsewhere, or without llvmlite, copies stay numpy's.

Invariant: after `copy_segments`, every destination range holds its source range's bytes, and
they are visible to every thread. Callers (`buffers.scatter`, `buffers.gather`) fall back to
numpy's copy where `kernel()` is None, with the same result.
"""

from __future__ import annotations

import ctypes
import logging
import platform
import threading
from collections.abc import Callable

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

define void @kvpool_stream_copy(ptr %dsts, ptr %srcs, ptr %sizes, i64 %k) nounwind {
entry:
  %any = icmp ne i64 %k, 0
  br i1 %any, label %each, label %done
each:
  %j = phi i64 [0, %entry], [%j_next, %each]
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
  %more = icmp ult i64 %j_next, %k
  br i1 %more, label %each, label %done
done:
  fence seq_cst
  ret void
}
!0 = !{i32 1}
"""

_Kernel = Callable[[int, int, int, int], None]
_lock = threading.Lock()
_kernel: _Kernel | None = None
_tried = False
_engine = None  # the JIT that owns the kernel's code: kept alive as long as the process
_why_not = ""


def _build() -> _Kernel | None:
    global _engine, _why_not
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        _why_not = f"not measured on {machine}"
        return None
    try:
        import llvmlite.binding as llvm
    except ImportError:
        _why_not = "llvmlite is not installed"
        return None
    try:
        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
        module = llvm.parse_assembly(_IR)
        module.verify()
        target = llvm.Target.from_default_triple().create_target_machine(
            cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(), opt=3)
        engine = llvm.create_mcjit_compiler(module, target)
        engine.finalize_object()
        address = engine.get_function_address("kvpool_stream_copy")
    except Exception as exc:  # noqa: BLE001 - any failure leaves numpy's copy in place
        _why_not = f"llvmlite could not compile the kernel: {exc}"
        logger.warning("kvpool: non-temporal copies are off (%s); numpy copies instead", _why_not)
        return None
    _engine = engine
    # CFUNCTYPE, not PYFUNCTYPE: the call releases the GIL, so copy threads run in parallel.
    return ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(address)


def kernel() -> _Kernel | None:
    """The compiled kernel (built on first use), or None where copies stay numpy's."""
    global _kernel, _tried
    if not _tried:
        with _lock:
            if not _tried:
                _kernel = _build()
                _tried = True
    return _kernel


def describe() -> str:
    """One phrase for start-up logs: how values are copied."""
    if kernel() is not None:
        return (f"unhashed copies of values of {MIN_BYTES >> 10} KiB and more (the local backend's) "
                "use non-temporal stores")
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
