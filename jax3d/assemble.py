"""The one build path, from a config to a built run, and from a built run to its compiled step.

  s = assemble.build(cfg)                  # resolve -> validate once -> mesh -> shardings -> abstract state
  step = assemble.compile_train_step(s)    # ahead-of-time compile for abstract inputs
  step.memory['total'], step.analysis()    # XLA's bytes per device; FLOPs and collectives

The trainer, the Python API, the sampler, the exporter, the planner's --verify, the inspector and
the benchmarks all go through `build`, so what they report is what the trainer trains: an hf:
import's model, a tokenizer's vocabulary, the layout. `build` returns a `Setup` (jax3d/setup.py).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import resource
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jax3d import config as config_lib, optim, step as step_lib
from jax3d.analysis import inspection
from jax3d.config import Config
from jax3d.data import apportion, corpus as corpus_lib, packing, shards, tokenizer as tok_lib
from jax3d.devices import cpu_heap
from jax3d.errors import ConfigError
from jax3d.hf import config as hf_config, peft
from jax3d.model import attention, fp8, llama, lora
from jax3d.parallel import (
  data_parallel,
  mesh as mesh_lib,
  microbatch,
  placement,
  sharding,
)
from jax3d.setup import Setup


def build(
  cfg: Config | ml_collections.ConfigDict, devices: Sequence[jax.Device] | None = None, saved: bool = False
) -> Setup:
  """The one build path: `resolve` the config (an hf: import, a tokenizer), validate it once for
  these devices (ConfigError, before anything compiles; naming the imported config.json when the
  model came from one) into the typed `Config` that `Setup.cfg` holds, build the ('dp', 'pp', 'tp')
  mesh, the shardings and the train state's abstract shapes. Nothing is allocated or compiled.
  `saved`: cfg is a run's saved config (resolved when the run started), whose model.* is the model
  it was built on: model.vocab_size is kept (an import's can exceed its tokenizer's), not taken from
  the tokenizer again."""
  devices = list(devices if devices is not None else jax.devices())
  resolved, hf = _resolve(cfg, saved)
  try:
    cfg, plan = config_lib.validated(resolved, len(devices))  # the typed config the code reads
  except ConfigError as e:
    if hf is None:
      raise
    raise ConfigError(f'{e} (model.* from {hf.path}/config.json)') from None
  mesh = mesh_lib.build_mesh(plan, devices, cfg.mesh.allow_tp_across_hosts)
  cpu_heap.retain_freed_memory(devices)  # XLA:CPU only: no page faults on every step's buffers
  dims = llama.Dims.from_config(cfg, plan)
  choice = 'blockwise' if plan.cp > 1 else cfg.train.attention  # cp's attention is blockwise's
  dims = dataclasses.replace(
    dims, attention=attention.resolve(choice, devices, cfg.train.compute_dtype, dims.head_dim)
  )
  if dims.fp8:
    fp8.check_devices(devices)
  rules = sharding.logical_rules(
    microbatch.batch_axes(plan), plan.sequence_parallel, microbatch.micro_axes(plan), plan.cp > 1, plan.ep > 1
  )
  s = Setup(
    cfg=cfg,
    plan=plan,
    mesh=mesh,
    dims=dims,
    tx=optim.make_optimizer(cfg),
    lr_schedule=optim.lr_schedule(cfg),
    rules=rules,
    layer_order=placement.layer_order(dims.n_layers, plan.pp, plan.repeats),
    zero1=data_parallel.zero1(cfg, plan),
    zero3=data_parallel.shard_params(cfg, plan),
    explicit_dp=data_parallel.explicit(cfg, plan),
    has_residual=data_parallel.has_residual(cfg, plan),
    param_shardings=sharding.tree_shardings(llama.param_logical_axes(dims), mesh, rules),
    batch_sharding=sharding.batch_sharding(mesh),
    hf=hf,
  )
  return _with_state(s)


def _with_state(s: Setup) -> Setup:
  """`s` with the train state's shapes (traced once, nothing allocated) and shardings."""
  shapes = jax.eval_shape(lambda: step_lib.init_state(jax.random.key(0), s))
  replicated = NamedSharding(s.mesh, P())
  compute = s.param_shardings  # the layers' own layout (tp, pp)
  zero = data_parallel.zero_shardings(shapes['params'], compute, s.mesh)
  gather = None
  if s.zero3:  # ZeRO-3: stored in the ZeRO layout, gathered where used (jax3d/parallel/zero3.py)
    layers = shapes['params']['layers']
    dtypes = llama.gather_dtypes(s.dims, layers)  # matmul weights gathered in the compute dtype
    gather = data_parallel.layer_gather(layers, compute['layers'], s.cfg, s.plan, s.mesh, dtypes)
    s = dataclasses.replace(s, param_shardings=zero)
  # ZeRO-1: the moments (every params-shaped leaf of the optimizer state) sharded over dp too.
  moments = lora.trainable(s.dims, zero if s.zero1 else s.param_shardings)[0]  # LoRA: the adapters'
  opt = {}

  def opt_shardings() -> tuple:  # traced, not run: the optimizer's placeholder init stays abstract
    opt['tree'] = optax.tree_map_params(
      s.tx, lambda _, sh: sh, shapes['opt_state'], moments, transform_non_params=lambda _: replicated
    )
    return ()

  jax.eval_shape(opt_shardings)
  state_sh = {'step': replicated, 'params': s.param_shardings, 'opt_state': opt['tree']}
  if s.has_residual:
    state_sh['grad_residual'] = data_parallel.residual_shardings(lora.trainable(s.dims, compute)[0], s.mesh)
  abstract = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), shapes, state_sh)
  shape = (s.plan.global_batch, s.plan.seq_len)
  batch = {
    k: jax.ShapeDtypeStruct(shape, jnp.float32 if k == 'weights' else jnp.int32, sharding=s.batch_sharding)
    for k in corpus_lib.STEP_KEYS
  }
  return dataclasses.replace(
    s,
    compute_shardings=compute,
    zero_shardings=zero,
    gather=gather,
    state_shardings=state_sh,
    abstract_state=abstract,
    abstract_batch=batch,
  )


