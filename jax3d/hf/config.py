"""A Hugging Face checkpoint folder: its config.json read into jax3d's model keys, its
safetensors files found and their tensor headers checked, all before anything compiles.

  hf = hf_config.read('path/to/model')        # ConfigError (exit 2) on a folder that cannot work
  cfg = hf_config.with_model(cfg, hf)         # model.* from config.json

The families that load, and the allow-list of config.json keys: jax3d/hf/families.py. Tied
embeddings stay tied (model.tie_embeddings): one parameter, exported tied.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from typing import Any

import ml_collections

from jax3d.config import ConfigError, set_key
from jax3d.config.values import HF_PREFIX as PREFIX  # checkpoint.init_from=hf:FOLDER
from jax3d.hf import families, safetensors_io


@dataclasses.dataclass
class HFModel:
  """A checkpoint folder: config.json, and tensor name -> (file, shape, dtype) of its safetensors."""

  path: str
  config: dict
  tensors: dict[str, tuple[str, tuple[int, ...], str]]

  @property
  def tied(self) -> bool:
    """Whether the head is the embedding table (transformers then ignores any lm_head.weight)."""
    return bool(self.config.get('tie_word_embeddings', False))

  @property
  def model_type(self) -> str:
    return str(self.config.get('model_type'))

  @property
  def head_dim(self) -> int:
    c = self.config
    return int(c.get('head_dim') or c['hidden_size'] // c['num_attention_heads'])


def is_hf(init_from: str) -> bool:
  """Whether checkpoint.init_from names a Hugging Face folder ('hf:PATH')."""
  return isinstance(init_from, str) and init_from.startswith(PREFIX)


def _bad(path: str, what: str) -> ConfigError:
  return ConfigError(f'checkpoint.init_from=hf:{path}: {what}')


def rope_theta(c: dict) -> float:
  """rope_theta of a config.json (transformers 5 writes it in rope_parameters)."""
  params = c.get('rope_parameters') or {}
  return float(c.get('rope_theta', params.get('rope_theta', 10000.0)))


def _check_family(path: str, c: dict) -> None:
  """The architecture is a family jax3d loads and every key of config.json is one it computes
  exactly (jax3d/hf/families.py); else ConfigError naming the file, the key and the value."""
  cfg_file = os.path.join(path, 'config.json')
  arch, model_type = (c.get('architectures') or ['?'])[0], c.get('model_type')
  fam = families.FAMILIES.get(model_type)
  if fam is None or arch != fam.architecture:
    known = ', '.join(f.architecture for f in families.FAMILIES.values())
    raise _bad(
      path, f'{cfg_file} describes {arch} (model_type {model_type!r}); the families that load: {known}'
    )
  for key in ('num_local_experts', 'num_experts', 'n_routed_experts'):
    if c.get(key) and not (fam.moe and key != 'n_routed_experts'):
      raise _bad(path, f'{cfg_file} has {key}={c[key]} (mixture of experts); {arch} is a dense family')
  if fam.moe and not (families.n_experts(c) and isinstance(c.get('num_experts_per_tok'), int)):
    raise _bad(
      path, f'{cfg_file} lacks num_local_experts or num_experts_per_tok ({arch} is a mixture of experts)'
    )
  problem = families.check(c, model_type) or families.rope_problem(c)
  if problem:
    key, value, valid = problem
    raise _bad(path, f'{cfg_file} has {key}={json.dumps(value)}; jax3d loads it only with {valid}')
  heads, d, head_dim = c['num_attention_heads'], c['hidden_size'], c.get('head_dim')
  if head_dim is None and d % heads:
    raise _bad(
      path, f'{cfg_file} has hidden_size={d} not divisible by num_attention_heads={heads} and no head_dim'
    )
  if (head_dim or d // heads) % 2:
    raise _bad(
      path, f'{cfg_file} has head_dim={head_dim or d // heads}; rotary embeddings need an even head size'
    )


def _tensor_index(path: str) -> dict[str, tuple[str, tuple[int, ...], str]]:
  """name -> (file, shape, dtype) from the safetensors headers (nothing else is read)."""
  index = os.path.join(path, 'model.safetensors.index.json')
  if os.path.exists(index):
    with open(index) as f:
      files = sorted(set(json.load(f)['weight_map'].values()))
  else:
    files = sorted(n for n in os.listdir(path) if n.endswith('.safetensors'))
  if not files:
    raise _bad(path, f'no *.safetensors file in {path} (only safetensors checkpoints load)')
  out = {}
  for name in files:
    file = os.path.join(path, name)
    if not os.path.exists(file):
      raise _bad(path, f'{index} names {name}, which does not exist')
    try:
      out |= {key: (file, shape, dtype) for key, (shape, dtype) in safetensors_io.header(file).items()}
    except ValueError as e:  # a damaged header is bad input naming the file
      raise _bad(path, str(e)) from None
  return out


def read(path: str) -> HFModel:
  """The checkpoint folder at `path` (ConfigError naming the file when it cannot be loaded)."""
  path = path.removeprefix(PREFIX)
  cfg_file = os.path.join(path, 'config.json')
  if not os.path.isdir(path):
    raise _bad(path, 'no such folder (give a folder with config.json and *.safetensors)')
  if not os.path.exists(cfg_file):
    raise _bad(path, f'no config.json in {path}')
  try:
    with open(cfg_file) as f:
      c = json.load(f)
  except ValueError as e:
    raise _bad(path, f'{cfg_file} is not valid JSON ({e})') from None
  missing = [
    k
    for k in ('num_hidden_layers', 'hidden_size', 'num_attention_heads', 'intermediate_size', 'vocab_size')
    if not isinstance(c.get(k), int)
  ]
  if missing:
    raise _bad(path, f'{cfg_file} lacks {", ".join(missing)}')
  _check_family(path, c)
  return HFModel(os.path.abspath(path), c, _tensor_index(path))


def model_keys(hf: HFModel) -> dict[str, Any]:
  """The jax3d model.* settings of the checkpoint."""
  c, fam = hf.config, families.FAMILIES[hf.model_type]
  kind, spec, _ = families.rope_spec(c)
  keys = {
    'model.n_layers': c['num_hidden_layers'],
    'model.d_model': c['hidden_size'],
    'model.n_heads': c['num_attention_heads'],
    'model.n_kv_heads': c.get('num_key_value_heads') or c['num_attention_heads'],
    'model.d_ff': c['intermediate_size'],
    'model.vocab_size': c['vocab_size'],
    'model.head_dim': int(c.get('head_dim') or 0),
    'model.qkv_bias': fam.qkv_bias,
    'model.qk_norm': fam.qk_norm,
    'model.tie_embeddings': hf.tied,
    'model.hf_model_type': hf.model_type,
    'model.rope_theta': rope_theta(c),
    'model.rope_scaling': 'none' if kind == 'default' else kind,
    'model.norm_eps': float(c.get('rms_norm_eps', 1e-6)),
    'model.max_seq_len': int(c.get('max_position_embeddings', 2048)),
  }
  if fam.moe:  # Mixtral's intermediate_size is its experts'; Qwen3-MoE names them apart
    keys |= {
      'moe.num_experts': families.n_experts(c),
      'moe.top_k': int(c['num_experts_per_tok']),
      'moe.norm_topk_prob': bool(c.get('norm_topk_prob', hf.model_type == 'mixtral')),
      'moe.d_expert': int(c.get('moe_intermediate_size') or c['intermediate_size']),
      'moe.aux_loss_coef': float(c.get('router_aux_loss_coef', 0.0)),
    }
  if kind != 'default':
    keys['model.rope_factor'] = float(spec['factor'])
  if kind == 'llama3':
    keys['model.rope_low_freq_factor'] = float(spec['low_freq_factor'])
    keys['model.rope_high_freq_factor'] = float(spec['high_freq_factor'])
    keys['model.rope_original_max_seq_len'] = int(spec['original_max_position_embeddings'])
  return keys


def with_model(cfg: ml_collections.ConfigDict, hf: HFModel) -> ml_collections.ConfigDict:
  """A copy of cfg with the model settings of the checkpoint. A sliding window shorter than
  train.seq_len is refused (jax3d attends over the whole sequence)."""
  cfg = copy.deepcopy(cfg)
  for key, value in model_keys(hf).items():
    set_key(cfg, key, value)
  window = families.sliding_window(hf.config, hf.model_type)
  if window and window < cfg.train.seq_len:
    raise _bad(
      hf.path,
      f'config.json has sliding_window={window} < train.seq_len={cfg.train.seq_len}; '
      'jax3d attends over the whole sequence (use a shorter train.seq_len)',
    )
  return cfg


def expected_shapes(hf: HFModel) -> dict[str, tuple[int, ...]]:
  """The tensors a checkpoint of this config.json holds, with their shapes."""
  m, h, fam = model_keys(hf), hf.head_dim, families.FAMILIES[hf.model_type]
  d, n, k, f, v = (m[f'model.{x}'] for x in ('d_model', 'n_heads', 'n_kv_heads', 'd_ff', 'vocab_size'))
  out = {'model.embed_tokens.weight': (v, d), 'model.norm.weight': (d,)}
  if not hf.tied:
    out['lm_head.weight'] = (v, d)
  for i in range(m['model.n_layers']):
    p = f'model.layers.{i}.'
    out |= {
      p + 'input_layernorm.weight': (d,),
      p + 'post_attention_layernorm.weight': (d,),
      p + 'self_attn.q_proj.weight': (n * h, d),
      p + 'self_attn.k_proj.weight': (k * h, d),
      p + 'self_attn.v_proj.weight': (k * h, d),
      p + 'self_attn.o_proj.weight': (d, n * h),
      p + 'mlp.gate_proj.weight': (f, d),
      p + 'mlp.up_proj.weight': (f, d),
      p + 'mlp.down_proj.weight': (d, f),
    }
    if fam.qkv_bias:
      out |= {p + 'self_attn.q_proj.bias': (n * h,), p + 'self_attn.k_proj.bias': (k * h,)}
      out |= {p + 'self_attn.v_proj.bias': (k * h,)}
    if fam.qk_norm:
      out |= {p + 'self_attn.q_norm.weight': (h,), p + 'self_attn.k_norm.weight': (h,)}
    if fam.moe:
      for name in ('gate_proj', 'up_proj', 'down_proj'):
        del out[p + f'mlp.{name}.weight']
      out |= expert_shapes(hf, i, d, m['moe.num_experts'], m['moe.d_expert'])
  return out


def fused_experts(hf: HFModel) -> bool:
  """Whether the folder holds transformers 5's fused expert tensors (else one per expert)."""
  return 'model.layers.0.mlp.experts.gate_up_proj' in hf.tensors


