"""One path from a config to a run, and one from a run to its compiled train step.

  s = run.setup(cfg)                       # validate -> mesh -> Setup (shardings computed once)
  step = run.compile_train_step(s)           # ahead-of-time compile for abstract inputs
  step.memory["total"], step.analysis()      # XLA's bytes per device; FLOPs and collectives

The trainer, the Python API, the sampler, the planner's --verify, the inspector and the
benchmarks all go through these two functions, so what they report is what runs.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import resource
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax3d import config as config_lib
from jax3d.model import llama
from jax3d.parallel import data_parallel, mesh as mesh_lib, microbatch, pipeline, sharding
from jax3d.tools import inspection
from jax3d.training import cpu, optim, step as step_lib


@dataclasses.dataclass(frozen=True, eq=False)
class Setup:
  """Everything the step functions close over. The shardings and abstract shapes are computed on
  first use and kept (never recomputed per call or while tracing)."""

  cfg: ml_collections.ConfigDict
  plan: config_lib.RunPlan
  mesh: Mesh
  dims: llama.Dims
  tx: optax.GradientTransformation
  rules: sharding.Rules

  @property
  def layout(self) -> dict:
    """The layout a checkpoint records (and is re-laid out from)."""
    p = self.plan
    return {
      'dp': p.dp,
      'pp': p.pp,
      'tp': p.tp,
      'microbatches': p.microbatches,
      'repeats': p.repeats,
      'n_layers': self.dims.n_layers,
      'n_devices': p.n_devices,
    }

  @functools.cached_property
  def layer_order(self) -> Any:
    return pipeline.layer_order(self.dims.n_layers, self.plan.pp, self.plan.repeats)

  @functools.cached_property
  def schedule(self) -> optax.Schedule:
    return optim.schedule(self.cfg)

  @functools.cached_property
  def zero1(self) -> bool:
    return data_parallel.zero1(self.cfg, self.plan)

  @functools.cached_property
  def explicit_dp(self) -> bool:
    return data_parallel.explicit(self.cfg, self.plan)

  @functools.cached_property
  def has_residual(self) -> bool:
    return data_parallel.has_residual(self.cfg, self.plan)

  @functools.cached_property
  def param_shardings(self) -> Any:
    return sharding.tree_shardings(llama.param_logical_axes(self.dims), self.mesh, self.rules)

  @functools.cached_property
  def _state_shapes(self) -> dict:
    """The train state's shapes and dtypes (traced once, nothing allocated)."""
    return jax.eval_shape(lambda k: step_lib.init_state(k, self), jax.random.key(0))

  @functools.cached_property
  def zero_shardings(self) -> Any:
    """The ZeRO-1 layout of parameter-shaped trees (moments, reduced gradients, the update)."""
    params = self._state_shapes['params']
    return data_parallel.zero_shardings(params, self.param_shardings, self.mesh, self.plan.dp)

  @functools.cached_property
  def state_shardings(self) -> dict:
    replicated = NamedSharding(self.mesh, P())
    shapes = self._state_shapes
    # ZeRO-1: the moments (every params-shaped leaf of the optimizer state) sharded over dp too.
    moments = self.zero_shardings if self.zero1 else self.param_shardings
    opt = optax.tree_map_params(
      self.tx, lambda _, sh: sh, shapes['opt_state'], moments, transform_non_params=lambda _: replicated
    )
    out = {'step': replicated, 'params': self.param_shardings, 'opt_state': opt}
    if self.has_residual:
      out['grad_residual'] = data_parallel.residual_shardings(self.param_shardings, self.mesh)
    return out

  @functools.cached_property
  def abstract_state(self) -> dict:
    """The train state as shapes with their shardings (for compiling and restoring)."""
    return jax.tree.map(
      lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
      self._state_shapes,
      self.state_shardings,
    )

  @functools.cached_property
  def batch_sharding(self) -> NamedSharding:
    return NamedSharding(self.mesh, P(sharding.DP))

  @property
  def batch_shardings(self) -> dict:
    return {'inputs': self.batch_sharding, 'targets': self.batch_sharding}

  @functools.cached_property
  def abstract_batch(self) -> dict:
    shape = (self.plan.global_batch, self.plan.seq_len)
    return {
      k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.batch_sharding) for k in ('inputs', 'targets')
    }


