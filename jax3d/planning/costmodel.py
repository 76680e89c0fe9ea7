"""Memory and step-time estimates of one layout, from the published formulas (Megatron-LM;
Korthikanti et al. for activations).

The estimate models what jax3d's step really does, so that it can be checked against XLA's own
figure (`python -m jax3d.plan --verify`) and printed by the trainer before the first step:
  - parameters, gradients and AdamW's m and v in `train.param_dtype`; layer weights split over
    pp (the stacked layer axis) and tp; embedding and head over tp only (replicated over dp, pp);
    the vocabulary padded to `model.vocab_multiple`; Adam moments over dp too with
    `train.shard_optimizer` (ZeRO-1).
  - gradients held twice for the stage's layers (three times with `grad_accum > 1`: the
    accumulator): the pipeline loop's carry, and each iteration's fresh gradient of the
    loop-invariant stage weights (JAX's transpose of a scan's constant operand) added into it.
    Checked against XLA's figure (`plan --verify`) at pp 1 and 2, with and without accumulation.
  - activations of the SPMD GPipe pipeline (jax3d/parallel/pipeline.py): its scan keeps the
    residuals of every one of its v*m+p-1 iterations (bubble iterations included) for the backward
    pass. What one layer keeps is read off the real layer (`jax.ad_checkpoint` residuals of
    `jax3d.model.llama.Block` at the tp-local shapes, under the remat policy), so it follows the
    code, GQA and SwiGLU included; it agrees with Korthikanti's s*b*h*(10 + 24/t + 5*a*s/(h*t))
    where the layer is Megatron's. With remat 'stage' it counts m+1 micro-batches per iteration (its
    input and, with pp > 1, a stage-0 queue of m): an upper bound, since the compiled loop saves the
    iteration's input only (the queue, where v > 1, is a carry updated in place).
  - step time: compute at `efficiency` of peak, tp/pp/dp traffic over the links each axis is
    placed on (jax3d/parallel/mesh.py: tp inside a node, then pp, dp outermost), the dp all-reduce
    partly hidden behind the backward pass, and the bubble as wasted compute:
    executed/useful = (v*m+p-1)/(v*m).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING

import numpy as np

from jax3d.config import RunPlan
from jax3d.model import formulas

if TYPE_CHECKING:
  import ml_collections

  from jax3d.model.llama import Dims

GB = 1e9
BYTES = {'float32': 4, 'bfloat16': 2, 'int8': 1}


@dataclasses.dataclass(frozen=True)
class Hardware:
  """One cluster. Defaults: an H100/H200 SXM node (dense bf16 peak, NVLink 4, 400 Gb/s NIC per GPU)."""

  nodes: int = 1
  gpus_per_node: int = 8
  memory_gb: float = 80.0
  peak_tflops: float = 989.0  # dense bf16 per GPU; float32 compute runs at half (TF32)
  efficiency: float = 0.55  # achievable share of peak for the model's matmuls
  intra_gbps: float = 450.0  # GB/s per GPU per direction inside a node (NVLink)
  inter_gbps: float = 50.0  # GB/s per GPU across nodes (400 Gb/s InfiniBand)
  overlap: float = 0.5  # share of the backward pass the dp gradient all-reduce can hide behind
  flash_attention: bool = True  # cuDNN fused attention (bf16 on GPU) keeps no s x s scores

  @property
  def n_devices(self) -> int:
    return self.nodes * self.gpus_per_node


@dataclasses.dataclass
class Estimate:
  """Bytes per device (`breakdown`, `total_bytes`) and seconds per step (`times`) of one layout."""

  breakdown: dict
  times: dict
  plan: RunPlan
  remat: str
  shard_optimizer: bool
  model_flops_per_token: float
  device_memory_bytes: float | None = None

  @property
  def total_bytes(self) -> float:
    return sum(self.breakdown.values())

  @property
  def step_time_s(self) -> float:
    return self.times['step']

  @property
  def tokens_per_s(self) -> float:
    return self.plan.tokens_per_step / self.step_time_s

  @property
  def mfu(self) -> float:
    """The trainer's MFU (formulas.mfu, the same FLOPs per token) at the estimated tokens/s."""
    return formulas.mfu(
      self.tokens_per_s, self.model_flops_per_token, self.times['peak'], self.plan.n_devices
    )

  @property
  def fits(self) -> bool:
    return self.device_memory_bytes is None or self.total_bytes <= self.device_memory_bytes

  @property
  def reason(self) -> str:
    if self.fits:
      return ''
    return f'needs {self.total_bytes / GB:.1f} GB per GPU, has {self.device_memory_bytes / GB:.4g}'

  def describe(self) -> str:
    parts = ', '.join(f'{k} {v / GB:.2f}' for k, v in self.breakdown.items())
    return (
      f'estimated {self.total_bytes / GB:.2f} GB per device ({parts}); step '
      f'{self.step_time_s:.3g} s, bubble {self.plan.bubble:.0%}, MFU {self.mfu:.0%}'
    )


