"""The estimate against XLA's own figure: the real train step of a layout compiled ahead of time
(`python -m jax3d.plan --verify`), its bytes per device beside the estimate's. On fake CPU devices
by default; with `--target=KINDxN` by XLA:GPU for that many GPUs that are not attached
(jax3d/devices/gpu_target.py): the program the GPUs run, cuDNN attention and all."""

from __future__ import annotations

import os

import ml_collections

from jax3d.config import ConfigError, RunPlan
from jax3d.devices import gpu_target
from jax3d.planning.costmodel import GB, Hardware, estimate


def verify_memory(
  cfg: ml_collections.ConfigDict, plan: RunPlan, target: gpu_target.Target | None = None
) -> dict:
  """Ahead-of-time compile of the real train step of `cfg` on plan.n_devices devices (nothing is
  allocated): XLA's bytes per device (`compiled_bytes`, its parts) beside the estimate's
  (`estimate_bytes`) for the attention kernel the program uses; also in GB (1e9 bytes). The
  devices are CPU devices, or `target`'s GPUs (then `device_memory_bytes` and `fits` too)."""
  import jax

  from jax3d import assemble

  if target is None:
    devices, options = jax.devices('cpu'), None
    if len(devices) < plan.n_devices:
      raise ConfigError(
        f'--verify needs {plan.n_devices} CPU devices, {len(devices)} are visible '
        f'(XLA_FLAGS={os.environ.get("XLA_FLAGS", "")!r} was set before the run)'
      )
  else:
    if target.n != plan.n_devices:
      raise ConfigError(f'--target={target.name} has {target.n} GPUs, the plan {plan.n_devices}')
    devices, options = gpu_target.devices(target), gpu_target.compiler_options()
  s = assemble.build(cfg, devices[: plan.n_devices])
  est = estimate(
    s.cfg,
    plan,
    hw=Hardware(
      flash_attention=s.dims.attention != 'xla', attention=s.dims.attention, gpu=target is not None
    ),
  )
  m = assemble.compile_train_step(s, options).memory
  gb = lambda b: round(b / GB, 6)
  out = {
    'compiled_on': f'{plan.n_devices} CPU devices'
    if target is None
    else f'{plan.n_devices} x {target.device_kind}',
    'attention_kernel': s.dims.attention,
    'compiled_bytes': int(m['total']),
    'estimate_bytes': int(est.total_bytes),
    'compiled_memory_gb': gb(m['total']),
    'compiled_breakdown_gb': {k: gb(m[k]) for k in ('argument', 'temp', 'output', 'alias')},
    'estimate_memory_gb': gb(est.total_bytes),
    'estimate_vs_compiled': round(est.total_bytes / m['total'] - 1, 4),
    'bf16_note': (
      'XLA:CPU computes bf16 matmuls in float32, converting around each dot: with bf16 compute '
      "its temporaries exceed a GPU's, and the GPU-minded estimate comes out below them"
    )
    if cfg.train.compute_dtype == 'bfloat16' and target is None
    else None,
  }
  if target is not None:
    out |= {'device_memory_bytes': target.memory_bytes, 'fits': bool(m['total'] <= target.memory_bytes)}
  return out


def verify(
  cfg: ml_collections.ConfigDict, plan: RunPlan, target: gpu_target.Target | None = None
) -> list[str]:
  """`verify_memory` as text lines: XLA's bytes per device beside the estimate's."""
  return render(verify_memory(cfg, plan, target), target)


def render(v: dict, target: gpu_target.Target | None = None) -> list[str]:
  """A `verify_memory` result as text lines."""
  b = v['compiled_breakdown_gb']
  lines = [f'({v["bf16_note"]})'] if v['bf16_note'] else []
  lines += [
    f'XLA (compiled on {v["compiled_on"]}'
    + (f', attention {v["attention_kernel"]}' if target else '')
    + f'): {v["compiled_memory_gb"]:.4f} GB '
    f'per device = arguments {b["argument"]:.4f} + temporaries {b["temp"]:.4f} + '
    f'outputs {b["output"]:.4f} - aliased {b["alias"]:.4f}',
    f'estimate: {v["estimate_memory_gb"]:.4f} GB per device ({v["estimate_vs_compiled"]:+.1%})',
  ]
  if target is not None:
    cap = v['device_memory_bytes']
    lines.append(
      f'{target.device_kind}: {cap / GB:.1f} GB per device: '
      + ('fits' if v['fits'] else 'DOES NOT FIT')
      + f' ({v["compiled_bytes"] / cap:.0%} of it by the GPU compile)'
    )
  return lines
