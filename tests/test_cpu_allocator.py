"""The CPU allocator tuning (jax3d/devices/cpu_heap.py): when it applies, and that it removes the page
faults of a large buffer freed and allocated again (what XLA:CPU does with a step's temporaries)."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from jax3d.devices import cpu_heap

# In a fresh process: a 64 MiB buffer written, freed, allocated and written again; prints the
# minor page faults of the second round (the kernel zeroing fresh pages) and whether tuning applied.
# (C malloc through ctypes, as XLA allocates; numpy would madvise huge pages for its own arrays.)
PROBE = """
import ctypes, resource, sys
import jax
from jax3d.devices import cpu_heap
applied = cpu_heap.retain_freed_memory(jax.devices()) if sys.argv[1] == 'tuned' else False
libc, n = ctypes.CDLL('libc.so.6'), 64 * 2**20
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
p = libc.malloc(n); ctypes.memset(p, 1, n); libc.free(p)
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
p = libc.malloc(n); ctypes.memset(p, 2, n)
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


def _probe(kind: str) -> tuple[bool, int]:
  out = subprocess.run([sys.executable, '-c', PROBE, kind], capture_output=True, text=True, check=True)
  applied, faults = out.stdout.split()
  return applied == 'True', int(faults)


@pytest.mark.skipif(not sys.platform.startswith('linux'), reason='glibc mallopt')
def test_freed_buffers_come_back_without_page_faults():
  tuned_applied, tuned = _probe('tuned')
  _, untuned = _probe('untuned')
  assert tuned_applied
  pages = 64 * 2**20 // 4096
  assert untuned > pages // 2, untuned  # glibc mmaps 64 MiB afresh: every page faults again
  assert tuned < pages // 20, tuned  # kept in the heap: the same pages, already there


def test_not_applied_off_cpu_or_when_turned_off(monkeypatch):
  monkeypatch.setattr(cpu_heap, '_applied', False)
  gpu = types.SimpleNamespace(platform='gpu')
  assert not cpu_heap.retain_freed_memory([gpu])
  monkeypatch.setenv('JAX3D_NO_MALLOC_TUNING', '1')
  assert not cpu_heap.retain_freed_memory([types.SimpleNamespace(platform='cpu')])
