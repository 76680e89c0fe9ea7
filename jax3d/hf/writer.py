"""Export a jax3d model to a Hugging Face folder that `transformers.AutoModelForCausalLM
.from_pretrained` and `tokenizers` load: config.json (the family's architecture: the one imported,
or the one the features need, jax3d/hf/families.py), generation_config.json,
model.safetensors (or model-0000i-of-0000n.safetensors with model.safetensors.index.json past
`max_shard_bytes`) and the run's tokenizer files.

Tensors are written one at a time (jax3d/hf/safetensors_io.write): each is gathered from its
devices, converted to the Hugging Face layout (jax3d/hf/weights.hf_tensors) and written, so the
host holds one tensor at a time. A tied model (model.tie_embeddings) is exported tied: no
lm_head.weight, `tie_word_embeddings: true`.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jax3d.data import tokenizer as tok_lib
from jax3d.errors import ConfigError
from jax3d.hf import families, outdir, peft, safetensors_io, weights
from jax3d.model import lora, quant, rope

if TYPE_CHECKING:
  from collections.abc import Callable

  from jax3d.setup import Setup


def rope_scaling(scaling: rope.RopeScaling) -> dict | None:
  """config.json's rope_scaling of model.rope_scaling (None when plain), as the hub writes it."""
  if scaling.kind == 'none':
    return None
  out = {'rope_type': scaling.kind, 'factor': scaling.factor}
  if scaling.kind == 'llama3':
    out |= {'low_freq_factor': scaling.low_freq_factor, 'high_freq_factor': scaling.high_freq_factor}
    out['original_max_position_embeddings'] = scaling.original_max_seq_len
  return out


def config_json(setup: Setup, tok: tok_lib.Tokenizer) -> dict:
  """The transformers config of the model (the real vocabulary, not the padded one), in the hub's
  layout (rope_scaling beside rope_theta), which transformers 4 and 5 both read."""
  dm, m = setup.dims, setup.cfg.model
  dtype = str(np.dtype(dm.param_dtype))
  model_type = families.family_of(dm.qkv_bias, dm.qk_norm, m.hf_model_type, moe=dm.n_experts > 0)
  return _moe_keys(setup, model_type) | {
    'architectures': [families.FAMILIES[model_type].architecture],
    'model_type': model_type,
    'hidden_size': dm.d_model,
    'intermediate_size': dm.d_ff,
    'num_hidden_layers': dm.n_layers,
    'num_attention_heads': dm.n_heads,
    'num_key_value_heads': dm.n_kv_heads,
    'head_dim': dm.head_dim,
    'vocab_size': dm.vocab_size,
    'max_position_embeddings': m.max_seq_len,
    'rope_theta': dm.rope_theta,
    'rope_scaling': rope_scaling(dm.rope_scaling),
    'rms_norm_eps': dm.norm_eps,
    'hidden_act': 'silu',
    'attention_bias': False,
    'mlp_bias': False,
    'tie_word_embeddings': dm.tie_embeddings,
    'bos_token_id': tok.bos_id,
    'eos_token_id': tok.eos_id,
    'torch_dtype': dtype,
  }


def _moe_keys(setup: Setup, model_type: str) -> dict:
  """config.json's mixture-of-experts keys (none for a dense model); ConfigError for a mixture
  the family cannot hold (a shared expert; Mixtral's weights are always renormalised)."""
  dm, moe = setup.dims, setup.cfg.moe
  if not dm.n_experts:
    return {}
  if dm.d_shared or (model_type == 'mixtral' and not dm.norm_topk_prob):
    raise ConfigError(
      f'moe.d_shared={dm.d_shared}, moe.norm_topk_prob={dm.norm_topk_prob}: no Hugging Face family '
      'jax3d exports holds a shared expert, nor (Mixtral) unnormalised top-k weights'
    )
  keys = {
    'num_experts_per_tok': dm.top_k,
    'router_aux_loss_coef': moe.aux_loss_coef,
    'output_router_logits': False,
  }
  if model_type == 'mixtral':
    return keys | {'num_local_experts': dm.n_experts, 'router_jitter_noise': 0.0, 'sliding_window': None}
  return keys | {
    'num_experts': dm.n_experts,
    'moe_intermediate_size': dm.expert_ff,
    'norm_topk_prob': dm.norm_topk_prob,
    'decoder_sparse_step': 1,
    'mlp_only_layers': [],
  }


