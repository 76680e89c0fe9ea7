"""Llama 3 8B shapes (for GPU runs and planning): 32 layers, d 4096, GQA 32/8, d_ff 14336, vocab 128256."""

import ml_collections

from jax3d.config import base_config


def get_config() -> ml_collections.ConfigDict:
  c = base_config()
  c.mesh.dp, c.mesh.pp, c.mesh.tp = -1, 1, 8
  c.model.n_layers = 32
  c.model.d_model = 4096
  c.model.n_heads = 32
  c.model.n_kv_heads = 8
  c.model.d_ff = 14336
  c.model.vocab_size = 128256
  c.model.max_seq_len = 8192
  c.model.rope_theta = 500000.0
  c.train.seq_len = 8192
  c.train.global_batch_size = 128
  c.train.lr = 3e-4
  c.train.compute_dtype = 'bfloat16'
  c.train.remat = 'full'
  c.pipeline.microbatches = 8
  return c
