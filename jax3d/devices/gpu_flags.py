"""XLA flags for NVIDIA GPUs: overlap communication with computation. Applied before jax starts.

On a GPU machine `python -m jax3d.train` (and the other jax3d commands that call
`cli.prepare_devices`) add these flags to XLA_FLAGS before the backend starts:

  --xla_gpu_enable_latency_hiding_scheduler=true      schedule collectives asynchronously, so the
                                                      gradient reduction of one layer runs while the
                                                      next layer's backward pass computes
  --xla_gpu_enable_highest_priority_async_stream=true  collectives on a high-priority stream
  --xla_gpu_enable_pipelined_all_gather=true          move ZeRO-1's parameter all-gathers and the
  --xla_gpu_enable_pipelined_reduce_scatter=true      reduce-scatters / all-reduces of scanned layers
  --xla_gpu_enable_pipelined_all_reduce=true          into the neighbouring loop iteration
  --xla_gpu_enable_while_loop_double_buffering=true   double-buffer scanned loops (layers, pipeline)
  --xla_gpu_all_reduce_combine_threshold_bytes=...    combine small collectives (fewer launches)
  --xla_gpu_all_gather_combine_threshold_bytes=...
  --xla_gpu_reduce_scatter_combine_threshold_bytes=...

Precedence: a flag the user already put in XLA_FLAGS is never overridden (ours are appended only
for names not present); JAX3D_NO_GPU_FLAGS=1 turns all of this off. Nothing is set on a machine
without a GPU, nor when JAX_PLATFORMS names no GPU platform.

Detection never imports or initialises jax (XLA_FLAGS is read once, when the backend starts): a
CUDA plugin for jax must be installed (`jax_cuda12_plugin` / `jax_cuda13_plugin`, from
`pip install jax[cuda12]`) and an NVIDIA device must be visible (/dev/nvidia0 or
/proc/driver/nvidia/gpus/*), and CUDA_VISIBLE_DEVICES must not hide them all.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from collections.abc import Mapping, MutableMapping

COMBINE_BYTES = 128 * 2**20

GPU_FLAGS = (
  '--xla_gpu_enable_latency_hiding_scheduler=true',
  '--xla_gpu_enable_highest_priority_async_stream=true',
  '--xla_gpu_enable_pipelined_all_gather=true',
  '--xla_gpu_enable_pipelined_reduce_scatter=true',
  '--xla_gpu_enable_pipelined_all_reduce=true',
  '--xla_gpu_enable_while_loop_double_buffering=true',
  f'--xla_gpu_all_reduce_combine_threshold_bytes={COMBINE_BYTES}',
  f'--xla_gpu_all_gather_combine_threshold_bytes={COMBINE_BYTES}',
  f'--xla_gpu_reduce_scatter_combine_threshold_bytes={COMBINE_BYTES // 2}',
)
CUDA_PLUGINS = ('jax_cuda12_plugin', 'jax_cuda13_plugin', 'jax_plugins.xla_cuda12', 'jax_plugins.xla_cuda13')


def find_spec(name: str) -> bool:
  try:
    return importlib.util.find_spec(name) is not None
  except (ImportError, ValueError):
    return False


def gpu_present(env: Mapping[str, str] | None = None) -> bool:
  """Whether jax will start a CUDA backend here, decided without importing jax (from `env`, by
  default os.environ, the installed packages and the NVIDIA device files)."""
  env = os.environ if env is None else env
  platforms = env.get('JAX_PLATFORMS', '').lower()
  if platforms and not any(p in platforms for p in ('cuda', 'gpu')):
    return False
  if env.get('CUDA_VISIBLE_DEVICES', None) in ('', '-1'):
    return False
  if not any(find_spec(p) for p in CUDA_PLUGINS):
    return False
  return os.path.exists('/dev/nvidia0') or bool(glob.glob('/proc/driver/nvidia/gpus/*'))


def _flag_name(flag: str) -> str:
  return flag.split('=', 1)[0].lstrip('-')


def apply_gpu_flags(env: MutableMapping[str, str] | None = None) -> list[str]:
  """Appends GPU_FLAGS (those the user did not set) to XLA_FLAGS in `env` (by default os.environ)
  when a GPU is present and JAX3D_NO_GPU_FLAGS is unset. Returns the flags added. Call before jax
  starts its backend."""
  env = os.environ if env is None else env
  if env.get('JAX3D_NO_GPU_FLAGS', '').lower() not in ('', '0', 'false', 'no'):
    return []
  if not gpu_present(env):
    return []
  current = env.get('XLA_FLAGS', '')
  have = {_flag_name(f) for f in current.split()}
  added = [f for f in GPU_FLAGS if _flag_name(f) not in have]
  if added:
    env['XLA_FLAGS'] = ' '.join([current] + added).strip()
  return added