def expert_tensor_names(model_type: str, i: int, e: int) -> tuple[str, str, str, str]:
  """Layer i's router and expert e's gate, up and down tensors, one per expert (the hub's layout)."""
  fam = families.FAMILIES[model_type]
  p = f'model.layers.{i}.{fam.moe_prefix}.'
  return (p + 'gate.weight', *(p + f'experts.{e}.{n}.weight' for n in fam.expert_names))


def expert_shapes(hf: HFModel, i: int, d: int, n_experts: int, f: int) -> dict[str, tuple[int, ...]]:
  """Layer i's router and experts' tensors and their shapes, in the folder's layout."""
  if fused_experts(hf):
    p = f'model.layers.{i}.mlp.'
    return {p + 'gate.weight': (n_experts, d), p + 'experts.gate_up_proj': (n_experts, 2 * f, d)} | {
      p + 'experts.down_proj': (n_experts, d, f)
    }
  out = {expert_tensor_names(hf.model_type, i, 0)[0]: (n_experts, d)}
  for e in range(n_experts):
    _, gate, up, down = expert_tensor_names(hf.model_type, i, e)
    out |= {gate: (f, d), up: (f, d), down: (d, f)}
  return out


def check_tensors(hf: HFModel) -> None:
  """Every tensor the config implies is there with its shape, and no other weight (a bias, an
  expert) is: ConfigError naming the file, the tensor and both shapes."""
  want = expected_shapes(hf)
  for name, shape in want.items():
    if name not in hf.tensors:
      raise _bad(hf.path, f'tensor {name} is missing from the safetensors files')
    file, got, _ = hf.tensors[name]
    if got != shape:
      raise _bad(hf.path, f'{file}: tensor {name} has shape {list(got)}, config.json implies {list(shape)}')
  # A tied model's lm_head.weight (older files hold both) is ignored, as transformers does.
  ignored = ('lm_head.weight',) if hf.tied else ()
  extra = [
    n for n in hf.tensors if n not in want and n not in ignored and not n.endswith('rotary_emb.inv_freq')
  ]
  if extra:
    raise _bad(
      hf.path,
      f'{hf.tensors[extra[0]][0]}: tensor {extra[0]} is not part of a {hf.model_type} model '
      f'as config.json describes it ({len(extra)} unexpected tensor(s))',
    )
