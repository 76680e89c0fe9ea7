"""The model families jax3d loads from a Hugging Face folder, and every config.json key it reads.

An allow-list, not a deny-list: a key either changes nothing jax3d computes (NEUTRAL: names, token
ids, generation defaults, bookkeeping), or is read into a model.* setting, or is checked to hold a
value jax3d computes exactly (`check`). Any other key loads only when its value is off (null,
false, 0, "", empty); with any other value the folder is refused, naming the file, the key and the
value, so an unknown feature (an interleaved rotation, a soft-cap, a quantisation) can never load
as a different model.

  family    architecture        what it adds to the Llama decoder
  llama     LlamaForCausalLM    (Llama 2, 3, 3.1-3.3 with llama3 rope scaling, 3.2 tied, SmolLM2, TinyLlama)
  mistral   MistralForCausalLM  a sliding window, accepted when it covers train.seq_len
  qwen2     Qwen2ForCausalLM    biases on q, k and v (Qwen2, Qwen2.5)
  qwen3     Qwen3ForCausalLM    per-head RMSNorm of q and k, head_dim != hidden/heads
  mixtral   MixtralForCausalLM  a mixture of experts in every layer (top-k renormalised)
  qwen3_moe Qwen3MoeForCausalLM Qwen3's attention, a mixture of experts in every layer

A mixture's experts load from either layout: one tensor per expert and projection (what
`save_pretrained` writes, the hub's files) or transformers 5's fused expert tensors
(mlp.experts.gate_up_proj [E, 2f, d], mlp.experts.down_proj [E, d, f]) (`expert_names`).
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Family:
  architecture: str
  qkv_bias: bool = False
  qk_norm: bool = False
  moe: bool = False
  moe_prefix: str = 'mlp'  # the per-expert tensors' module (Mixtral's: block_sparse_moe)
  expert_names: tuple[str, str, str] = ('gate_proj', 'up_proj', 'down_proj')  # per-expert gate, up, down


FAMILIES = {
  'llama': Family('LlamaForCausalLM'),
  'mistral': Family('MistralForCausalLM'),
  'qwen2': Family('Qwen2ForCausalLM', qkv_bias=True),
  'qwen3': Family('Qwen3ForCausalLM', qk_norm=True),
  'mixtral': Family(
    'MixtralForCausalLM', moe=True, moe_prefix='block_sparse_moe', expert_names=('w1', 'w3', 'w2')
  ),
  'qwen3_moe': Family('Qwen3MoeForCausalLM', qk_norm=True, moe=True),
}


def family_of(qkv_bias: bool, qk_norm: bool, model_type: str = '', moe: bool = False) -> str:
  """The model_type an export writes: the one given (an import's), else the one the features need."""
  if model_type:
    return model_type
  if moe:
    return 'qwen3_moe' if qk_norm else 'mixtral'
  return 'qwen3' if qk_norm else 'qwen2' if qkv_bias else 'llama'


# Keys that change nothing jax3d computes.
NEUTRAL = frozenset(
  (
    '_name_or_path architectures model_type transformers_version torch_dtype dtype auto_map '
    'bos_token_id eos_token_id pad_token_id sep_token_id decoder_start_token_id '
    'forced_bos_token_id forced_eos_token_id initializer_range use_cache pretraining_tp '
    'is_llama_config id2label label2id problem_type finetuning_task tokenizer_class prefix '
    'task_specific_params output_attentions output_hidden_states output_scores return_dict '
    'return_dict_in_generate torchscript use_bfloat16 tf_legacy_loss pruned_heads '
    'chunk_size_feed_forward is_encoder_decoder is_decoder add_cross_attention '
    'cross_attention_hidden_size tie_encoder_decoder max_length min_length do_sample early_stopping '
    'num_beams num_beam_groups diversity_penalty temperature top_k top_p typical_p '
    'repetition_penalty length_penalty no_repeat_ngram_size encoder_no_repeat_ngram_size '
    'bad_words_ids num_return_sequences remove_invalid_values exponential_decay_length_penalty '
    'suppress_tokens begin_suppress_tokens output_router_logits'
  ).split()
)

# Keys read into model.* (hf/config.py model_keys) or checked below.
READ = frozenset(
  (
    'num_hidden_layers hidden_size num_attention_heads num_key_value_heads intermediate_size '
    'vocab_size head_dim rms_norm_eps rope_theta rope_scaling rope_parameters '
    'max_position_embeddings tie_word_embeddings sliding_window use_sliding_window '
    'max_window_layers layer_types num_local_experts num_experts num_experts_per_tok '
    'moe_intermediate_size norm_topk_prob router_aux_loss_coef'
  ).split()
)

ROPE_KEYS = {
  'default': ('rope_type', 'type', 'rope_theta'),
  'linear': ('rope_type', 'type', 'rope_theta', 'factor'),
  'llama3': (
    'rope_type',
    'type',
    'rope_theta',
    'factor',
    'low_freq_factor',
    'high_freq_factor',
    'original_max_position_embeddings',
  ),
}


def _off(value: Any) -> bool:
  return value is None or value is False or value == 0 or value in ('', [], {})


def check(c: dict, model_type: str) -> tuple[str, Any, str] | None:
  """The first key of config.json `c` jax3d would not compute exactly: (key, value, what would
  load), or None."""
  fam = FAMILIES[model_type]
  rules = {
    'hidden_act': (lambda v: v in ('silu', 'swish'), 'silu (the SwiGLU MLP)'),
    'mlp_bias': (_off, 'false (jax3d MLPs have no biases)'),
    'attention_dropout': (_off, '0 (jax3d has no dropout)'),
    'partial_rotary_factor': (lambda v: v == 1, '1 (the rotation covers the whole head)'),
    # Qwen2's q/k/v biases are part of the architecture (the key is unused there); elsewhere
    # attention_bias adds an output-projection bias too, which jax3d does not have.
    'attention_bias': (lambda v: fam.qkv_bias or _off(v), 'false (no attention biases in this family)'),
    'decoder_sparse_step': (lambda v: v == 1, '1 (every layer a mixture of experts)'),
  }
  for key, value in c.items():
    if key in NEUTRAL or key in READ:
      continue
    if key in rules:
      ok, valid = rules[key]
      if not ok(value):
        return key, value, valid
    elif not _off(value):
      return key, value, 'absent or off: jax3d does not implement it, and it may change the computation'
  return None


def rope_spec(c: dict) -> tuple[str, dict, str]:
  """(kind, its parameters, the key they came from) of config.json `c`: transformers 5 writes
  `rope_parameters` (rope_theta inside), the hub's older files `rope_scaling` beside `rope_theta`."""
  key = 'rope_parameters' if c.get('rope_parameters') else 'rope_scaling'
  spec = c.get(key) or {}
  return str(spec.get('rope_type') or spec.get('type') or 'default'), spec, key


def rope_problem(c: dict) -> tuple[str, Any, str] | None:
  """(key, value, what would load) when the rotary settings are not ones jax3d computes."""
  kind, spec, key = rope_spec(c)
  if kind not in ROPE_KEYS:
    return f'{key}.rope_type', kind, f'one of {", ".join(ROPE_KEYS)} (jax3d/model/rope.py)'
  for name, value in spec.items():
    if name not in ROPE_KEYS[kind] and not _off(value):
      return (
        f'{key}.{name}',
        value,
        f'absent for rope type {kind} (its keys: {", ".join(ROPE_KEYS[kind][2:])})',
      )
  missing = [name for name in ROPE_KEYS[kind][3:] if not isinstance(spec.get(name), int | float)]
  if missing:
    return f'{key}.{missing[0]}', spec.get(missing[0]), f'a number (rope type {kind} needs it)'
  return None


def sliding_window(c: dict, model_type: str) -> int | None:
  """The window the model attends within, when some layer has one (None: full attention)."""
  window = c.get('sliding_window')
  if not window:
    return None
  if model_type == 'mistral' or c.get('use_sliding_window'):
    return int(window)
  return int(window) if 'sliding_attention' in (c.get('layer_types') or []) else None


def n_experts(c: dict) -> int:
  """The routed experts per layer of config.json `c` (0: dense), under any of the names used."""
  return int(c.get('num_local_experts') or c.get('num_experts') or 0)