def resolve(cfg: ml_collections.ConfigDict, n_devices: int | None = None) -> ml_collections.ConfigDict:
  """The config a run really has (a copy; cfg is left as it is), before anything compiles:

  * `checkpoint.init_from=hf:PATH`: model.* from PATH/config.json, its tensors checked (names and
    shapes, from the safetensors headers), and PATH's own tokenizer when data.tokenizer is 'bytes';
  * token shards (data.path) made with a subword tokenizer: that one when data.tokenizer is 'bytes';
  * a subword `data.tokenizer`: its absolute path (recorded in checkpoints, so that jax3d.sample
    finds it) and model.vocab_size from it, or, when an import fixes the vocabulary, a check that
    the tokenizer's fits in it.

  ConfigError (exit 2) naming the file and what is wrong; with `n_devices`, also the layout check,
  naming the imported config.json when its heads do not split over the mesh."""
  from jax3d.hf import config as hf_config
  from jax3d.training import shards, tokenizer as tok_lib

  hf = hf_config.read(cfg.checkpoint.init_from) if hf_config.is_hf(cfg.checkpoint.init_from) else None
  if hf is not None:
    hf_config.check_tensors(hf)
    cfg = hf_config.apply(cfg, hf)
    if cfg.data.tokenizer == tok_lib.BYTES and any(
      os.path.exists(os.path.join(hf.path, n)) for n in ('tokenizer.json', 'tokenizer.model')
    ):
      config_lib.set_key(cfg, 'data.tokenizer', hf.path)
  else:
    cfg = copy.deepcopy(cfg)
  if cfg.data.tokenizer == tok_lib.BYTES and shards.is_shards(cfg.data.path):
    made_with = shards.read_index(cfg.data.path).get('tokenizer', {}).get('path', tok_lib.BYTES)
    if made_with != tok_lib.BYTES and os.path.exists(made_with):  # the shards' own tokenizer
      config_lib.set_key(cfg, 'data.tokenizer', made_with)
  if cfg.data.tokenizer != tok_lib.BYTES:
    tok = tok_lib.load(cfg.data.tokenizer)
    config_lib.set_key(cfg, 'data.tokenizer', tok.path)
    if hf is None:
      config_lib.set_key(cfg, 'model.vocab_size', tok.vocab_size)
    elif tok.vocab_size > cfg.model.vocab_size:
      raise config_lib.ConfigError(
        f'data.tokenizer={tok.path!r} has {tok.vocab_size} tokens, more than model.vocab_size='
        f'{cfg.model.vocab_size} of {hf.path}/config.json'
      )
  if hf is not None and n_devices is not None:
    try:
      config_lib.validate(cfg, n_devices)
    except config_lib.ConfigError as e:
      raise config_lib.ConfigError(f'{e} (model.* from {hf.path}/config.json)') from None
  return cfg


def setup(cfg: ml_collections.ConfigDict, devices: Sequence[jax.Device] | None = None) -> Setup:
  """The one build path: validate the config for these devices (ConfigError, before anything
  compiles), build the ('dp', 'pp', 'tp') mesh, and the run's Setup."""
  devices = list(devices if devices is not None else jax.devices())
  plan = config_lib.validate(cfg, len(devices))
  mesh = mesh_lib.build_mesh(plan, devices, cfg.mesh.allow_tp_across_hosts)
  cpu.retain_freed_memory(devices)  # XLA:CPU only: no page faults on every step's buffers
  return Setup(
    cfg=cfg,
    plan=plan,
    mesh=mesh,
    dims=llama.Dims.from_config(cfg, plan),
    tx=optim.make_optimizer(cfg),
    rules=sharding.logical_rules(
      microbatch.batch_axes(plan), plan.sequence_parallel, microbatch.micro_axes(plan)
    ),
  )


@dataclasses.dataclass(eq=False)
class CompiledStep:
  """The train step compiled for one Setup: call it as `state, metrics = step(state, batch)`
  (it donates the state). `memory` is XLA's figure per device; `analysis()` adds FLOPs and every
  collective against the formulas (jax3d/tools/inspection.py), computed once."""

  setup: Setup
  executable: jax.stages.Compiled
  compile_s: float

  def __call__(self, state: dict, batch: dict) -> tuple[dict, dict]:
    return self.executable(state, batch)

  @functools.cached_property
  def memory(self) -> dict:
    return inspection.memory(self.executable)

  _analysis: dict | None = dataclasses.field(default=None, repr=False)

  def analysis(self) -> dict:
    if self._analysis is None:
      self._analysis = inspection.analyze(self.executable, self.setup)
    return self._analysis


def inspect(cfg: ml_collections.ConfigDict, devices: Sequence[jax.Device] | None = None) -> dict:
  """`python -m jax3d.inspect` in Python: memory, FLOPs and collectives of cfg's compiled step."""
  return compile_train_step(setup(cfg, devices)).analysis()


def compile_train_step(s: Setup) -> CompiledStep:
  """The one compile path: the real train step lowered for the abstract state and batch (nothing
  is allocated) and compiled ahead of time."""
  t0 = time.perf_counter()
  executable = step_lib.make_train_step(s).lower(s.abstract_state, s.abstract_batch).compile()
  return CompiledStep(s, executable, time.perf_counter() - t0)


def benchmark(s: Setup, steps: int, seed: int = 0) -> dict:
  """For the benchmark scripts: the compiled step run `steps` times on a fresh state and one batch
  of random tokens, each step waited for. Returns the CompiledStep, the seconds and the process's
  minor page faults of each step, and the last metrics."""
  compiled = compile_train_step(s)
  state = step_lib.make_init(s)(seed)
  toks = (
    np.random.default_rng(seed)
    .integers(0, s.dims.vocab_size, (s.plan.global_batch, s.plan.seq_len + 1))
    .astype(np.int32)
  )
  batch = {
    'inputs': jax.device_put(toks[:, :-1], s.batch_sharding),
    'targets': jax.device_put(toks[:, 1:], s.batch_sharding),
  }
  times, faults, metrics = [], [], None
  for _ in range(steps):
    t0, f0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics['loss'])
    times.append(time.perf_counter() - t0)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
  return {
    'compiled': compiled,
    'compile_s': compiled.compile_s,
    'step_times': times,
    'page_faults': faults,
    'metrics': metrics,
  }
