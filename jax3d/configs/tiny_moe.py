"""A tiny mixture of experts on CPU: the byte-level model of configs/tiny.py with 8 experts per
layer (top-2, Mixtral-style routing), the experts split over ep=2, learns in minutes on 2 cores.

python -m jax3d.train --config=configs/tiny_moe.py                     # workdir runs/tiny_moe
python -m jax3d.train --config=configs/tiny_moe.py --config.mesh.ep=4 --config.mesh.tp=1
"""

import ml_collections

from jax3d.config import base_config


def get_config() -> ml_collections.ConfigDict:
  c = base_config()
  c.mesh.dp, c.mesh.ep, c.mesh.pp, c.mesh.tp = 2, 2, 1, 2
  c.model.n_layers = 4
  c.model.d_model = 256
  c.model.n_heads = 4
  c.model.n_kv_heads = 2
  c.model.d_ff = 768
  c.model.vocab_size = 256
  c.moe.num_experts = 8
  c.moe.top_k = 2
  c.moe.d_expert = 256  # 8 experts of 256: about the dense model's MLP parameters x 2.7, 2/8 active
  c.moe.capacity_factor = 1.25
  c.moe.aux_loss_coef = 0.01
  c.moe.z_loss_coef = 1e-3
  c.train.steps = 300
  c.train.global_batch_size = 16
  c.train.seq_len = 128
  c.train.lr = 3e-3
  c.train.warmup_steps = 30
  c.log.every = 10
  c.eval.every = 100
  c.checkpoint.every = 100
  return c
