"""Llama 3 70B shapes (for GPU clusters and planning): 80 layers, d 8192, GQA 64/8, d_ff 28672."""

import ml_collections

from jax3d.config import base_config


def get_config() -> ml_collections.ConfigDict:
  c = base_config()
  c.mesh.dp, c.mesh.pp, c.mesh.tp = -1, 2, 8
  c.model.n_layers = 80
  c.model.d_model = 8192
  c.model.n_heads = 64
  c.model.n_kv_heads = 8
  c.model.d_ff = 28672
  c.model.vocab_size = 128256
  c.model.max_seq_len = 8192
  c.model.rope_theta = 500000.0
  c.train.seq_len = 8192
  c.train.global_batch_size = 512
  c.train.lr = 1.5e-4
  c.train.compute_dtype = 'bfloat16'
  c.train.remat = 'full'
  c.pipeline.microbatches = 16
  return c
