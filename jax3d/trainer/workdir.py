"""Sampling from a run's checkpoint (or a Hugging Face folder): the saved config, a layout valid
for generation on this machine's devices, the parameters read straight into that layout, and the
text (`python -m jax3d.sample` and `jax3d.sample(workdir, ...)` call this module), and `sample`,
the API function (`jax3d.sample`, `jax3d.api.sample`); exporting a run (`export_workdir`).

Nothing heavy is imported at module level (no jax, no orbax): `import jax3d` must not start jax.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from jax3d.errors import NoCheckpoint
from jax3d.trainer.rundir import checkpoint_dir

if TYPE_CHECKING:
  import jax
  import ml_collections

  from jax3d.setup import Setup


def _flatten(d: dict, prefix: str = '') -> dict:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flatten(v, f'{prefix}{k}.'))
    else:
      out[f'{prefix}{k}'] = v
  return out


def checkpoint_steps(workdir: str) -> list[int]:
  """The finished checkpoint steps in the workdir, oldest first; NoCheckpoint when there is none
  (Orbax writes a step under a temporary name and renames it when complete)."""
  directory = checkpoint_dir(workdir)
  steps = sorted(int(n) for n in os.listdir(directory) if n.isdigit()) if os.path.isdir(directory) else []
  if not steps:
    raise NoCheckpoint(
      f'--workdir={workdir}: no checkpoint in {directory} (train first: python -m jax3d.train --workdir={workdir})'
    )
  return steps


def saved_meta(workdir: str) -> dict:
  """The meta JSON of the run's newest checkpoint whose meta reads (its config as saved)."""
  import orbax.checkpoint as ocp

  from jax3d.trainer import readonly

  directory = checkpoint_dir(workdir)
  steps = checkpoint_steps(workdir)[::-1]
  reader = readonly.manager(directory)
  meta = None
  try:
    for step in steps:  # the newest step whose meta reads (a damaged one falls back, as restore does)
      try:
        meta = reader.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))['meta']
        break
      except Exception as e:  # noqa: BLE001 - damaged: an older one (load_params warns); else raised
        readonly.skip_damaged(e, os.path.join(directory, str(step)), lambda _: None)
  finally:
    reader.close()
  if meta is None:
    raise NoCheckpoint(f'--workdir={workdir}: no readable checkpoint in {directory}')
  return meta


def saved_config(workdir: str, meta: dict | None = None) -> ml_collections.ConfigDict:
  """The config the run trained with, from its newest checkpoint's meta JSON (`meta`, else read),
  over the defaults of this version (keys this version does not know are skipped, so older runs
  stay readable), without its `checkpoint.init_from` (but for a LoRA run, whose base is read from
  there again)."""
  from jax3d import config as config_lib

  cfg = config_lib.base_config()
  for key, value in _flatten((meta or saved_meta(workdir)).get('config', {})).items():
    try:
      config_lib.set_key(cfg, key, value)
    except (config_lib.ConfigError, TypeError, KeyError):
      continue
  # The saved config is the resolved one (an import's model.*, the tokenizer's path) and the
  # parameters come from the checkpoint: building it must not read the imported folder again,
  # which may be gone; but a LoRA run's checkpoints hold only the adapters (state.base_params).
  if not cfg.lora.rank:
    cfg.checkpoint.init_from = ''
  cfg.lora.init_from = ''
  # Paths of the run's inputs that are gone since (their range wants them to exist): unset, as
  # generation and export read neither the corpus nor the task files.
  for section, key in (('data', 'path'), ('eval', 'tasks_include_path')):
    if cfg[section][key] and not os.path.exists(cfg[section][key]):
      cfg[section][key] = ''
  cfg.lock()
  return cfg