def _copy_tokenizer(tok: tok_lib.Tokenizer, out: str) -> list[str]:
  """The tokenizer's file (and its tokenizer_config.json / special_tokens_map.json when beside it),
  or a minimal tokenizer_config.json naming BOS/EOS. Nothing for the bytes tokenizer."""
  if not tok.path:
    return []
  folder, written = os.path.dirname(tok.path), []
  name = 'tokenizer.json' if tok.path.endswith('.json') else 'tokenizer.model'
  shutil.copyfile(tok.path, os.path.join(out, name))
  written.append(name)
  for extra in ('tokenizer_config.json', 'special_tokens_map.json'):
    if os.path.exists(os.path.join(folder, extra)):
      shutil.copyfile(os.path.join(folder, extra), os.path.join(out, extra))
      written.append(extra)
  if 'tokenizer_config.json' not in written and name == 'tokenizer.json':
    token = lambda i: tok.tok.id_to_token(i) if i is not None else None
    cfg = {'tokenizer_class': 'PreTrainedTokenizerFast', 'bos_token': token(tok.bos_id)}
    cfg |= {'eos_token': token(tok.eos_id), 'clean_up_tokenization_spaces': False}
    with open(os.path.join(out, 'tokenizer_config.json'), 'w') as f:
      json.dump(cfg, f, indent=2)
    written.append('tokenizer_config.json')
  return written


def export(
  params: Any, setup: Setup, out: str, max_shard_bytes: int = 2 << 30, fused_experts: bool = False
) -> list[str]:
  """Writes the Hugging Face folder `out` from `params` (any layout of `setup`, one process);
  returns the file names written. A mixture's experts one tensor per expert (the hub's layout),
  or with `fused_experts` transformers 5's fused tensors."""
  os.makedirs(out, exist_ok=True)
  tok = tok_lib.load(setup.cfg.data.tokenizer)
  cfg = config_json(setup, tok)  # refuses what no family holds before any tensor is written
  tensors = list(weights.hf_tensors(params, setup, fused_experts))
  groups, size = [[]], 0
  for t in tensors:  # consecutive tensors, max_shard_bytes per file (at least one tensor each)
    nbytes = int(np.prod(t[1])) * np.dtype(t[2]).itemsize
    if groups[-1] and size + nbytes > max_shard_bytes:
      groups.append([])
      size = 0
    groups[-1].append(t)
    size += nbytes
  names = (
    ['model.safetensors']
    if len(groups) == 1
    else [f'model-{i + 1:05d}-of-{len(groups):05d}.safetensors' for i in range(len(groups))]
  )
  for name, group in zip(names, groups, strict=True):
    safetensors_io.write(os.path.join(out, name), group, {'format': 'pt'})
  written = list(names)
  if len(groups) > 1:
    index = {
      'metadata': {'total_size': sum(int(np.prod(t[1])) * np.dtype(t[2]).itemsize for t in tensors)},
      'weight_map': {t[0]: n for n, g in zip(names, groups, strict=True) for t in g},
    }
    with open(os.path.join(out, 'model.safetensors.index.json'), 'w') as f:
      json.dump(index, f, indent=2)
    written.append('model.safetensors.index.json')
  with open(os.path.join(out, 'config.json'), 'w') as f:
    json.dump(cfg, f, indent=2)
  gen = {k: cfg[k] for k in ('bos_token_id', 'eos_token_id') if cfg[k] is not None}
  with open(os.path.join(out, 'generation_config.json'), 'w') as f:
    json.dump(gen, f, indent=2)
  return written + ['config.json', 'generation_config.json'] + _copy_tokenizer(tok, out)


def export_run(
  params: Any,
  setup: Setup,
  out: str,
  merge: bool,
  max_shard_bytes: int,
  run: str,
  verify: Callable[[str, str | None], None] | None = None,
) -> list[str]:
  """Writes the run `run`'s parameters to `out` whole or not at all (outdir.staged; the caller has
  checked `out` with outdir.check): a LoRA run's adapters as a PEFT folder for its hf: base, or
  with `merge` the whole model with the adapters merged (jax3d/model/lora.py); any other run as a
  Hugging Face model (`export`). `verify` (jax3d/trainer/export_parity.py) is called with the staged
  folder before it moves into place: (the folder to load, None), or for a PEFT adapter (its base,
  the adapter's folder). Returns the files written. ConfigError for `merge` without LoRA, or an
  adapter whose base is not a Hugging Face folder."""
  lora_run = setup.dims.lora_rank > 0
  if merge and not lora_run:
    raise ConfigError(f'--merge: the run {run} has no LoRA adapters (lora.rank=0); export it without --merge')
  if lora_run and not merge and setup.hf is None:
    raise ConfigError(
      f'the LoRA run {run} trained on the base {setup.cfg.checkpoint.init_from or "of train.seed"!r}, not a '
      'Hugging Face folder (checkpoint.init_from=hf:PATH): a PEFT adapter has no base to load onto; '
      'pass --merge to write the whole model'
    )
  with outdir.staged(out) as folder:
    if lora_run and not merge:
      files, base = peft.write(params, setup, folder, setup.hf.path), setup.hf.path
    else:
      merged = params
      if merge:
        shardings = quant.without_scales(lora.trainable(setup.dims, setup.param_shardings)[1])
        merged = jax.jit(lambda p: lora.merged(setup.dims, p), out_shardings=shardings)(params)
      files, base = export(merged, setup, folder, max_shard_bytes), None
    if verify is not None:
      verify(base or folder, folder if base else None)
  return files