def resolve(cfg: Config | ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The config a run really has (a copy; cfg is left as it is), before anything compiles:

  * `checkpoint.init_from=hf:PATH`: model.* from PATH/config.json, its tensors checked (names and
    shapes, from the safetensors headers), and PATH's own tokenizer when data.tokenizer is 'bytes';
    any other init_from (a run to warm-start from), data.path and lora.init_from: their absolute
    paths, and lora.rank, alpha and targets from lora.init_from's adapter_config.json;
  * token shards (data.path, or data.mixture's first source) made with a subword tokenizer: that
    one when data.tokenizer is 'bytes'; data.mixture and data.mixture_stages parsed (ConfigError
    on a fault) and written canonically: absolute paths, normalised weights;
  * a subword `data.tokenizer`: its absolute path (recorded in checkpoints, so that jax3d.sample
    finds it) and model.vocab_size from it, or, when an import fixes the vocabulary, a check that
    the tokenizer's fits in it.

  ConfigError (exit 2) naming the file and what is wrong. `build` calls this; it is public for
  the tools that only need the config (a check of what an import sets)."""
  return _resolve(cfg)[0]


def _resolve(
  cfg: Config | ml_collections.ConfigDict, saved: bool = False
) -> tuple[ml_collections.ConfigDict, hf_config.HFModel | None]:
  """`resolve`, and the Hugging Face folder it read (None without an import); `saved` as in build."""
  cfg = config_lib.editable(cfg)  # a copy (cfg is left as it is), a typed Config written back
  if cfg.lora.init_from:  # absolute; lora.rank, alpha and targets from the PEFT adapter's own config
    config_lib.set_key(cfg, 'lora.init_from', os.path.abspath(cfg.lora.init_from))
    peft.with_lora(cfg, cfg.lora.init_from)
  hf = hf_config.read(cfg.checkpoint.init_from) if hf_config.is_hf(cfg.checkpoint.init_from) else None
  if hf is not None:
    hf_config.check_tensors(hf)
    cfg = hf_config.with_model(cfg, hf)
    config_lib.set_key(cfg, 'checkpoint.init_from', hf_config.PREFIX + hf.path)  # absolute
    if cfg.data.tokenizer == tok_lib.BYTES and any(
      os.path.exists(os.path.join(hf.path, n)) for n in ('tokenizer.json', 'tokenizer.model')
    ):
      config_lib.set_key(cfg, 'data.tokenizer', hf.path)
  elif cfg.checkpoint.init_from:  # a warm start's workdir: absolute, as Orbax reads it
    config_lib.set_key(cfg, 'checkpoint.init_from', os.path.abspath(cfg.checkpoint.init_from))
  if cfg.data.path and os.path.exists(cfg.data.path):  # recorded in checkpoints: any cwd finds it
    config_lib.set_key(cfg, 'data.path', os.path.abspath(cfg.data.path))
  if cfg.data.mixture:  # its paths absolute (recorded in checkpoints); its first source's tokenizer
    spec = apportion.parse(cfg.data.mixture, cfg.data.mixture_stages)
    late = [step for step, _ in spec.stages[1:] if step >= cfg.train.steps]
    if late:  # a stage no step reaches
      raise ConfigError(
        f'data.mixture_stages={cfg.data.mixture_stages!r}: the stage at step {late[0]} is at or past the '
        f"run's end (train.steps={cfg.train.steps}, steps 0..{cfg.train.steps - 1}); every stage must "
        f'start before train.steps'
      )
    for key, value in zip(('data.mixture', 'data.mixture_stages'), spec.canonical(), strict=True):
      config_lib.set_key(cfg, key, value)
  shard_path = cfg.data.path or (spec.paths[0] if cfg.data.mixture else '')
  if cfg.data.tokenizer == tok_lib.BYTES and shards.is_shards(shard_path):
    made_with = shards.read_index(shard_path).get('tokenizer', {}).get('path', tok_lib.BYTES)
    if made_with != tok_lib.BYTES and os.path.exists(made_with):  # the shards' own tokenizer
      config_lib.set_key(cfg, 'data.tokenizer', made_with)
  if cfg.data.tokenizer != tok_lib.BYTES:
    tok = tok_lib.load(cfg.data.tokenizer)
    config_lib.set_key(cfg, 'data.tokenizer', tok.path)
    if hf is None and not saved:
      config_lib.set_key(cfg, 'model.vocab_size', tok.vocab_size)
    elif tok.vocab_size > cfg.model.vocab_size:
      raise ConfigError(
        f'data.tokenizer={tok.path!r} has {tok.vocab_size} tokens, more than model.vocab_size='
        f'{cfg.model.vocab_size} of ' + (f'{hf.path}/config.json' if hf else "the run's saved model")
      )
  return cfg, hf


@dataclasses.dataclass(eq=False)
class CompiledStep:
  """The train step compiled for one Setup: call it as `state, metrics = step(state, batch)`
  (it donates the state). `memory` is XLA's figure per device; `analysis()` adds FLOPs and every
  collective against the formulas (jax3d/analysis/inspection.py), computed once."""

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
  return compile_train_step(build(cfg, devices)).analysis()


def compile_train_step(s: Setup, compiler_options: dict | None = None) -> CompiledStep:
  """The one compile path: the real train step lowered for the abstract state and batch (nothing
  is allocated) and compiled ahead of time. `compiler_options`: XLA options for this compile
  alone (a compile-only GPU target's, jax3d/devices/gpu_target.py)."""
  t0 = time.perf_counter()
  lowered = step_lib.make_train_step(s).lower(s.abstract_state, s.abstract_batch)
  options = dict(compiler_options or {})
  while True:
    try:
      executable = lowered.compile(compiler_options=options) if options else lowered.compile()
      break
    except jax.errors.JaxRuntimeError as e:  # an option this XLA does not have (XLA renames them)
      unknown = re.search(r"No such compile option: '(\w+)'", str(e))
      if not unknown or unknown.group(1) not in options:
        raise
      del options[unknown.group(1)]
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
  batch = {k: jax.device_put(v, s.batch_sharding) for k, v in packing.one_document_rows(toks).items()}
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