# ---------------------------------------------------------------------------------------------
# What one layer keeps for the backward pass, read off the real layer.
# ---------------------------------------------------------------------------------------------
def layer_residual_bytes(
  d_model: int,
  n_heads: int,
  n_kv_heads: int,
  d_ff: int,
  seq: int,
  tp: int,
  policy: str,
  compute: str,
  param: str,
  flash: bool,
  batch: int,
  sequence_parallel: bool = False,
) -> float:
  """Bytes one tp shard of one layer keeps for its backward pass, its input included. Its weights
  count only under remat 'none': under a checkpoint they are sliced again from the loop-invariant
  stack in the backward pass (jax3d/parallel/ring.py `run_layers`); without one, XLA keeps
  the per-iteration weight values the layer computes from them (reshapes, casts). Linear in the
  rows: traced at 1 and 2 rows.

  With `sequence_parallel` the residual stream (what is [rows, d_model]: the input, the RMSNorm
  outputs, the residual adds, the row-parallel outputs) is split over tp. Read off the same layer:
  of the bytes per row, the stream's are the ones that grow with d_model (the tp shard's heads,
  head size and d_ff held fixed), so a trace at twice d_model measures them."""
  trace = lambda b, d: _traced_residuals(
    d, n_heads, n_kv_heads, d_ff, seq, tp, policy, compute, param, flash, b, d_model // n_heads
  )
  one, two = trace(1, d_model), trace(2, d_model)
  total = one + (batch - 1) * (two - one)
  if not sequence_parallel or tp == 1:
    return total
  stream_per_row = (trace(2, 2 * d_model) - trace(1, 2 * d_model)) - (two - one)
  return total - batch * stream_per_row * (1 - 1 / tp)


@functools.cache
def _traced_residuals(
  d_model, n_heads, n_kv_heads, d_ff, seq, tp, policy, compute, param, flash, batch, head_dim
) -> float:
  """The residuals of the real layer at abstract shapes (nothing is computed or allocated).
  XLA's attention keeps the s x s scores; a fused (flash) kernel keeps a logsumexp instead."""
  import flax.linen as nn
  import jax

  from jax3d.model import llama as model_lib
  from jax3d.parallel import remat

  @dataclasses.dataclass(frozen=True)
  class ShardDims(model_lib.Dims):  # one tp shard: n/tp heads of the full head size
    local_head_dim: int = 0

    @property
    def head_dim(self) -> int:
      return self.local_head_dim

  dims = ShardDims(
    n_layers=1,
    d_model=d_model,
    n_heads=n_heads // tp,
    n_kv_heads=n_kv_heads // tp,
    d_ff=d_ff // tp,
    vocab_size=1,
    vocab_padded=1,
    dtype=np.dtype(compute),
    param_dtype=np.dtype(param),
    local_head_dim=head_dim,
  )
  x = jax.ShapeDtypeStruct((batch, seq, d_model), dims.dtype)
  block = model_lib.Block(dims)
  params = jax.eval_shape(lambda x: nn.unbox(block.init(jax.random.key(0), x)['params']), x)
  fn = remat.wrap_layer(lambda h, p: (block.apply({'params': p}, h), None), policy)
  res = _saved_residuals(lambda p, h: fn(h, p)[0].astype(np.float32).sum(), params, x, policy != 'none')
  scores = lambda a: len(a.shape) >= 2 and a.shape[-2:] == (seq, seq)
  kept = [a for a in res if not (flash and scores(a))]
  lse = batch * (n_heads // tp) * seq * 4 if flash else 0
  return float(sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in kept) + lse)


