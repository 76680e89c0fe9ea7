"""The CPU default: a byte-level Llama on the standard library's source, learns in minutes on 2 cores.

python -m jax3d.train                       # this config, workdir runs/tiny
python -m jax3d.train --config.mesh.tp=4 --config.mesh.pp=1
"""

import ml_collections

from jax3d.config import base_config


def get_config() -> ml_collections.ConfigDict:
  c = base_config()
  c.mesh.dp, c.mesh.pp, c.mesh.tp = 2, 2, 2
  c.pipeline.microbatches = 4  # bubble (p-1)/(m+p-1) = 1/5 = 20%
  c.model.n_layers = 4
  c.model.d_model = 256
  c.model.n_heads = 4
  c.model.n_kv_heads = 2
  c.model.d_ff = 768
  c.model.vocab_size = 256
  c.train.steps = 300
  c.train.global_batch_size = 16
  c.train.seq_len = 128
  c.train.lr = 3e-3
  c.train.warmup_steps = 30
  c.log.every = 10
  c.eval.every = 100
  c.checkpoint.every = 100
  return c
