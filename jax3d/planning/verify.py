"""The estimate against XLA's own figure: the real train step of a layout compiled ahead of time on
fake CPU devices (`python -m jax3d.plan --verify`), its bytes per device beside the estimate's."""

from __future__ import annotations

import os

import ml_collections

from jax3d.config import ConfigError, RunPlan
from jax3d.planning.costmodel import GB, Hardware, estimate


def verify_memory(cfg: ml_collections.ConfigDict, plan: RunPlan) -> dict:
  """Ahead-of-time compile of the real train step of `cfg` on plan.n_devices CPU devices (nothing
  is allocated): XLA's bytes per device (`compiled_memory_gb` and its parts) beside the CPU-minded
  estimate's (`estimate_memory_gb`), in GB (1e9 bytes); `bf16_note` when compute is bf16."""
  import jax

  from jax3d import assemble

  devices = jax.devices('cpu')
  if len(devices) < plan.n_devices:
    raise ConfigError(
      f'--verify needs {plan.n_devices} CPU devices, {len(devices)} are visible '
      f'(XLA_FLAGS={os.environ.get("XLA_FLAGS", "")!r} was set before the run)'
    )
  est = estimate(cfg, plan, hw=Hardware(flash_attention=False))  # CPU: XLA's own attention
  m = assemble.compile_train_step(assemble.build(cfg, devices[: plan.n_devices])).memory
  gb = lambda b: round(b / GB, 6)
  return {
    'compiled_on_cpu_devices': plan.n_devices,
    'compiled_memory_gb': gb(m['total']),
    'compiled_breakdown_gb': {k: gb(m[k]) for k in ('argument', 'temp', 'output', 'alias')},
    'estimate_memory_gb': gb(est.total_bytes),
    'estimate_vs_compiled': round(est.total_bytes / m['total'] - 1, 4),
    'bf16_note': (
      'XLA:CPU computes bf16 matmuls in float32, converting around each dot: with bf16 compute '
      "its temporaries exceed a GPU's, and the GPU-minded estimate comes out below them"
    )
    if cfg.train.compute_dtype == 'bfloat16'
    else None,
  }


def verify(cfg: ml_collections.ConfigDict, plan: RunPlan) -> list[str]:
  """`verify_memory` as text lines: XLA's bytes per device beside the estimate's."""
  v = verify_memory(cfg, plan)
  b = v['compiled_breakdown_gb']
  return ([f'({v["bf16_note"]})'] if v['bf16_note'] else []) + [
    f'XLA (compiled on {plan.n_devices} CPU devices): {v["compiled_memory_gb"]:.4f} GB per device = '
    f'arguments {b["argument"]:.4f} + temporaries {b["temp"]:.4f} + '
    f'outputs {b["output"]:.4f} - aliased {b["alias"]:.4f}',
    f'estimate: {v["estimate_memory_gb"]:.4f} GB per device ({v["estimate_vs_compiled"]:+.1%})',
  ]
