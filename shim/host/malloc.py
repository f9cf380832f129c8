"""glibc's malloc tuned for the agent's working set: a few buffers of several MiB per chunk worker.

By default glibc serves every allocation above its mmap threshold (128 KiB, raised only as large
blocks are freed) with a fresh mmap and hands it back on free, so each chunk's buffers (the sealed
blob, the opened one, the decompressed chunk: up to 16 MiB each) are page-faulted in anew (the
restore's download phase in `bench/encryption.py`, before and after this module: docs/performance.md,
"The cost of encryption at rest"). So: large blocks from the heap (mmap only above 32 MiB, glibc's
maximum), up to 64 MiB of freed heap kept for the next chunk, and two arenas for all threads, so that
what one worker frees the next one reuses instead of each thread keeping its own. The working set
stays bounded by the chunk workers' memory budget (shim/engine/stream.py); only its reuse changes.
Nothing happens where the C library is not glibc.
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
SETTINGS = ((M_ARENA_MAX, 2), (M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, 64 << 20))


def tune() -> bool:
    """Apply SETTINGS with mallopt(3); False where there is no glibc mallopt (nothing changed)."""
    try:
        # the symbols the interpreter is linked with (dlopen(NULL)): the C library's, without
        # ctypes.util.find_library, which runs `ldconfig -p` (a process start on every agent command)
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in SETTINGS)