def _saved_residuals(f, p, h, drop_weights: bool) -> list:
  """The abstract values (shape, dtype) that reverse-mode differentiation of `f(p, h)` keeps
  (less the weights `p` themselves when `drop_weights`).

  jax's public API only prints this list (`jax.ad_checkpoint.print_saved_residuals`, as text);
  the function that returns it lives in jax's private modules, so this is the one place that
  imports it.
  """
  from jax._src.ad_checkpoint import saved_residuals

  res = saved_residuals(f, p, h)
  return [aval for aval, src in res if not (drop_weights and src.startswith('from the argument p['))]


# ---------------------------------------------------------------------------------------------
# The estimate
# ---------------------------------------------------------------------------------------------
def _dims(cfg: ml_collections.ConfigDict, plan: RunPlan | None = None) -> Dims:
  from jax3d.model import llama as model_lib  # imported when needed: flax and jax are heavy

  return model_lib.Dims.from_config(cfg, plan)


def local_params(cfg: ml_collections.ConfigDict, plan: RunPlan) -> dict:
  """Parameters held by one device: layer matrices over pp*tp, norms over pp, embed/head over tp."""
  dims = _dims(cfg, plan)
  return {
    'layers': dims.n_layers // plan.pp * formulas.layer_params(dims, plan.tp),
    'embed_head': formulas.embed_head_params(dims, plan.tp, padded=True),
  }


