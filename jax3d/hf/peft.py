"""PEFT LoRA adapter folders <-> jax3d's adapters (jax3d/model/lora.py), in both directions.

A folder holds adapter_config.json (peft_type LORA, r, lora_alpha, target_modules, ...) and
adapter_model.safetensors with, per layer i and adapted module M (self_attn.q_proj, ...,
mlp.down_proj), `base_model.model.model.layers.{i}.M.lora_A.weight` [r, in] and `...lora_B.weight`
[out, r] (nn.Linear's [out, in]). jax3d's A [in..., r] is lora_A^T and B [r, out...] is lora_B^T,
with the input and output features in the order Hugging Face's projections use (jax3d/hf/weights.py:
query head i belongs to KV head i // g in both), so only a reshape and a transpose separate them.

What jax3d cannot represent is refused with a ConfigError naming the file and the entry (rsLoRA,
DoRA, per-module ranks, biases, other modules): an adapter either loads exactly or not at all.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import jax
import ml_collections
import numpy as np

from jax3d.config import ConfigError, set_key
from jax3d.hf import safetensors_io
from jax3d.model import lora

if TYPE_CHECKING:
  from jax3d.setup import Setup

CONFIG, WEIGHTS = 'adapter_config.json', 'adapter_model.safetensors'
PREFIX = 'base_model.model.model.layers.'
BY_MODULE = {m.split('.')[1]: t for t, (m, _) in lora.MODULES.items()}  # 'q_proj' -> 'q'
# adapter_config.json entries jax3d does not represent, and the value each must have
UNSUPPORTED = {
  'use_rslora': False,
  'use_dora': False,
  'fan_in_fan_out': False,
  'bias': 'none',
  'rank_pattern': {},
  'alpha_pattern': {},
  'modules_to_save': None,
  'layers_to_transform': None,
}


def _bad(path: str, what: str) -> ConfigError:
  return ConfigError(f'lora.init_from={path!r}: {what}')


def read_config(path: str) -> dict:
  """adapter_config.json of the folder `path`, checked: a LoRA adapter of the modules jax3d adapts,
  with nothing jax3d would compute differently (UNSUPPORTED); ConfigError naming the entry."""
  file = os.path.join(path, CONFIG)
  if not os.path.exists(file) or not os.path.exists(os.path.join(path, WEIGHTS)):
    raise _bad(path, f'a PEFT adapter folder holds {CONFIG} and {WEIGHTS}; {path} does not')
  try:
    with open(file) as f:
      c = json.load(f)
  except ValueError as e:
    raise _bad(path, f'{file} is not valid JSON ({e})') from None
  if not isinstance(c, dict) or c.get('peft_type') != 'LORA':
    c = c if isinstance(c, dict) else {}
    raise _bad(path, f'{file} has peft_type={c.get("peft_type")!r}; only LORA adapters load')
  for key, want in UNSUPPORTED.items():
    if c.get(key, want) not in (want, None, [], {}):
      raise _bad(path, f'{file} has {key}={c[key]!r}; jax3d loads only {key}={want!r}')
  modules = c.get('target_modules')
  if not isinstance(modules, list) or not modules or any(m not in BY_MODULE for m in modules):
    raise _bad(path, f'{file} has target_modules={modules!r}; a list of {", ".join(BY_MODULE)}')
  try:  # a damaged or truncated weights file: refused here, before anything is built
    safetensors_io.header(os.path.join(path, WEIGHTS))
  except ValueError as e:
    raise _bad(path, str(e)) from None
  return c


def with_lora(cfg: ml_collections.ConfigDict, path: str) -> ml_collections.ConfigDict:
  """`cfg` (changed in place, and returned) with lora.rank, lora.alpha and lora.targets read from
  the adapter folder `path`, and lora.dropout from its lora_dropout where lora.dropout is 0 (a
  training setting: a non-zero lora.dropout overrides the adapter's)."""
  c = read_config(path)
  set_key(cfg, 'lora.rank', int(c['r']))
  set_key(cfg, 'lora.alpha', float(c['lora_alpha']))
  dropout = c.get('lora_dropout') or 0.0
  if not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
    raise _bad(path, f'{os.path.join(path, CONFIG)} has lora_dropout={dropout!r}; a number in [0, 1)')
  if not cfg.lora.dropout:
    set_key(cfg, 'lora.dropout', float(dropout))
  wanted = {BY_MODULE[m] for m in c['target_modules']}
  set_key(cfg, 'lora.targets', ','.join(t for t in lora.MODULES if t in wanted))
  return cfg


def key(i: int, target: str, leaf: str) -> str:
  """The PEFT tensor name of canonical layer i's adapter `target`, leaf 'a' or 'b'."""
  return f'{PREFIX}{i}.{lora.MODULES[target][0]}.lora_{leaf.upper()}.weight'


def to_peft(leaf: str, a: np.ndarray) -> np.ndarray:
  """One layer's jax3d A [in..., r] or B [r, out...] -> PEFT's lora_A [r, in] or lora_B [out, r]."""
  return a.reshape(-1, a.shape[-1]).T if leaf == 'a' else a.reshape(a.shape[0], -1).T


def load(path: str, setup: Setup, abstract: Any) -> Any:
  """The adapters of the folder `path` as jax3d parameters: `abstract` is the adapters' part of the
  abstract parameters (ShapeDtypeStructs with shardings), filled in the setup's layer order."""
  reader, file = safetensors_io.Reader(), os.path.join(path, WEIGHTS)
  shapes = {k: shape for k, (shape, _) in safetensors_io.header(file).items()}
  n = setup.dims.n_layers

  def make(p: tuple, a: jax.ShapeDtypeStruct) -> jax.Array:
    target, leaf = str(p[-2].key).removeprefix(lora.PREFIX), str(p[-1].key)
    per_layer = []
    for i in range(n):
      name = key(i, target, leaf)
      want = to_peft(leaf, np.zeros(a.shape[1:], np.float32)).shape
      if shapes.get(name) != want:
        got = 'missing' if name not in shapes else f'shape {shapes[name]}'
        raise _bad(path, f'{file}: {name} is {got}; this model and lora.rank need {want}')
      per_layer.append(reader.read(file, name).astype(np.float32).T.reshape(a.shape[1:]))
    host = np.stack(per_layer)[np.asarray(setup.layer_order)].astype(a.dtype)
    return jax.device_put(host, a.sharding)

  return jax.tree_util.tree_map_with_path(make, abstract)


def tensors(params: Any, setup: Setup) -> Iterator[tuple[str, tuple[int, ...], np.dtype, Any]]:
  """(name, shape, dtype, fetch) of every PEFT tensor of the adapters in `params` (the full
  parameters), layer by layer, for safetensors_io.write."""
  layers, dm = params['layers'], setup.dims
  position = np.argsort(setup.layer_order)  # canonical layer i is stored at position[i]
  dtype = np.dtype(dm.lora_dtype)
  for i in range(dm.n_layers):
    for target in lora.MODULES:
      if not dm.adapted(target):
        continue
      for leaf in ('a', 'b'):
        arr = layers[lora.PREFIX + target][leaf]
        shape = to_peft(leaf, np.zeros(arr.shape[1:], np.float32)).shape
        fetch = lambda arr=arr, j=position[i], leaf=leaf: to_peft(leaf, np.asarray(jax.device_get(arr[j])))
        yield key(i, target, leaf), shape, dtype, fetch


def config_json(setup: Setup, base: str) -> dict:
  """adapter_config.json for the run's adapters; `base` is the base model's folder."""
  dm = setup.dims
  return {
    'peft_type': 'LORA',
    'task_type': 'CAUSAL_LM',
    'base_model_name_or_path': base,
    'r': dm.lora_rank,
    'lora_alpha': dm.lora_alpha,
    'lora_dropout': float(setup.cfg.lora.dropout),
    'target_modules': [lora.MODULES[t][0].split('.')[1] for t in lora.MODULES if dm.adapted(t)],
    'bias': 'none',
    'fan_in_fan_out': False,
    'use_rslora': False,
    'use_dora': False,
    'init_lora_weights': True,
    'inference_mode': True,
  }


def write(params: Any, setup: Setup, out: str, base: str) -> list[str]:
  """Writes the PEFT adapter folder `out` (adapter_config.json, adapter_model.safetensors) of the
  adapters in `params`; returns the file names written."""
  os.makedirs(out, exist_ok=True)
  safetensors_io.write(os.path.join(out, WEIGHTS), tensors(params, setup), {'format': 'pt'})
  with open(os.path.join(out, CONFIG), 'w') as f:
    json.dump(config_json(setup, base), f, indent=2)
  return [WEIGHTS, CONFIG]
