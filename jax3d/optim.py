"""The optimizer: optax AdamW with linear warmup + cosine decay and global-norm clipping. A step with
a non-finite loss or gradient is skipped by the train step (jax3d/step.py), around it.

Weight decay applies to matrices (kernels, embedding), not to norm scales.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from jax3d.config import Config


def lr_schedule(cfg: Config) -> optax.Schedule:
  """The learning rate by step: linear warmup from 0 to train.lr over train.warmup_steps, then
  cosine decay to train.lr * train.min_lr_ratio at train.steps."""
  t = cfg.train
  warmup = min(t.warmup_steps, max(t.steps - 1, 0))
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=t.lr,
    warmup_steps=warmup,
    decay_steps=max(t.steps, warmup + 1),
    end_value=t.lr * t.min_lr_ratio,
  )


def _decay_mask(params: Any) -> Any:
  """True for the parameters weight decay applies to: all but the norm scales."""
  return jax.tree_util.tree_map_with_path(lambda path, _: getattr(path[-1], 'key', None) != 'scale', params)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
  """optax's `clip_by_global_norm` as one scalar factor, min(1, max_norm / norm), times each update.

  optax divides every element by the norm and selects per element; XLA counts a divide as costly
  and will not repeat it in both of Adam's moment updates, so the clipped gradient would be written
  out and read back, two passes over every gradient each step. A multiply is fused into its readers.
  Unclipped updates are returned bit for bit (times 1.0)."""

  def clip(updates: Any, params: Any) -> Any:
    del params
    scale = jnp.minimum(1.0, max_norm / optax.tree.norm(updates))
    return jax.tree.map(lambda u: u * scale.astype(u.dtype), updates)

  return optax.stateless(clip)


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
  """AdamW (with clipping when train.grad_clip > 0) under `lr_schedule(cfg)`."""
  t = cfg.train
  parts = []
  if t.grad_clip > 0:
    parts.append(clip_by_global_norm(t.grad_clip))
  parts.append(
    optax.adamw(lr_schedule(cfg), b1=t.b1, b2=t.b2, eps=1e-8, weight_decay=t.weight_decay, mask=_decay_mask)
  )
  return optax.chain(*parts)


def lr_schedule_count(opt_state: Any, default: jax.Array) -> jax.Array:
  """The step count the learning-rate schedule reads (optax's `ScaleByScheduleState.count`): it
  does not advance on a skipped (non-finite) step, unlike the train step.
  `default` where the optimizer has no schedule state."""
  count = optax.tree.get(
    opt_state, 'count', filtering=lambda path, _: path[-1].tuple_name == 'ScaleByScheduleState'
  )
  return default if count is None else count
