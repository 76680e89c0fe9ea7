"""Mixtral 8x7B shapes (for GPU runs and planning): 32 layers, d 4096, GQA 32/8, 8 experts of 14336
per layer (top-2), vocab 32000; 46.7B parameters, 12.9B active. On 16 GPUs (2 nodes of 8): two
pipeline stages (one per node), in each the experts over ep=4 (two per GPU) and Megatron-split over
tp=2: 58.5 GB per H100 compiled (XLA:GPU, --target=h100x16). The planner's best, dp=2 x ep=8 with
remat dots and ZeRO-1, compiles to 78.8 GB (docs/plan.md).

python -m jax3d.inspect --config=configs/mixtral_8x7b.py --target=h100x16
"""

import ml_collections

from jax3d.config import base_config


def get_config() -> ml_collections.ConfigDict:
  c = base_config()
  c.mesh.dp, c.mesh.ep, c.mesh.pp, c.mesh.tp = 1, 4, 2, 2
  c.pipeline.microbatches = 4
  c.model.n_layers = 32
  c.model.d_model = 4096
  c.model.n_heads = 32
  c.model.n_kv_heads = 8
  c.model.d_ff = 14336
  c.model.vocab_size = 32000
  c.model.max_seq_len = 4096
  c.model.rope_theta = 1000000.0
  c.moe.num_experts = 8
  c.moe.top_k = 2
  c.moe.capacity_factor = 1.25
  c.moe.aux_loss_coef = 0.02
  c.train.seq_len = 4096
  c.train.global_batch_size = 64
  c.train.grad_accum = 4
  c.train.lr = 3e-4
  c.train.compute_dtype = 'bfloat16'
  c.train.param_dtype = 'bfloat16'  # master weights and Adam in bf16: ZeRO does not shard over ep
  c.train.remat = 'full'
  c.train.loss_chunks = 8
  return c