def sampling_config(
  cfg: ml_collections.ConfigDict, n_devices: int, overrides: Mapping[str, Any] | None = None
) -> ml_collections.ConfigDict:
  """cfg with `overrides` applied, made valid for generation on n_devices.

  Generation has no batch and no pipeline schedule, but the run plan still checks that the
  global batch splits over dp * micro-batches. When the layout changes (say dp 2 -> 8), the
  training batch may not split; the batch keys are then set to the smallest valid values,
  unless the user set them. They change nothing in the generated text.
  """
  import copy

  from jax3d import config as config_lib

  cfg = copy.deepcopy(cfg)
  overrides = dict(overrides or {})
  if 'mesh.cp' not in overrides:  # generation runs no training sequence split over cp
    cfg.mesh.cp = 1
  if 'mesh.ep' not in overrides:  # nor the experts over ep (one sequence does not split over it)
    cfg.mesh.ep = 1
  for k, v in overrides.items():
    config_lib.set_key(cfg, k, v)
  try:
    config_lib.validate(cfg, n_devices)
    return cfg
  except config_lib.ConfigError:
    pass
  dp, pp, _ = config_lib.resolve_mesh(cfg.mesh.dp, cfg.mesh.pp, cfg.mesh.tp, n_devices)
  m = pp if cfg.pipeline.repeats > 1 else 1
  for key, value in (
    ('train.grad_accum', 1),
    ('pipeline.microbatches', m),
    ('train.global_batch_size', dp * m),
  ):
    if key not in overrides:
      config_lib.set_key(cfg, key, value)
  config_lib.validate(cfg, n_devices)  # raises the one-line error of what is really wrong
  return cfg


def load_params(
  workdir: str,
  cfg: ml_collections.ConfigDict,
  devices: Sequence[jax.Device] | None = None,
  saved: bool = True,
) -> tuple[Setup, Any, int]:
  """(setup, params, step): the newest good checkpoint's parameters, sharded for cfg's layout (cfg
  the run's saved config unless `saved` is False: its model kept as it is, assemble.build)."""
  from jax3d import assemble
  from jax3d.trainer import state as state_lib

  setup = assemble.build(cfg, devices, saved=saved)
  warn = lambda m: print(f'warning: {m}', file=sys.stderr)
  return setup, *state_lib.checkpoint_params(setup, workdir, warn)


def sample_workdir(
  workdir: str,
  prompt: str | None = None,
  n_tokens: int | None = None,
  temperature: float | None = None,
  top_k: int | None = None,
  seed: int = 0,
  config: str | None = None,
  overrides: Mapping[str, Any] | None = None,
  devices: Sequence[jax.Device] | None = None,
) -> str:
  """Text from a run's newest checkpoint (see the module docstring); None arguments take the
  config's `sample.*` values."""
  import jax

  from jax3d import config as config_lib
  from jax3d.data import tokenizer as tokenizer_lib

  checkpoint_steps(workdir)
  cfg = config_lib.load_config(config) if config else saved_config(workdir)
  devices = list(devices if devices is not None else jax.devices())
  cfg = sampling_config(cfg, len(devices), overrides)
  tokenizer_lib.check_prompt(cfg, prompt, n_tokens)  # before the weights load
  setup, params, _ = load_params(workdir, cfg, devices, saved=not config)
  return _text(setup, params, prompt, n_tokens, temperature, top_k, seed)


def _text(
  setup: Setup,
  params: Any,
  prompt: str | None,
  n_tokens: int | None,
  temperature: float | None,
  top_k: int | None,
  seed: int,
) -> str:
  """generate_text with the config's sample.* values where an argument is None."""
  s = setup.cfg.sample
  pick = lambda value, default: default if value is None else value
  return generate_text(
    setup,
    params,
    pick(prompt, s.prompt),
    pick(n_tokens, s.tokens),
    pick(temperature, s.temperature),
    pick(top_k, s.top_k),
    seed,
  )


def sample_hf(
  init_from: str,
  prompt: str | None = None,
  n_tokens: int | None = None,
  temperature: float | None = None,
  top_k: int | None = None,
  seed: int = 0,
  config: str | None = None,
  overrides: Mapping[str, Any] | None = None,
  devices: Sequence[jax.Device] | None = None,
) -> str:
  """Text from a Hugging Face folder (`hf:PATH`), no training run needed: its weights imported onto
  this machine's devices in the layout of `overrides` (mesh.*), its own tokenizer, the config's
  sample.* values where an argument is None. Nothing of Orbax is touched."""
  import jax

  from jax3d import assemble, config as config_lib
  from jax3d.data import tokenizer as tokenizer_lib
  from jax3d.hf import weights

  devices = list(devices if devices is not None else jax.devices())
  cfg = config_lib.load_config(config or 'tiny', {**dict(overrides or {}), 'checkpoint.init_from': init_from})
  cfg = sampling_config(assemble.resolve(cfg), len(devices))
  tokenizer_lib.check_prompt(cfg, prompt, n_tokens)  # before the weights load
  setup = assemble.build(cfg, devices[: _n_devices(cfg, len(devices))])
  return _text(setup, weights.load_params(setup), prompt, n_tokens, temperature, top_k, seed)


