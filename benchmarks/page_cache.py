"""Files and the page cache for quant_gpu's load benchmark: sizes, eviction (cold), a full read (warm) and
the resident fraction read back with mincore, the evidence that "cold" was cold. Standard library only."""
from __future__ import annotations

import ctypes
import mmap
import os


def files_under(directory: str) -> list[str]:
    return sorted(os.path.join(root, name) for root, _, names in os.walk(directory) for name in names)


def bytes_on_disk(directory: str) -> int:
    return sum(os.path.getsize(p) for p in files_under(directory))


def evict(directory: str) -> None:
    """Drop the directory's files from the page cache: DONTNEED drops clean pages only, hence sync first."""
    os.sync()
    for path in files_under(directory):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def prewarm(directory: str, chunk: int = 64 << 20) -> None:
    """Read every file once, so that a warm load finds all of it in the page cache."""
    for path in files_under(directory):
        with open(path, "rb", buffering=0) as f:
            while f.read(chunk):
                pass


def resident_fraction(directory: str) -> float | None:
    """Fraction of the directory's pages in the page cache (mincore over a read-only mapping, which reads
    nothing); None where libc will not tell. It is the evidence that "cold" was cold in this VM (a
    hypervisor's own cache below the guest can still make cold reads fast: that one we can not see)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [
            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        page, resident, total = mmap.PAGESIZE, 0, 0
        for path in files_under(directory):
            size = os.path.getsize(path)
            if size:
                resident += _resident_pages(libc, path, size, page)
                total += -(-size // page)
        return resident / total if total else None
    except (OSError, AttributeError):
        return None


def _resident_pages(libc, path: str, size: int, page: int) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            vec = (ctypes.c_ubyte * -(-size // page))()
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
            return len(vec) - bytes(vec).count(0)
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def filesystem_of(path: str) -> str | None:
    """Type of the filesystem holding `path` (/proc/mounts, longest mount point): on tmpfs the files are
    the page cache, so no load from there can be cold."""
    try:
        with open("/proc/mounts") as f:
            mounts = [line.split()[1:3] for line in f]
    except OSError:
        return None
    path = os.path.realpath(path)
    inside = [(m, t) for m, t in mounts if path == m or path.startswith(m.rstrip("/") + "/")]
    return max(inside, key=lambda mt: len(mt[0]))[1] if inside else None
