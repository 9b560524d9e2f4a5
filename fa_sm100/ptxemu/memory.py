"""Memory spaces of the emulated machine: global (host buffers registered by the launch),
per-CTA shared memory with an initialized-byte map, and the shared-window address maps.

Address conventions (ours; the PTX ISA leaves the numeric values open):
- shared::cta addresses are 32-bit offsets in the CTA's window; the first 1 KiB is the
  reserved system area of sm_90/sm_100, so dynamic shared memory starts at 0x400 (as on
  hardware, where CuTe's 1024-byte alignment of the dynamic buffer then holds);
- the shared window address of byte ``offset`` of the CTA with cluster rank ``r`` is
  ``r << 24 | offset``, for shared::cta and shared::cluster alike (so a CTA's own shared::cta
  addresses are valid shared::cluster addresses, as the ISA requires, and ``mapa`` replaces
  the rank bits). CuTe relies on this encoding: the 2-CTA TMA clears bit 24 of an mbarrier
  address to name the leader CTA's barrier;
- generic addresses of shared memory are ``SHARED_GENERIC_BASE + window address`` and of
  kernel parameters ``PARAM_GENERIC_BASE + offset`` (``cvta``).
"""

from __future__ import annotations

import ctypes

import numpy as np

RESERVED_SMEM = 0x400
CLUSTER_SHIFT = 24
SHARED_GENERIC_BASE = 1 << 56
SHARED_GENERIC_END = SHARED_GENERIC_BASE + (1 << 32)
PARAM_GENERIC_BASE = 1 << 57                 # generic addresses of kernel parameters
PARAM_GENERIC_END = PARAM_GENERIC_BASE + (1 << 16)


class EmulationError(RuntimeError):
    """A checked violation while running (OOB, uninitialized read, deadlock, ...)."""


class GlobalMemory:
    """Global memory = the host buffers handed to the launch, addressed by their real
    host addresses. Any access outside a registered buffer is an out-of-bounds error."""

    def __init__(self):
        self.bases = np.zeros(0, dtype=np.uint64)
        self.ends = np.zeros(0, dtype=np.uint64)
        self.bufs: list = []
        self.names: list = []

    def register(self, address: int, nbytes: int, name: str = "buffer"):
        arr = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))
        order = np.searchsorted(self.bases, np.uint64(address))
        self.bases = np.insert(self.bases, order, np.uint64(address))
        self.ends = np.insert(self.ends, order, np.uint64(address + nbytes))
        self.bufs.insert(order, arr)
        self.names.insert(order, name)

    def _locate(self, addr: np.ndarray, width: int, what: str):
        addr = addr.astype(np.uint64)
        i = np.searchsorted(self.bases, addr, side="right").astype(np.int64) - 1
        ok = i >= 0
        if ok.all():
            ok = addr + np.uint64(width) <= self.ends[i]
        if not ok.all():
            bad = int(addr[~ok][0])
            raise EmulationError(f"{what}: global address {bad:#x} (+{width} bytes) is outside "
                                 "every buffer of the launch")
        if (i == i[0]).all():
            return [(int(i[0]), (addr - self.bases[i[0]]).astype(np.int64), None)]
        return [(int(r), (addr[i == r] - self.bases[r]).astype(np.int64), i == r)
                for r in np.unique(i)]

    def read(self, addr: np.ndarray, width: int, what: str) -> np.ndarray:
        out = np.empty((len(addr), width), dtype=np.uint8)
        for r, off, sel in self._locate(addr, width, what):
            data = self.bufs[r][off[:, None] + np.arange(width)]
            if sel is None:
                out[:] = data
            else:
                out[sel] = data
        return out

    def write(self, addr: np.ndarray, data: np.ndarray, what: str):
        width = data.shape[1]
        for r, off, sel in self._locate(addr, width, what):
            self.bufs[r][off[:, None] + np.arange(width)] = data if sel is None else data[sel]


class SharedMemory:
    """One CTA's shared memory with a byte map of what has been written."""

    def __init__(self, size: int, cta: int):
        self.size = size
        self.data = np.zeros(size, dtype=np.uint8)
        self.init = np.zeros(size, dtype=bool)
        self.init[:RESERVED_SMEM] = True
        self.cta = cta
        # Note [Async proxy]: per byte, 1 + the cluster-wide id of the thread whose generic
        # store to it has not yet been ordered for the async proxy by a fence.proxy.async of
        # that thread (0: none)
        self.unfenced = np.zeros(size, dtype=np.int32)
        self.unfenced_count = 0

    def check(self, off: np.ndarray, width: int, what: str):
        if len(off) and (off.min() < RESERVED_SMEM or off.max() + width > self.size):
            bad = int(off[(off < RESERVED_SMEM) | (off + width > self.size)][0])
            raise EmulationError(f"{what}: shared address {bad:#x} (+{width} bytes) outside "
                                 f"CTA {self.cta}'s shared memory [{RESERVED_SMEM:#x}, "
                                 f"{self.size:#x})")

    def read(self, off: np.ndarray, width: int, what: str, check_init=True) -> np.ndarray:
        off = off.astype(np.int64)
        self.check(off, width, what)
        idx = off[:, None] + np.arange(width)
        if check_init and not self.init[idx].all():
            bad = int(idx[~self.init[idx]][0])
            raise EmulationError(f"{what}: read of uninitialized shared memory at {bad:#x} "
                                 f"(CTA {self.cta})")
        return self.data[idx]

    def write(self, off: np.ndarray, data: np.ndarray, what: str, writers=None):
        """Store bytes; ``writers`` (one cluster-wide thread id per row) marks a generic-proxy
        store that the async proxy does not see until those threads fence (Note [Async
        proxy]); asynchronous writes (TMA) pass None."""
        off = off.astype(np.int64)
        width = data.shape[1]
        self.check(off, width, what)
        idx = off[:, None] + np.arange(width)
        self.data[idx] = data
        self.init[idx] = True
        if writers is not None:
            self.unfenced[idx] = (np.asarray(writers, dtype=np.int32) + 1)[:, None]
            self.unfenced_count += idx.size

    def fence_proxy_async(self, threads):
        """``fence.proxy.async`` by ``threads`` (cluster-wide ids): their generic stores here
        become visible to the async proxy."""
        if self.unfenced_count:
            mine = np.isin(self.unfenced, np.asarray(threads, dtype=np.int32) + 1)
            self.unfenced[mine] = 0
            self.unfenced_count = int(np.count_nonzero(self.unfenced))

    def check_async_read(self, lo: int, hi: int, what: str):
        """The async proxy reads [lo, hi): a generic store there that its thread has not
        fenced is invisible to it (Note [Async proxy])."""
        if self.unfenced_count:
            hit = np.nonzero(self.unfenced[lo:hi])[0]
            if hit.size:
                tid = int(self.unfenced[lo + hit[0]]) - 1
                raise EmulationError(
                    f"{what}: shared [{lo + int(hit[0]):#x}] was written by a generic-proxy "
                    f"store of thread {tid % 1024} (CTA {tid // 1024}) that no "
                    f"fence.proxy.async of that thread has made visible to the async proxy")


def to_bytes(values: np.ndarray, dtype) -> np.ndarray:
    """(n,) values -> (n, itemsize) uint8."""
    v = np.ascontiguousarray(values.astype(dtype, copy=False))
    return v.view(np.uint8).reshape(len(v), -1)


def from_bytes(data: np.ndarray, dtype) -> np.ndarray:
    return np.ascontiguousarray(data).view(dtype).reshape(len(data))
