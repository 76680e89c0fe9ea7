"""GPT-2 small class (124M parameters with GPT-2's vocabulary), Llama-style blocks."""

import ml_collections

from jax3d.config import base_config


def get_config() -> ml_collections.ConfigDict:
  c = base_config()
  c.mesh.dp, c.mesh.pp, c.mesh.tp = -1, 1, 1
  c.model.n_layers = 12
  c.model.d_model = 768
  c.model.n_heads = 12
  c.model.n_kv_heads = 12
  c.model.d_ff = 2048  # SwiGLU: 3 matrices of 768x2048 ~ GPT-2's 2 of 768x3072
  c.model.vocab_size = 50257  # padded to 50304
  c.model.max_seq_len = 1024
  c.train.seq_len = 1024
  c.train.global_batch_size = 64
  c.train.lr = 6e-4
  c.train.compute_dtype = 'bfloat16'
  c.train.remat = 'full'
  c.train.steps = 5000
  c.pipeline.microbatches = 4
  return c