def sample(
  source: Any,
  prompt: str = 'def ',
  n_tokens: int = 200,
  temperature: float = 0.8,
  top_k: int = 40,
  seed: int = 0,
  greedy: bool = False,
  config: str | None = None,
  overrides: Mapping[str, Any] | None = None,
) -> str:
  """Text that follows `prompt`: the prompt itself, then `n_tokens` generated bytes.

  `source` is a Trainer (its current parameters), a run's workdir (its newest checkpoint, with
  the config saved in it unless `config` is given, on this machine's devices in any layout set by
  `overrides`, e.g. `{'mesh.tp': 8, 'mesh.pp': 1}`), or 'hf:PATH', a Hugging Face folder
  (`sample_hf`: its weights and tokenizer, in the layout `overrides` sets). Greedy (argmax) when `greedy` or
  temperature 0; else temperature with top-k. Decoding uses a KV cache: one pass over the prompt,
  then one token per step.
  """
  temperature = 0.0 if greedy else temperature
  if isinstance(source, str) and source.startswith('hf:'):
    return sample_hf(source, prompt, n_tokens, temperature, top_k, seed, config=config, overrides=overrides)
  if isinstance(source, (str, os.PathLike)):
    return sample_workdir(
      os.fspath(source), prompt, n_tokens, temperature, top_k, seed, config=config, overrides=overrides
    )
  return source.sample(prompt, n_tokens, temperature, top_k, seed)


def generate_text(
  setup: Setup, params: Any, prompt: str, n_tokens: int, temperature: float, top_k: int, seed: int
) -> str:
  """prompt + up to n_tokens generated tokens from `params` (stored in the pipeline layer order of
  the Setup `setup`), encoded and decoded with the run's tokenizer (data.tokenizer): the prompt
  with the special tokens the tokenizer itself adds (as transformers encodes it; a one-line note
  when it defines a BOS it does not add), generation stopping at EOS."""
  from jax3d.data import tokenizer as tokenizer_lib
  from jax3d.model import generate

  cfg, plan = setup.cfg, setup.plan
  tok = tokenizer_lib.load(cfg.data.tokenizer)
  ids = tokenizer_lib.prompt_ids(tok, prompt, n_tokens, cfg.model.max_seq_len)
  note = tokenizer_lib.bos_note(tok)
  if note:
    print(f'note: {note}', file=sys.stderr)
  toks = generate.generate(
    setup.dims,
    params,
    (cfg.model.n_layers, plan.pp, plan.repeats),
    ids,
    n_tokens,
    cfg.model.max_seq_len,
    temperature,
    top_k,
    seed,
    stop=tok.eos_id,
  )
  return tok.decode(ids + toks)


def export_workdir(
  workdir: str,
  out: str,
  overrides: dict | None = None,
  devices: list | None = None,
  max_shard_bytes: int = 2 << 30,
  verify: bool = False,
  merge: bool = False,
  overwrite: bool = False,
) -> list[str]:
  """Exports the newest good checkpoint of a run (its saved config, read onto this machine's
  devices in the saved layout or the one `overrides` sets) to `out`; returns the files written.
  `out` is checked first and written whole or not at all (jax3d/hf/outdir.py; `overwrite`
  replaces a folder that is not an earlier export). With `verify`, the export is loaded in
  transformers before it is moved into place and its logits on the run's first held-out batch
  compared with jax3d's (jax3d/trainer/export_parity.py): one line with the largest relative difference,
  CheckpointError (exit 3) above the tolerance. A LoRA run: see hf.writer.export_run."""
  import jax

  from jax3d.hf import outdir, writer

  checkpoint_steps(workdir)  # NoCheckpoint when there is none
  meta = saved_meta(workdir)
  outdir.check(out, outdir.reads_of(meta['config'], workdir), overwrite)
  devices = list(devices if devices is not None else jax.devices())
  cfg = sampling_config(saved_config(workdir, meta), len(devices), overrides)
  setup, params, _ = load_params(workdir, cfg, devices[: _n_devices(cfg, len(devices))])
  check = None
  if verify:
    from jax3d.trainer import export_parity

    check = lambda folder, adapter: export_parity.verify_export(setup, params, folder, out, adapter)
  return writer.export_run(params, setup, out, merge, max_shard_bytes, workdir, check)


def _n_devices(cfg: ml_collections.ConfigDict, available: int) -> int:
  from jax3d import config as config_lib

  m = cfg.mesh
  dp, pp, tp = config_lib.resolve_mesh(m.dp, m.pp, m.tp, available, m.cp, m.get('ep', 1))
  return dp * m.cp * m.get('ep', 1) * pp * tp
