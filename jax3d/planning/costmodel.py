"""Memory and step-time estimates of one layout, from the published formulas (Megatron-LM;
Korthikanti et al. for activations): `estimate` prices a config on a layout and a `Hardware`.

The estimate models what jax3d's step really does, so that it can be checked against XLA's own
figure (`python -m jax3d.plan --verify`) and printed by the trainer before the first step. Its two
halves, each one read:
  memory  jax3d/planning/memory_model.py: parameters, gradients, optimizer state, the pipeline's
          activations (read off the real layer's residuals) and the head, per device;
  time    jax3d/planning/time_model.py: compute at a share of peak, tp/pp/dp traffic over the
          links each axis is placed on, the dp all-reduce partly hidden, the bubble as waste.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from jax3d.config import RunPlan
from jax3d.model import formulas
from jax3d.planning import memory_model, time_model
from jax3d.planning.hardware import BYTES, GB, Hardware
from jax3d.planning.memory_model import layer_residual_bytes, local_params

if TYPE_CHECKING:
  from jax3d.config import Config

__all__ = [
  'BYTES',
  'GB',
  'Estimate',
  'Hardware',
  'estimate',
  'layer_residual_bytes',
  'local_params',
  'param_count',
]


# Kernels priced as another whose residuals they match: Pallas keeps q, k, v (and the documents'
# segment ids, no bias) and recomputes its forward in the backward, no [s, s] array, as blockwise
# (whose trace adds a logsumexp [b, heads, s], small); `fused` (auto on GPUs) is Pallas on rows of
# documents and cuDNN without a mask on rows of one document (no bias either).
PRICED_AS = {'pallas': 'blockwise', 'fused': 'blockwise'}


@dataclasses.dataclass
class Estimate:
  """Bytes per device (`breakdown`, `total_bytes`) and seconds per step (`times`) of one layout."""

  breakdown: dict
  times: dict
  plan: RunPlan
  remat: str
  shard_optimizer: bool
  model_flops_per_token: float
  device_memory_bytes: float | None = None
  schedule: str = 'gpipe'  # pipeline.schedule
  zero3: str | None = None  # ZeRO-3's gather ('layer' or 'step'; train.shard_params), None without it
  loss_chunks: int = 1  # train.loss_chunks

  @property
  def bubble(self) -> float:
    """Idle share of the pipeline loop: (p-1)/(v*m+p-1), GPipe's and 1F1B's (its loop computes
    forwards and backwards in v*m+p-1 ticks each, jax3d/parallel/pipeline/timetable.py)."""
    return self.plan.bubble

  @property
  def total_bytes(self) -> float:
    return sum(self.breakdown.values())

  @property
  def step_time_s(self) -> float:
    return self.times['step']

  @property
  def tokens_per_s(self) -> float:
    return self.plan.tokens_per_step / self.step_time_s

  @property
  def mfu(self) -> float:
    """The trainer's MFU (formulas.mfu, the same FLOPs per token) at the estimated tokens/s."""
    return formulas.mfu(
      self.tokens_per_s, self.model_flops_per_token, self.times['peak'], self.plan.n_devices
    )

  @property
  def fits(self) -> bool:
    return self.device_memory_bytes is None or self.total_bytes <= self.device_memory_bytes

  @property
  def reason(self) -> str:
    if self.fits:
      return ''
    return f'needs {self.total_bytes / GB:.1f} GB per GPU, has {self.device_memory_bytes / GB:.4g}'

  def describe(self) -> str:
    parts = ', '.join(f'{k} {v / GB:.2f}' for k, v in self.breakdown.items())
    return (
      f'estimated {self.total_bytes / GB:.2f} GB per device ({parts}); step '
      f'{self.step_time_s:.3g} s, bubble {self.bubble:.0%}, MFU {self.mfu:.0%}'
    )


def _visible_hardware(cfg: Config) -> Hardware:
  """The default cluster, with the attention kernel train.attention picks on the devices jax sees
  (jax3d/model/attention.py `resolve`)."""
  import jax

  from jax3d.model import attention

  devices = jax.devices()
  head_dim = cfg.model.head_dim or cfg.model.d_model // cfg.model.n_heads
  choice = cfg.train.attention  # GPU kernels are priced as theirs on any devices (planning for GPUs)
  kernel = (
    choice
    if choice in ('cudnn', 'pallas')
    else attention.resolve(choice, devices, cfg.train.compute_dtype, head_dim)
  )
  return Hardware(flash_attention=kernel != 'xla', attention=kernel, gpu=devices[0].platform == 'gpu')


def estimate(
  cfg: Config,
  plan: RunPlan,
  gpu_memory_bytes: float | None = None,
  hw: Hardware | None = None,
) -> Estimate:
  """Memory per device and step time of `cfg` on the layout `plan` (see the module docstring).
  Without `hw` (the trainer's call) the devices are the ones jax sees (`_visible_hardware`)."""
  hw = _visible_hardware(cfg) if hw is None else hw
  return Estimate(
    breakdown=memory_model.breakdown(cfg, plan, PRICED_AS.get(hw.kernel, hw.kernel), hw.gpu),
    times=time_model.step_times(cfg, plan, hw),
    plan=plan,
    remat=cfg.train.remat,
    shard_optimizer=bool(cfg.train.shard_optimizer),
    model_flops_per_token=formulas.flops_per_token(memory_model.model_dims(cfg, plan), plan.seq_len),
    device_memory_bytes=gpu_memory_bytes,
    schedule='1f1b' if memory_model.one_f_one_b(cfg, plan) else 'gpipe',
    zero3=memory_model.gather_mode(cfg, plan),
    loss_chunks=cfg.train.loss_chunks,
  )


def param_count(cfg: Config) -> int:
  """The real model's parameters (padded vocabulary rows excluded): formulas.param_count."""
  return formulas.param_count(memory_model.model_dims(cfg))
