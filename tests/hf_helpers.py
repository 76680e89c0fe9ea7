"""Tiny random Hugging Face Llama models (made locally with transformers and CPU torch) and the
jax3d side of the comparisons: import onto a layout, logits of a batch, relative errors."""

from __future__ import annotations

import numpy as np

from jax3d import assemble, config as config_lib, loss as loss_lib, step as step_lib
from jax3d.hf import weights as hf_weights
from jax3d.parallel import sharding

# GQA (8 query heads over 4 KV heads), a vocabulary that is not a multiple of 128 (padded to 384),
# 4 layers (pp up to 4), heads and d_ff divisible by tp up to 4.
TINY = dict(
  vocab_size=300,
  hidden_size=64,
  intermediate_size=96,
  num_hidden_layers=4,
  num_attention_heads=8,
  num_key_value_heads=4,
  max_position_embeddings=64,
  rope_theta=500.0,
  rms_norm_eps=1e-5,
)
LAYOUTS = [(1, 1, 1), (2, 2, 2), (1, 2, 4), (1, 4, 2)]
BATCH, SEQ = 4, 16


def make_hf_model(path: str, tied: bool, seed: int = 0, dtype: str = 'float32', **over: object) -> object:
  """A random LlamaForCausalLM saved to `path` (safetensors); returns the torch model (eval mode).
  The norm scales are randomised too (transformers initialises them to 1)."""
  import torch
  from transformers import LlamaConfig, LlamaForCausalLM

  torch.manual_seed(seed)
  model = LlamaForCausalLM(LlamaConfig(**{**TINY, **over}, tie_word_embeddings=tied)).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith('norm.weight'):
        p.copy_(1 + 0.1 * torch.randn_like(p))
  model.to(getattr(torch, dtype)).save_pretrained(path)
  return model.float()


# One tiny random model per family, as transformers writes it (config.json in its own layout).
# Llama 3.2 style: tied, llama3 rope scaling at rope_theta 500000 whose original context (16) the
# test sequences pass, with the high (wavelength 6.3), medium (32) and low (167+) bands all present
# (head size 16); Qwen2.5 style: q/k/v biases, tied, GQA; Qwen3 style: q/k norms, head_dim 16 !=
# hidden/heads, untied; Mistral: a sliding window (64) that covers the sequence.
FAMILIES = {
  'llama3.2': dict(
    cls='Llama',
    hidden_size=128,
    tie_word_embeddings=True,
    rope_scaling=dict(
      rope_type='llama3',
      factor=8.0,
      low_freq_factor=0.4,
      high_freq_factor=2.0,
      original_max_position_embeddings=16,
      rope_theta=500000.0,
    ),
    rope_theta=500000.0,
  ),
  'qwen2.5': dict(cls='Qwen2', tie_word_embeddings=True, rope_theta=1000000.0),
  'qwen3': dict(cls='Qwen3', head_dim=16, tie_word_embeddings=False, rope_theta=1000000.0),
  'mistral': dict(cls='Mistral', sliding_window=64, tie_word_embeddings=False),
}
FAMILY_SEQ = 32  # past the llama3.2 model's original context


def make_family_model(
  path: str, family: str, seed: int = 0, families: dict | None = None, spread: str = 'bias'
) -> object:
  """A random model of `family` (in `families`, default FAMILIES) saved to `path`; returns the torch
  model (eval mode). Norm scales and the parameters whose name ends with `spread` (the biases; a
  mixture's router, for a decisive routing) are randomised too (transformers initialises them to
  1, 0 or a narrow normal)."""
  import torch
  import transformers

  spec = dict((families or FAMILIES)[family])
  name = spec.pop('cls')
  conf = getattr(transformers, f'{name}Config')(**{**TINY, 'max_position_embeddings': 128, **spec})
  torch.manual_seed(seed)
  model = getattr(transformers, f'{name}ForCausalLM')(conf).eval()
  with torch.no_grad():
    for pname, p in model.named_parameters():
      if pname.endswith('norm.weight'):
        p.copy_(1 + 0.1 * torch.randn_like(p))
      elif pname.endswith(spread):
        p.copy_(0.5 * torch.randn_like(p))
  model.save_pretrained(path)
  return model


def tokens(seed: int = 0, vocab: int = TINY['vocab_size'], seq: int = SEQ) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, vocab, (BATCH, seq)).astype(np.int32)


def hf_logits(model: object, toks: np.ndarray) -> np.ndarray:
  import torch

  with torch.no_grad():
    return model(torch.as_tensor(toks, dtype=torch.long)).logits.float().numpy()


def jax3d_cfg(path: str, layout: tuple[int, int, int], **over: object) -> object:
  dp, pp, tp = layout
  ov = {
    'checkpoint.init_from': f'hf:{path}',
    'mesh.dp': dp,
    'mesh.pp': pp,
    'mesh.tp': tp,
    'pipeline.microbatches': 2 if pp > 1 else 1,
    'train.global_batch_size': BATCH,
    'train.seq_len': SEQ,
  }
  ov.update(over)
  return config_lib.load_config('tiny', ov)


def imported(path: str, layout: tuple[int, int, int], **over: object) -> tuple[object, object]:
  """(setup, params) of the checkpoint at `path` imported onto `layout` (the first devices)."""
  import jax

  cfg = jax3d_cfg(path, layout, **over)
  n = layout[0] * layout[1] * layout[2]
  s = assemble.build(cfg, jax.devices()[:n])
  return s, hf_weights.load_params(s)


def make_logits(s: object) -> step_lib.MeshJit:
  """jit(loss.logits) for a batch of `train.global_batch_size` rows of token ids, as training
  computes them (its mesh and logical rules, the parameters' and the batch's shardings)."""

  def fn(params, tokens_bt):
    with sharding.use_rules(s.rules):
      return loss_lib.logits(params, tokens_bt, s)

  return step_lib.MeshJit(fn, s.mesh, in_shardings=(s.param_shardings, s.batch_sharding))


def jax3d_logits(s: object, params: object, toks: np.ndarray) -> np.ndarray:
  import jax

  out = make_logits(s)(params, jax.device_put(toks, s.batch_sharding))
  return np.asarray(jax.device_get(out))[..., : s.dims.vocab_size]


def rel_err(a: np.ndarray, ref: np.ndarray) -> float:
  """max |a - ref| / max |ref|: the error relative to the logits' scale."""
  return float(np.max(np.abs(a - ref)) / np.max(np.abs(ref)))


def trained_logits(cfg: object, workdir: str, toks: np.ndarray, devices: object = None) -> np.ndarray:
  """Train a Trainer of `cfg` in `workdir` for its train.steps (on `devices`, default all);
  jax3d's logits of `toks` after."""
  from jax3d.trainer.trainer import Trainer

  t = Trainer(cfg, workdir=workdir, devices=devices, console=False)
  try:
    t.train()
    return jax3d_logits(t.setup, t.state['params'], toks)
  finally:
    t.close()
