"""Qwen3-30B-A3B shapes (for GPU runs and planning): 48 layers, d 2048, GQA 32/4 of head 128 with q/k
norms, 128 experts of 768 per layer (top-8, renormalised), vocab 151936; 30.5B parameters, 3.3B
active. On 8 GPUs: the experts over ep=8 (16 per GPU), data parallel over the same 8 outside them:
72.3 GB per H100 compiled (XLA:GPU, --target=h100x8), bf16 master weights and Adam.

python -m jax3d.inspect --config=configs/qwen3_30b_a3b.py --target=h100x8
"""

import ml_collections

from jax3d.config import base_config


def get_config() -> ml_collections.ConfigDict:
  c = base_config()
  c.mesh.dp, c.mesh.ep, c.mesh.pp, c.mesh.tp = 1, 8, 1, 1
  c.model.n_layers = 48
  c.model.d_model = 2048
  c.model.n_heads = 32
  c.model.n_kv_heads = 4
  c.model.head_dim = 128
  c.model.qk_norm = True
  c.model.d_ff = 6144
  c.model.vocab_size = 151936
  c.model.max_seq_len = 4096
  c.model.rope_theta = 1000000.0
  c.model.norm_eps = 1e-6
  c.moe.num_experts = 128
  c.moe.top_k = 8
  c.moe.d_expert = 768
  c.moe.norm_topk_prob = True
  c.moe.capacity_factor = 1.25
  c.moe.aux_loss_coef = 0.001
  c.train.seq_len = 4096
  c.train.global_batch_size = 64
  c.train.grad_accum = 8
  c.train.lr = 3e-4
  c.train.compute_dtype = 'bfloat16'
  c.train.param_dtype = 'bfloat16'  # master weights and Adam in bf16: ZeRO does not shard over ep
  c.train.remat = 'full'
  c.train.loss_chunks = 8
  return c
