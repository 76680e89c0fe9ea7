"""jax3d: a JAX/XLA SPMD trainer for language models with 3D (dp x pp x tp) parallelism.

The public API (jax3d/api.py), loaded on first use:

  use_fake_cpu_devices(n)   n fake CPU devices; call before anything touches jax devices
  load_config(name, ...)    a config from configs/ with overrides
  build(cfg, workdir)       a Trainer with its mesh and sharded state (restored if workdir has one)
  Trainer                   .train() .evaluate() .sample() .summary() .close()
  placement(t)              which device holds which (dp, pp, tp) coordinate
  sharding_table(t)         every parameter: shape, logical axes, PartitionSpec, per-device shape
  bubble(pp, m, v)          the pipeline bubble (p-1)/(v*m+p-1)
  compiled_memory(cfg)      XLA's bytes per device for the real train step
  plan_layouts(cfg, ...)    the planner: layouts of a model on a GPU cluster, ranked
  sample(t_or_workdir, ...) text from a trainer or a run's checkpoint (also python -m jax3d.sample)
  batch(cfg, step)          the global batch step `step` trains on, as numpy (also python -m jax3d.batch)

Why lazy: `import jax3d` must not start jax's backend (fake CPU devices are fixed when it starts)
and must not import the command modules (`python -m jax3d.plan` would then run a second copy of
an already-imported module). Submodules (`jax3d.plan`, `jax3d.step`, ...) load on first access.
"""

from __future__ import annotations

import importlib
import typing as _typing  # private name: dir(jax3d) lists the package's globals

__version__ = '0.1.0'

_API = (
  'use_fake_cpu_devices',
  'load_config',
  'build',
  'Trainer',
  'placement',
  'sharding_table',
  'format_table',
  'bubble',
  'compiled_memory',
  'plan_layouts',
  'Plan',
  'losses',
  'export_hf',
)
__all__ = list(_API) + ['sample', 'batch']


def __getattr__(name: str) -> _typing.Any:
  if name in _API:
    return getattr(importlib.import_module('jax3d.api'), name)
  # `sample` and `batch` are the modules behind `python -m jax3d.sample` / `jax3d.batch`, callable
  # as the API functions.
  if not name.startswith('_'):
    try:
      return importlib.import_module(f'jax3d.{name}')
    except ModuleNotFoundError as e:
      if e.name != f'jax3d.{name}':
        raise
  raise AttributeError(f"module 'jax3d' has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))
