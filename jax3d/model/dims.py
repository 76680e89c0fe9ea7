"""The model's sizes and dtypes (`Dims`), read from a config: what every layer is built from."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from jax3d import config as config_lib
from jax3d.config import Config
from jax3d.model import formulas
from jax3d.model.rope import RopeScaling


@dataclasses.dataclass(frozen=True)
class Dims:
  n_layers: int
  d_model: int
  n_heads: int
  n_kv_heads: int
  d_ff: int
  vocab_size: int  # the real vocabulary
  vocab_padded: int  # padded to model.vocab_multiple; padded entries never win
  rope_theta: float = 10000.0
  norm_eps: float = 1e-5
  dtype: Any = jnp.float32  # compute
  param_dtype: Any = jnp.float32
  attention: str = 'auto'  # train.attention; assemble.build resolves it to the kernel: 'xla' | 'cudnn'
  cp_strategy: str = 'allgather'  # train.cp_strategy: attention over a sequence split over mesh.cp
  head_size: int = 0  # model.head_dim; 0 = d_model // n_heads
  qkv_bias: bool = False  # biases on the q, k, v projections (Qwen2)
  qk_norm: bool = False  # per-head RMSNorm of queries and keys before the rotation (Qwen3)
  tie_embeddings: bool = False  # the head is the embedding table (one parameter)
  rope_scaling: RopeScaling = RopeScaling()
  lora_rank: int = 0  # lora.rank: adapters on `lora_targets` (jax3d/model/lora.py); 0 = none
  lora_alpha: float = 16.0
  lora_targets: tuple[str, ...] = ()
  lora_dtype: Any = jnp.float32  # the adapters' (train.param_dtype; param_dtype is the base's)
  lora_dropout: float = 0.0  # lora.dropout: on the adapters' input in training steps
  base_int8: bool = False  # lora.base_dtype=int8: int8 projection kernels (jax3d/model/quant.py)
  n_experts: int = 0  # moe.num_experts: the MLP a mixture of experts (jax3d/model/moe.py); 0 = dense
  top_k: int = 2
  norm_topk_prob: bool = True
  d_expert: int = 0  # 0 = d_ff
  d_shared: int = 0  # a shared expert's hidden size; 0 = none
  capacity_factor: float = 1.25
  fp8: bool = False  # train.matmul_dtype=fp8: the projections' matmuls in FP8 (jax3d/model/fp8.py)

  @property
  def expert_ff(self) -> int:
    """One expert's SwiGLU hidden size (moe.d_expert, or model.d_ff)."""
    return self.d_expert or self.d_ff

  @property
  def lora_scale(self) -> float:
    return self.lora_alpha / self.lora_rank

  def adapted(self, target: str) -> bool:
    """Whether projection `target` (q, k, v, o, gate, up, down) carries a LoRA adapter."""
    return self.lora_rank > 0 and target in self.lora_targets

  @property
  def head_dim(self) -> int:
    return self.head_size or self.d_model // self.n_heads

  @staticmethod
  def from_config(cfg: Config, plan: config_lib.RunPlan | None = None) -> Dims:
    """The model of `cfg`; the padded vocabulary comes from `plan` when given (the same number)."""
    m = cfg.model
    vocab_padded = plan.vocab_padded if plan is not None else config_lib.padded_vocab(m)
    return Dims(
      n_layers=m.n_layers,
      d_model=m.d_model,
      n_heads=m.n_heads,
      n_kv_heads=m.n_kv_heads,
      d_ff=m.d_ff,
      vocab_size=m.vocab_size,
      vocab_padded=vocab_padded,
      rope_theta=m.rope_theta,
      norm_eps=m.norm_eps,
      dtype=jnp.dtype(cfg.train.compute_dtype),
      param_dtype=jnp.dtype(_base_dtype(cfg)),
      attention=cfg.train.attention,
      cp_strategy=cfg.train.cp_strategy,
      head_size=m.head_dim,
      qkv_bias=m.qkv_bias,
      qk_norm=m.qk_norm,
      tie_embeddings=m.tie_embeddings,
      rope_scaling=RopeScaling(
        m.rope_scaling,
        m.rope_factor,
        m.rope_low_freq_factor,
        m.rope_high_freq_factor,
        m.rope_original_max_seq_len,
      ),
      lora_rank=cfg.lora.rank,
      lora_alpha=float(cfg.lora.alpha),
      lora_targets=config_lib.lora_targets(cfg.lora.targets),
      lora_dtype=jnp.dtype(cfg.train.param_dtype),
      lora_dropout=float(cfg.lora.dropout),
      base_int8=bool(cfg.lora.rank) and cfg.lora.base_dtype == 'int8',
      n_experts=cfg.moe.num_experts,
      top_k=cfg.moe.top_k,
      norm_topk_prob=cfg.moe.norm_topk_prob,
      d_expert=cfg.moe.d_expert,
      d_shared=cfg.moe.d_shared,
      capacity_factor=float(cfg.moe.capacity_factor),
      fp8=cfg.train.matmul_dtype == 'fp8',
    )

  def param_count(self) -> int:
    """Parameters of the real model (padded vocabulary rows excluded): formulas.param_count."""
    return formulas.param_count(self)


def _base_dtype(cfg: Config) -> str:
  """The base's float dtype: lora.base_dtype (bfloat16 beside int8 kernels), else train.param_dtype."""
  base = cfg.lora.base_dtype if cfg.lora.rank else ''
  return 'bfloat16' if base == 'int8' else base or cfg.train.param_dtype
