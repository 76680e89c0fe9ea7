"""The model's sizes and dtypes (`Dims`), read from a config: what every layer is built from."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import ml_collections

from jax3d import config as config_lib
from jax3d.model import formulas


@dataclasses.dataclass(frozen=True)
class Dims:
  n_layers: int
  d_model: int
  n_heads: int
  n_kv_heads: int
  d_ff: int
  vocab_size: int  # the real vocabulary
  vocab_padded: int  # padded to model.vocab_multiple; padded entries never win
  rope_theta: float = 10000.0
  norm_eps: float = 1e-5
  dtype: Any = jnp.float32  # compute
  param_dtype: Any = jnp.float32
  attention: str = 'auto'

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads

  @staticmethod
  def from_config(cfg: ml_collections.ConfigDict, plan: config_lib.RunPlan | None = None) -> Dims:
    """The model of `cfg`; the padded vocabulary comes from `plan` when given (the same number)."""
    m = cfg.model
    vocab_padded = plan.vocab_padded if plan is not None else config_lib.padded_vocab(m)
    return Dims(
      n_layers=m.n_layers,
      d_model=m.d_model,
      n_heads=m.n_heads,
      n_kv_heads=m.n_kv_heads,
      d_ff=m.d_ff,
      vocab_size=m.vocab_size,
      vocab_padded=vocab_padded,
      rope_theta=m.rope_theta,
      norm_eps=m.norm_eps,
      dtype=jnp.dtype(cfg.train.compute_dtype),
      param_dtype=jnp.dtype(cfg.train.param_dtype),
      attention=cfg.train.attention,
    )

  def param_count(self) -> int:
    """Parameters of the real model (padded vocabulary rows excluded): formulas.param_count."""
    return formulas.param_count(self)