def estimate(
  cfg: ml_collections.ConfigDict,
  plan: RunPlan,
  gpu_memory_bytes: float | None = None,
  hw: Hardware | None = None,
) -> Estimate:
  """Memory per device and step time of `cfg` on the layout `plan` (see the module docstring).

  Without `hw` (the trainer's call) the devices are the ones jax sees: fused attention where
  train.attention picks cuDNN (explicitly, or 'auto' with bf16 on a GPU).
  """
  if hw is None:
    import jax

    flash = cfg.train.attention == 'cudnn' or (
      cfg.train.attention == 'auto'
      and jax.default_backend() == 'gpu'
      and cfg.train.compute_dtype == 'bfloat16'
    )
    hw = Hardware(flash_attention=flash)
  m, t = cfg.model, cfg.train
  pb, cb = BYTES[t.param_dtype], BYTES[t.compute_dtype]
  dp, pp, tp, mb, v = plan.dp, plan.pp, plan.tp, plan.microbatches, plan.repeats
  s, h = plan.seq_len, m.d_model
  local = local_params(cfg, plan)
  n_local = sum(local.values())

  # --- memory -------------------------------------------------------------------------------
  b = plan.micro_batch // dp  # rows of one micro-batch on one device
  lc = m.n_layers // (pp * v)  # layers per chunk: what one pipeline iteration runs
  res = functools.partial(
    layer_residual_bytes,
    h,
    m.n_heads,
    m.n_kv_heads,
    m.d_ff,
    s,
    tp,
    compute=t.compute_dtype,
    param=t.param_dtype,
    flash=hw.flash_attention,
    batch=b,
    sequence_parallel=plan.sequence_parallel,
  )
  act_mb = b * s * h * cb  # one micro-batch's activation [b, s, h]
  sp = tp if plan.sequence_parallel else 1  # the loop's micro-batches are split over tp with SP
  if t.remat == 'stage':  # per iteration its carry (input and, with pp > 1, the stage-0 queue of m
    # micro-batches), plus one iteration recomputed in the backward pass
    carry = mb + 1 if pp > 1 else 1
    acts = plan.iterations * carry * act_mb / sp + lc * res(policy='full') + res(policy='none')
  else:
    acts = plan.iterations * lc * res(policy=t.remat) + res(policy='none')
  rows_all = plan.chunk_batch // (dp * pp if plan.chunk_batch % (dp * pp) == 0 else dp)
  # fp32 logits of the head, their exp and the one-hot targets (vocab on tp), and the embedding out.
  head = rows_all * s * (3 * 4 * plan.vocab_padded // tp + 2 * h * cb)
  # + the accumulator of gradient accumulation, and the pipeline loop's own: each iteration's
  # gradient of the stage's weights (JAX's transpose of the loop-invariant operand) is a fresh
  # buffer added into the loop's carry, so the stage's weight gradients are held twice.
  grads = n_local * pb * (2 if plan.grad_accum > 1 else 1) + local['layers'] * pb
  breakdown = {
    'params': n_local * pb,
    'grads': grads,
    'optimizer': 2 * n_local * pb / (dp if t.shard_optimizer else 1),
    'activations': acts,
    'head': head,
  }

  # --- time ---------------------------------------------------------------------------------
  dims = _dims(cfg, plan)
  dims_p = formulas.param_count(dims)
  p_layers = m.n_layers * formulas.layer_params(dims)
  attn = formulas.attention_flops_per_token(dims, s)
  # Recomputed forward work per token: 'full' reruns each layer once; 'stage' each iteration and,
  # inside it, each layer (both are checkpointed: 2 extra forwards); 'dots' the attention core;
  # 'attn' the matmuls.
  fwd = 2 * p_layers + attn / 3
  extra = {'none': 0, 'dots': attn / 3, 'attn': 2 * p_layers, 'full': fwd, 'stage': 2 * fwd}
  layer_flops = 6 * p_layers + attn + extra[t.remat]
  waste = plan.iterations / (v * mb)  # (v*m+p-1)/(v*m): bubble iterations compute too
  peak = hw.peak_tflops * 1e12 * (1.0 if t.compute_dtype == 'bfloat16' else 0.5)
  tokens = plan.tokens_per_step
  compute = tokens * (layer_flops * waste + 6 * (dims_p - p_layers)) / plan.n_devices / (peak * hw.efficiency)

  per_host = hw.gpus_per_node
  tp_in = tp <= per_host
  pp_in = tp * pp <= per_host
  dp_in = tp * pp * dp <= per_host
  bw = lambda inside: (hw.intra_gbps if inside else hw.inter_gbps) * 1e9
  layer_calls = plan.iterations * lc * plan.grad_accum
  all_reduces = 4 + formulas.TP_ALL_REDUCES_RECOMPUTED[t.remat]  # per layer: 2 forward, 2 backward
  tp_bytes = layer_calls * all_reduces * 2 * (tp - 1) / tp * act_mb
  # The ring's ppermute is outside every checkpoint: one send forward, one backward.
  pp_bytes = plan.iterations * plan.grad_accum * 2 * act_mb / sp if pp > 1 else 0
  pp_bytes += (
    formulas.pipeline_edge_bytes(pp, mb * b, s, h, sp, plan.pp_batch_split is not None) * plan.grad_accum
  )
  dp_bytes = 2 * (dp - 1) / dp * n_local * BYTES[t.grad_reduce_dtype]
  t_dp = dp_bytes / bw(dp_in)
  times = {
    'compute': compute,
    'tp': tp_bytes / bw(tp_in),
    'pp': pp_bytes / bw(pp_in),
    'dp': t_dp,
    'dp_hidden': min(t_dp, hw.overlap * compute * 2 / 3),
    'peak': hw.peak_tflops * 1e12,
  }
  times['step'] = compute + times['tp'] + times['pp'] + t_dp - times['dp_hidden']
  return Estimate(
    breakdown=breakdown,
    times=times,
    plan=plan,
    remat=t.remat,
    shard_optimizer=bool(t.shard_optimizer),
    model_flops_per_token=formulas.flops_per_token(dims, s),
    device_memory_bytes=gpu_memory_bytes,
  )


def param_count(cfg: ml_collections.ConfigDict) -> int:
  """The real model's parameters (padded vocabulary rows excluded): formulas.param_count."""
  return formulas.param_count(_dims(cfg))
