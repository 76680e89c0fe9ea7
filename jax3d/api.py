"""The public Python API: what a notebook or a script needs, in a few functions.

  import jax3d
  jax3d.use_fake_cpu_devices(8)                  # before anything touches a device
  cfg = jax3d.load_config('tiny', model__d_model=64, train__steps=5)
  t = jax3d.build(cfg)                           # mesh + sharded state, ready to train
  jax3d.sharding_table(t)                        # where every parameter lives
  t.train(); t.evaluate(); jax3d.sample(t, 'def ')

Why a separate module: the modules behind it (trainer, step, plan, ...) are free to change their
internals; these names and signatures are the contract the notebook and users rely on.

Nothing here imports jax at module import time, and nothing touches a device until a function
that needs one is called: `use_fake_cpu_devices` only works before jax starts its backend, so
`import jax3d` must not start it.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from jax3d.analysis.sharding_table import format_table, sharding_table  # light: no jax at import
from jax3d.trainer.workdir import sample  # the API function `sample` (light: no jax at import)

if TYPE_CHECKING:  # at run time `Trainer` is imported on first use (module __getattr__ below)
  import jax
  import ml_collections
  import numpy as np

  from jax3d.config import Config
  from jax3d.planning.costmodel import Hardware
  from jax3d.trainer.trainer import Trainer

__all__ = [
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
  'sample',
  'losses',
  'export_hf',
  'batch',
]


# ---------------------------------------------------------------------------------------------
# Devices and configs
# ---------------------------------------------------------------------------------------------
def use_fake_cpu_devices(n: int = 8) -> int:
  """Makes the host CPU look like `n` devices, so 3D layouts run on a laptop. Returns n.

  XLA reads `--xla_force_host_platform_device_count` once, when jax starts its backend (the first
  call that needs a device), so this must run before that; it raises if the backend is already up
  with another count rather than silently training on one device. An XLA_FLAGS the user set is
  kept (they chose their devices). On a GPU machine the GPUs stay the default devices."""
  from jax3d.parallel import mesh as mesh_lib

  mesh_lib.use_fake_cpu_devices(n)
  if 'jax' in sys.modules and _backend_started():
    import jax

    have = len(jax.devices('cpu'))
    if have != n and f'device_count={n}' not in os.environ.get('XLA_FLAGS', ''):
      raise RuntimeError(
        f'jax has already started with {have} CPU device(s); call '
        f'jax3d.use_fake_cpu_devices({n}) before anything uses jax devices '
        '(restart the kernel or interpreter)'
      )
  return n


def _backend_started() -> bool:
  try:
    from jax._src import xla_bridge

    return bool(xla_bridge.backends_are_initialized())
  except Exception:  # a jax without this helper: assume not started, the flag is then in time
    return False


def load_config(
  name_or_path: str = 'tiny', overrides: Mapping[str, Any] | None = None, **kw: Any
) -> ml_collections.ConfigDict:
  """A config from `configs/NAME.py` (or a path), with overrides, validated keys, locked.

  Overrides come as a dict with dotted keys (`{'mesh.tp': 4}`) and/or keywords with `__` for the
  dot (`mesh__tp=4`), because keywords cannot hold dots. Unknown keys raise `ConfigError` listing
  the valid ones, so a typo never silently trains the default."""
  from jax3d import config as config_lib

  merged = dict(overrides or {})
  merged.update({k.replace('__', '.'): v for k, v in kw.items()})
  return config_lib.load_config(name_or_path, merged)


def _with(cfg: Config | ml_collections.ConfigDict, **kw: Any) -> ml_collections.ConfigDict:
  """A copy of cfg (a ConfigDict or a Trainer's typed `cfg`) with `a__b=value` overrides."""
  from jax3d import config as config_lib

  cfg = config_lib.editable(cfg)
  for k, v in kw.items():
    config_lib.set_key(cfg, k.replace('__', '.'), v)
  return cfg


# ---------------------------------------------------------------------------------------------
# Building a run
# ---------------------------------------------------------------------------------------------
def __getattr__(name: str) -> Any:
  # `Trainer` is imported on first use: importing it imports jax and flax.
  if name == 'Trainer':
    from jax3d.trainer.trainer import Trainer

    return Trainer
  raise AttributeError(f"module 'jax3d.api' has no attribute {name!r}")


def build(
  cfg: ml_collections.ConfigDict,
  workdir: str | None = None,
  devices: Sequence[jax.Device] | None = None,
  verbose: bool = False,
) -> Trainer:
  """A `Trainer` whose mesh is built and whose sharded state exists: restored from
  `workdir/checkpoints` when there is a checkpoint (any layout), else initialised from the seed.

  The state is created by a jitted init with output shardings, so every array is born on its
  devices (no full copy on one device first). `verbose` prints the trainer's start-up lines and
  what init did; the notebook keeps it off and prints the numbers it shows.
  """
  from jax3d.trainer.trainer import Trainer

  t = Trainer(cfg, workdir=workdir, devices=devices, console=verbose)
  what = t.init_state()
  if verbose:
    for line in t.summary():
      t.log(line)
    t.log(what)
  return t


def export_hf(
  source: Trainer | str,
  out: str,
  max_shard_bytes: int = 2 << 30,
  overwrite: bool = False,
  merge: bool = False,
) -> list[str]:
  """Writes a Hugging Face folder (config.json, safetensors, tokenizer files) that transformers'
  `from_pretrained(out)` loads, from a Trainer's current parameters or a run's workdir (its newest
  checkpoint); returns the files written (a LoRA run: a PEFT adapter folder, or with `merge` the
  merged model). `out` is written whole or not at all, never over a folder the run reads nor, unless
  `overwrite`, over a non-empty folder that is not an earlier export (jax3d/hf/outdir.py).
  Importing is `build(load_config(..., checkpoint__init_from='hf:PATH'))`."""
  from jax3d.hf import outdir, writer
  from jax3d.trainer import workdir

  if isinstance(source, str | os.PathLike):
    kw = {'max_shard_bytes': max_shard_bytes, 'overwrite': overwrite, 'merge': merge}
    return workdir.export_workdir(os.fspath(source), out, **kw)
  outdir.check(out, outdir.reads_of(source.cfg.to_dict(), source.workdir), overwrite)
  return writer.export_run(source.state['params'], source.setup, out, merge, max_shard_bytes, 'here')


def batch(cfg: ml_collections.ConfigDict, step: int) -> dict[str, np.ndarray]:
  """The global batch the trainer feeds step `step` (0-based: logged as step `step + 1`), as numpy
  [train.global_batch_size, train.seq_len] arrays inputs, targets, segment_ids, positions (int32)
  and weights (float32): rows of `data.packing` in the epoch order of train.seed (docs/data.md).
  Reads the data only: nothing is compiled and no device is used."""
  from jax3d import assemble, config as config_lib
  from jax3d.data import corpus as corpus_lib, mixture as mixture_lib, tokenizer as tok_lib

  # the tokenizer of token shards or an import, as a run takes it; the keys checked and typed
  cfg = config_lib.checked(assemble.resolve(cfg))
  corpus = mixture_lib.for_config(cfg, tok_lib.load(cfg.data.tokenizer))
  return corpus_lib.batch_at(corpus, cfg.train.seed, step, cfg.train.global_batch_size, cfg.train.seq_len)


def placement(trainer: Trainer) -> list[str]:
  """One line per device: its (dp, pp, tp) coordinate in the trainer's mesh and which device it
  is. tp varies fastest (neighbouring devices, one NVLink domain), dp slowest (across hosts)."""
  from jax3d.parallel import mesh as mesh_lib

  return [line.strip() for line in mesh_lib.describe_placement(trainer.mesh)]


def losses(records: list[dict]) -> list[float]:
  """The training losses in `Trainer.train()`'s records, in step order (evaluations and events
  are other records). With `log.every=1` there is one per step."""
  return [r['loss'] for r in records if 'loss' in r and 'event' not in r]


# ---------------------------------------------------------------------------------------------
# Pipeline bubble and memory
# ---------------------------------------------------------------------------------------------
def bubble(pp: int, microbatches: int, repeats: int = 1) -> float:
  """Idle share of a pipeline step: (p-1)/(v*m+p-1).

  The schedule runs v*m + p - 1 iterations (v layer chunks per stage, m micro-batches, p stages);
  in p - 1 of them each stage waits for the pipe to fill or drain. More micro-batches (or
  circular chunks) shrink it; it is the same number the trainer's RunPlan reports.
  """
  for name, v in (('pp', pp), ('microbatches', microbatches), ('repeats', repeats)):
    if not isinstance(v, int) or v < 1:
      raise ValueError(f'{name}={v!r}: must be a positive integer')
  return (pp - 1) / (repeats * microbatches + pp - 1)


def compiled_memory(
  source: ml_collections.ConfigDict | Trainer,
  devices: Sequence[jax.Device] | None = None,
  target: str | None = None,
  **overrides: Any,
) -> dict:
  """Bytes per device of the real train step, as XLA compiled it (nothing is allocated).

  The step is lowered for abstract inputs and compiled; `memory_analysis()` gives the argument,
  temporary, output and aliased (donated) bytes; total = argument + temp + output - alias is the
  device's peak for the step. `source` is a config or a Trainer (whose own compiled step is
  read when it has one, saving a compile). Overrides (`train__remat='full'`) make a variant to
  compare, e.g. the memory recomputation saves. `target='h100x8'` compiles for GPUs that are not
  attached, with XLA:GPU (`python -m jax3d.inspect --target`; needs jax3d[cuda12]); the result
  then also has the GPU's `device_memory` and whether the step `fits`.
  """
  from jax3d import assemble
  from jax3d.devices import gpu_target

  cfg = getattr(source, 'cfg', source)
  if cfg is not source and not overrides and target is None:  # a Trainer: its own compiled step
    source.compile()
    return dict(source.compiled.memory)
  gpus = gpu_target.parse(target, 'target') if target else None
  if gpus is not None:
    devices = gpu_target.devices(gpus)
  elif devices is None and cfg is not source:
    devices = list(source.mesh.devices.flat)
  cfg = _with(cfg, **overrides) if overrides else cfg
  options = gpu_target.compiler_options() if gpus else None
  out = dict(assemble.compile_train_step(assemble.build(cfg, devices), options).memory)
  if gpus is not None:
    out |= {'device_memory': gpus.memory_bytes, 'fits': out['total'] <= gpus.memory_bytes}
  return out


# ---------------------------------------------------------------------------------------------
# The planner
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Plan:
  """The planner's answer for one model on one cluster: `layouts` (dicts, fitting ones first,
  fastest first), `best` (the first fitting one, or None), `flags` (its --config overrides for
  `python -m jax3d.train`), `explanation` (why: tp, then pp, then dp, with the numbers) and `table`
  (the shortlist as text lines). `print()` it."""

  name: str
  hardware: Hardware
  layouts: list[dict]
  best: dict | None
  flags: str
  explanation: list[str]
  table: list[str]

  def __str__(self) -> str:
    hw = self.hardware
    head = (
      f'{self.name} on {hw.nodes} x {hw.gpus_per_node} GPUs of {hw.memory_gb:g} GB: '
      f'{sum(r["fits"] for r in self.layouts)} of {len(self.layouts)} layouts fit'
    )
    flags = [f'  flags: {self.flags}'] if self.flags else []
    return '\n'.join([head] + self.table + [''] + self.explanation + flags)


def plan_layouts(
  config: str | ml_collections.ConfigDict,
  nodes: int = 1,
  gpus_per_node: int = 8,
  gpu_memory_gb: float = 80.0,
  overrides: Mapping[str, Any] | None = None,
  top: int = 5,
  **hardware: Any,
) -> Plan:
  """Ranks every valid (dp, pp, tp, micro-batches, remat, ZeRO-1) layout of a model on a cluster
  by estimated step time among those that fit in memory: the planner of `python -m jax3d.plan`.

  `config` is a config name/path or a loaded config; `hardware` sets the other `costmodel.Hardware`
  fields (peak_tflops, efficiency, intra_gbps, inter_gbps, overlap). Nothing is compiled and no
  device is used: the estimate is arithmetic on the model's shapes.

  (Not called `plan`: `jax3d.plan` is the planner's module, which other modules import by that
  name; a package attribute of the same name would shadow it.)
  """
  from jax3d.planning import costmodel, explain, planner

  cfg = (
    load_config(config, overrides)
    if isinstance(config, str)
    else (
      _with(config, **{k.replace('.', '__'): v for k, v in (overrides or {}).items()})
      if overrides
      else config
    )
  )
  hw = costmodel.Hardware(nodes=nodes, gpus_per_node=gpus_per_node, memory_gb=gpu_memory_gb, **hardware)
  ranked = planner.search(cfg, hw)
  rows = [dict(c.row(), overrides=dict(c.overrides)) for c in ranked]
  fit = planner.shortlist(ranked, top)
  name = os.path.basename(str(config)).removesuffix('.py') if isinstance(config, str) else 'model'
  if not fit:
    return Plan(
      name,
      hw,
      rows,
      None,
      '',
      [f'no layout fits; the smallest needs {min(r["memory_gb"] for r in rows):.1f} GB per GPU'],
      [],
    )
  return Plan(
    name,
    hw,
    rows,
    dict(fit[0].row(), overrides=dict(fit[0].overrides)),
    ' '.join(f'--config.{k}={v}' for k, v in fit[0].overrides.items()),
    explain.explain(cfg, fit[0], ranked, hw),
    planner.table(fit),
  )


plan = plan_layouts  # `from jax3d.api import plan`; at package level only `jax3d.plan_layouts`
