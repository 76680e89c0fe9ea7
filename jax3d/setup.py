"""The built run: `Setup`, everything a built run is, as one plain frozen record every layer reads.

`jax3d.assemble.build(cfg)` fills it in (resolve the config -> validate once -> mesh -> shardings
-> abstract state); nothing here computes anything or imports the layers above, so the model, the
pipeline, the train step, the analysis and the trainer can all take a `Setup` without depending
on how it was built.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding

from jax3d.config import Config, RunPlan


@dataclasses.dataclass(frozen=True, eq=False)
class Setup:
  """A built run (see the module docstring). The fields after `batch_sharding` exist once the
  train state's shapes are known; `assemble.build` returns records with every field set."""

  cfg: Config  # the resolved config, typed (an hf: import's model.*, the tokenizer's vocabulary)
  plan: RunPlan  # the validated layout and batch sizes
  mesh: Mesh  # ('dp', 'pp', 'tp')
  dims: Any  # jax3d.model.dims.Dims: the model's shapes and dtypes
  tx: optax.GradientTransformation  # the optimizer chain
  lr_schedule: optax.Schedule  # the learning rate of each step
  rules: Any  # jax3d.parallel.sharding.Rules: logical axis -> mesh axes
  layer_order: np.ndarray  # position j of the stacked layers holds canonical layer layer_order[j]
  zero1: bool  # Adam's moments and the reduced gradients sharded over dp (ZeRO-1, or under ZeRO-3)
  zero3: bool  # the parameters stored sharded over dp too (train.shard_params, resolved)
  explicit_dp: bool  # the dp gradient sum written by hand (ZeRO-1, bf16/int8 reductions)
  has_residual: bool  # int8 error feedback: the state carries a residual per dp rank
  param_shardings: Any  # a NamedSharding per parameter, as stored (the ZeRO layout under ZeRO-3)
  batch_sharding: NamedSharding  # token batches: rows over dp
  hf: Any = None  # jax3d.hf.config.HFModel of an hf: import (read once), else None
  compute_shardings: Any = None  # the parameters as the layers use them (tp, pp): gathered over dp
  zero_shardings: Any = None  # the ZeRO layout of parameter-shaped trees (dp on each zero_dim)
  gather: Any = None  # jax3d.parallel.zero3.Gather of the stacked layers under ZeRO-3, else None
  state_shardings: Any = None  # the train state's shardings
  abstract_state: Any = None  # the train state as ShapeDtypeStructs with their shardings
  abstract_batch: Any = None  # the steps' batch keys (data.corpus.STEP_KEYS) as ShapeDtypeStructs

  @property
  def layout(self) -> dict:
    """The layout a checkpoint records (and is re-laid out from)."""
    p = self.plan
    return {
      'dp': p.dp,
      'pp': p.pp,
      'tp': p.tp,
      'cp': p.cp,
      'microbatches': p.microbatches,
      'repeats': p.repeats,
      'n_layers': self.dims.n_layers,
      'n_devices': p.n_devices,
    }

  @property
  def batch_shardings(self) -> dict:
    return {k: self.batch_sharding for k in self.abstract_batch}

  @property
  def devices(self) -> list[jax.Device]:
    """The run's devices, in mesh order."""
    return list(self.mesh.devices.flat)
