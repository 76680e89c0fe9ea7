"""XLA:CPU runs: keep the step's freed buffers in the process heap instead of returning them to
the kernel. Applied by `assemble.build` when every device of the run is a CPU device.

XLA:CPU allocates a step's temporaries (activations, the stacked gradients of the scanned layers,
optimizer intermediates) with the C allocator at every execution and frees them at its end. glibc
serves large blocks with fresh `mmap`s and unmaps them on free, and trims the heap's top back
to the kernel, so every step touches new pages (minor page faults, each page zeroed by the
kernel). With glibc's `mallopt`: no mmap for blocks its arenas can hold (M_MMAP_MAX=0), no
trimming (M_TRIM_THRESHOLD), and 64 MiB of head room on each heap extension (M_TOP_PAD), a step
reuses the pages of the steps before it (`python scripts/bench_step.py --malloc-sweep` measures
the difference). The process keeps its high-water heap (resident memory does not shrink after the
largest step), which a trainer reaches on its first step anyway.

Nothing happens on GPU or TPU runs (their buffers live in device memory, with their own
allocators), on a C library without `mallopt` (macOS, musl), or with JAX3D_NO_MALLOC_TUNING=1.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Sequence

import jax

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4
SETTINGS = ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1), (M_TOP_PAD, 64 * 2**20))
_applied = False


def retain_freed_memory(devices: Sequence[jax.Device]) -> bool:
  """Tune glibc's allocator as above when every device is a CPU device; returns whether it is
  (now or by an earlier call) in effect. Idempotent, process-wide."""
  global _applied
  if _applied:
    return True
  if os.environ.get('JAX3D_NO_MALLOC_TUNING') == '1' or any(d.platform != 'cpu' for d in devices):
    return False
  try:
    libc = ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6')
    mallopt = libc.mallopt
  except (OSError, AttributeError):
    return False
  mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
  _applied = all(mallopt(param, value) == 1 for param, value in SETTINGS)
  return _applied
