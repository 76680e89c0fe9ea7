"""The model's counting formulas, in one place: parameters, FLOPs per token, MFU.

Parameters (`dims` is a jax3d.model.dims.Dims, or anything with its fields and `head_dim`):

  per layer        2*d (two RMSNorm scales) + d*hd*(2*n + 2*k) (q, o; k, v) + 3*d*f (gate, up, down)
                   + hd*(n + 2*k) with q/k/v biases (qkv_bias) + 2*hd with q/k norms (qk_norm);
                   a mixture of experts: E*3*d*f_e (experts) + d*E (router) + 3*d*f_s (a shared
                   expert) in place of 3*d*f
  embedding/head   2*V*d (input table, output projection) + d (final norm); V*d + d when tied
  total            L * per layer + embedding/head, with the real vocabulary V (padded rows excluded)

Model FLOPs and MFU: the standard numerator (PaLM appendix B) over the hardware's peak. With a
mixture of experts P counts the parameters a token uses: its top_k experts of the E.

  model FLOPs per token = 6 * P + 12 * L * h * s
  MFU = tokens/s * model FLOPs per token / (peak FLOP/s per device * devices)

P is the parameter count of the real model *minus the input embedding table*: the embedding is a
lookup (a gather) and does no multiply-adds, while the output head is a real [h, V] matmul and is
counted. A tied table is the head's matmul too, so it stays in P. (PaLM's N is the parameter count;
nanoGPT drops the position table for the same reason.) The 12*L*h*s term is attention's scores and
weighted sum (2 matmuls of 2*s*h FLOPs per token per layer, times 3 for forward + backward), counted
over the full s as PaLM does (no causal halving). Recomputation (remat) and the SPMD pipeline's
bubble iterations are *not* counted: MFU measures useful work, so they lower MFU (they would count
in HFU).

Peaks are dense bf16 tensor-core FLOP/s from the vendors' data sheets, per device. There is no
honest peak for a CPU, so on CPU (or an unknown device) MFU is None unless the config sets
`hardware.peak_tflops`. Note an fp32 run on a GPU runs its matmuls in TF32 at best (half the
bf16 peak or less), so its MFU against the bf16 peak is low by construction.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
  import jax


class Dims(Protocol):
  """The model sizes the formulas read (jax3d.model.dims.Dims has them; dims imports this
  module, so the formulas name the fields, not that class)."""

  n_layers: int
  d_model: int
  n_heads: int
  n_kv_heads: int
  d_ff: int
  vocab_size: int
  vocab_padded: int
  qkv_bias: bool
  qk_norm: bool
  tie_embeddings: bool
  n_experts: int
  top_k: int
  d_expert: int
  d_shared: int

  @property
  def head_dim(self) -> int: ...


# (substring of jax's device.device_kind, dense bf16 TFLOP/s per device). First match wins, so
# the more specific names come first.
PEAK_TFLOPS = (
  ('H100 PCIe', 756.0),
  ('H100', 989.0),  # SXM ('NVIDIA H100 80GB HBM3')
  ('H200', 989.0),
  ('H800', 989.0),
  ('GH200', 989.0),
  ('B200', 2250.0),
  ('A100', 312.0),
  ('A800', 312.0),
  ('L40S', 362.0),
  ('L4', 121.0),
  ('A10', 125.0),
  ('V100', 125.0),  # fp16 tensor cores (no bf16)
  ('TPU v6 lite', 918.0),
  ('TPU v5 lite', 197.0),
  ('TPU v5', 459.0),  # v5p
  ('TPU v4', 275.0),
)


def layer_params(dims: Dims, tp: int = 1, active: bool = False, ep: int = 1) -> int:
  """Parameters of one decoder layer on one of `tp` (and `ep`) shards: the matrices split over tp,
  a mixture's routed experts over tp and ep, the norms and a router whole; `active`: of a mixture
  of experts only the top_k experts a token goes through."""
  d, hd, n, k = dims.d_model, dims.head_dim, dims.n_heads, dims.n_kv_heads
  routed = mlp_matrices(dims, active) - 3 * d * dims.d_shared if dims.n_experts else 0
  matrices = d * hd * (2 * n + 2 * k) + mlp_matrices(dims, active) - routed
  biases = hd * (n + 2 * k) if dims.qkv_bias else 0  # split with their heads
  router = d * dims.n_experts
  norms = 2 * d + (2 * hd if dims.qk_norm else 0)
  return (matrices + biases) // tp + routed // (tp * ep) + norms + router


def capacity(capacity_factor: float, seq_len: int, top_k: int, n_experts: int) -> int:
  """A mixture's slots per expert and capacity group of seq_len tokens (jax3d/model/moe.py):
  ceil(capacity_factor * t * k / E), between 1 and t."""
  return max(1, min(seq_len, math.ceil(capacity_factor * seq_len * top_k / n_experts)))


def mlp_matrices(dims: Dims, active: bool = False) -> int:
  """The feed-forward matrices of one layer: 3*d*f, or a mixture's experts (all E, or top_k of
  them when `active`) and its shared expert."""
  if not dims.n_experts:
    return 3 * dims.d_model * dims.d_ff
  experts = dims.top_k if active else dims.n_experts
  return 3 * dims.d_model * (experts * (dims.d_expert or dims.d_ff) + dims.d_shared)


def int8_layer_bytes(dims: Dims, tp: int = 1) -> float:
  """Bytes of one decoder layer of an int8 base on one of `tp` shards (jax3d/model/quant.py): the
  matrices in int8, a float32 scale per output channel (split over tp for the column-parallel
  qkv and gate/up, whole for the row-parallel o and down), the norms and biases in bfloat16."""
  d, hd, n, k, f = dims.d_model, dims.head_dim, dims.n_heads, dims.n_kv_heads, dims.d_ff
  matrices = d * hd * (2 * n + 2 * k) + mlp_matrices(dims)
  scales = (hd * (n + 2 * k) + 2 * f) / tp + 2 * d
  rest = layer_params(dims, tp) - matrices / tp
  return matrices / tp + 4 * scales + 2 * rest


def lora_layer_params(dims: Dims, tp: int = 1) -> float:
  """LoRA adapter parameters of one decoder layer on one of `tp` shards (jax3d/model/lora.py): per
  target r (in + out), the column-parallel projections' B and the row-parallel ones' A split."""
  d, hd, n, k, f, r = dims.d_model, dims.head_dim, dims.n_heads, dims.n_kv_heads, dims.d_ff, dims.lora_rank
  # target -> (in, out, column-parallel)
  shapes = {'q': (d, n * hd, 1), 'k': (d, k * hd, 1), 'v': (d, k * hd, 1), 'o': (n * hd, d, 0)}
  shapes |= {'gate': (d, f, 1), 'up': (d, f, 1), 'down': (f, d, 0)}
  return sum(r * (i + o / tp if col else i / tp + o) for t, (i, o, col) in shapes.items() if dims.adapted(t))


def embed_head_params(dims: Dims, tp: int = 1, padded: bool = False) -> int:
  """Embedding table, output projection (vocabulary rows split over `tp`) and the final norm; with
  `padded` the padded vocabulary (what is stored), else the real one."""
  vocab = dims.vocab_padded if padded else dims.vocab_size
  tables = 1 if dims.tie_embeddings else 2
  return tables * vocab * dims.d_model // tp + dims.d_model


def param_count(dims: Dims) -> int:
  """Parameters of the real model (padded vocabulary rows excluded)."""
  return dims.n_layers * layer_params(dims) + embed_head_params(dims)


def model_params(dims: Dims) -> int:
  """P of the MFU numerator: every parameter a token uses except the input embedding table (a
  lookup; a tied table is also the head's matmul, and stays); of a mixture, its top_k experts."""
  active = dims.n_layers * layer_params(dims, active=True) + embed_head_params(dims)
  return active - (0 if dims.tie_embeddings else dims.vocab_size * dims.d_model)


def attention_flops_per_token(dims: Dims, seq_len: int) -> float:
  """The 12 * L * h * s term: attention scores and weighted sum, forward + backward."""
  return 12.0 * dims.n_layers * dims.d_model * seq_len


def flops_per_token(dims: Dims, seq_len: int) -> float:
  """Training FLOPs per token, 6 * P + 12 * L * h * s (forward + backward, no recompute)."""
  return 6.0 * model_params(dims) + attention_flops_per_token(dims, seq_len)


def stage_forward_flops(dims: Dims, n_layers: int, tokens: int) -> float:
  """Forward FLOPs of `n_layers` decoder layers over `tokens` tokens (2 per weight per token;
  attention's scores are not counted): what one pipeline stage computes."""
  return 2.0 * n_layers * layer_params(dims) * tokens


def peak_flops(device: jax.Device | None = None, override_tflops: float = 0.0) -> float | None:
  """Peak FLOP/s of one device: the override if > 0, else the table, else None (CPU, unknown)."""
  if override_tflops and override_tflops > 0:
    return float(override_tflops) * 1e12
  if device is None or getattr(device, 'platform', 'cpu') == 'cpu':
    return None
  kind = getattr(device, 'device_kind', '')
  for name, tflops in PEAK_TFLOPS:
    if name in kind:
      return tflops * 1e12
  return None


def mfu(
  tokens_per_sec: float, per_token_flops: float, peak_per_device: float | None, n_devices: int
) -> float | None:
  """Model FLOPs utilisation in [0, 1], or None when the peak is unknown."""
  if not peak_per_device or n_devices < 1:
    return None
  return tokens_per_sec * per_token_flops / (peak_per_device * n_devices)


class MFUMeter:
  """What the trainer needs per log line: built once from the config, called with tokens/s.

  meter = formulas.MFUMeter(setup.dims, cfg.train.seq_len, jax.devices()[0], plan.n_devices,
                            cfg.hardware.peak_tflops)
  record['mfu'] = meter(tokens_per_sec)      # float or None
  """

  def __init__(
    self, dims: Dims, seq_len: int, device: jax.Device | None, n_devices: int, override_tflops: float = 0.0
  ) -> None:
    self.per_token = flops_per_token(dims, seq_len)
    self.peak = peak_flops(device, override_tflops)
    self.n_devices = n_devices

  def __call__(self, tokens_per_sec: float) -> float | None:
    return mfu(tokens_per_sec, self.per_token, self.peak, self.n_devices)


# Of a layer's 2 forward tp all-reduces (after attention, after the MLP), how many the backward pass
# runs again, read off the compiled HLO (jax3d.inspect): 'full' and 'attn' recompute the attention
# block's (its sum feeds the MLP) but not the MLP's, whose sum is the layer's output, which the
# layer's own backward never needs; 'stage' recomputes the iteration (both) and then each layer (1).
TP_ALL_REDUCES_RECOMPUTED = {'none': 0, 'dots': 0, 'attn': 1, 'full': 1, 'stage': 3}

# With sequence parallelism (Megatron-SP) a layer's tp traffic is all-gathers and reduce-scatters,
# each (t-1)/t of a micro-batch's [b*s, h] (half an all-reduce): forward 2 all-gathers (before QKV
# and gate/up) and 2 reduce-scatters (after the output and down projections); backward their
# transposes (4); and what the policy does again. 'none' and 'dots' keep the norms' outputs split
# over tp (that is the memory saving), so the weight gradients of QKV and gate/up gather them again
# (+2, as Megatron-LM does); 'attn' and 'full' recompute the attention block's gather and scatter
# and the MLP's gather (+3), whose gathered values the weight gradients then use; 'stage' also the
# whole iteration's 4 (+7). Without SP: 2 * (4 + TP_ALL_REDUCES_RECOMPUTED) halves.
TP_SP_HALVES = {'none': 10, 'dots': 10, 'attn': 11, 'full': 11, 'stage': 15}


def tp_halves_per_layer(policy: str, sequence_parallel: bool) -> int:
  """A layer's tp traffic per micro-batch in units of (t-1)/t * b*s*h bytes (an all-reduce is 2)."""
  return TP_SP_HALVES[policy] if sequence_parallel else 2 * (4 + TP_ALL_REDUCES_RECOMPUTED[policy])


def pipeline_edge_bytes(
  pp: int, microbatch_rows: int, seq_len: int, d_model: int, sp_tp: int = 1, scatter: bool = True
) -> float:
  """Wire bytes per device of entering and leaving the pipeline loop, per optimizer step and
  accumulation chunk: the m micro-batches on one dp shard (fp32 at the boundary, X = rows*s*h*4)
  with their rows split over (dp, pp), or the micro-batches over pp, take an all-gather in and a
  reduce-scatter out, each transposed in the backward pass (4 of (p-1)/p X); otherwise an all-reduce
  out over pp and, backward, the all-reduce of the input's gradient (2 of 2(p-1)/p X). The same bytes
  either way, except under sequence parallelism over `sp_tp` without the split rows (`scatter`
  False): the input's gradient is summed over pp while its rows are still split over tp (1/tp of
  it)."""
  x = microbatch_rows * seq_len * d_model * 4
  if pp == 1:
    return 0.0
  return 2 * (pp - 1) / pp * x * (1 + 1 / sp_tp) if not scatter else 4 * (pp - 1) / pp * x
