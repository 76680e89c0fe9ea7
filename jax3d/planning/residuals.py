"""What one layer keeps for its backward pass, read off the real layer (`jax.ad_checkpoint`
residuals of `jax3d.model.layers.Block` at abstract, tp-local shapes): the memory model's
activations per layer (jax3d/planning/memory_model.py)."""

from __future__ import annotations

import functools
import math

import numpy as np


def kernel_of(flash: bool | str) -> str:
  """The attention kernel priced: its name ('xla', 'cudnn', 'blockwise'), or True (cuDNN's), False (XLA's)."""
  return flash if isinstance(flash, str) else ('cudnn' if flash else 'xla')


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
  flash: bool | str,
  batch: int,
  sequence_parallel: bool = False,
  features: tuple[int, bool, bool] = (0, False, False),
  moe: tuple[int, int, int, int, float] = (0, 0, 0, 0, 0.0),
) -> float:
  """Bytes one tp shard of one layer keeps for its backward pass, its input included (`features`:
  model.head_dim, 0 = d_model / n_heads, model.qkv_bias, model.qk_norm; `moe`: a mixture of
  experts' moe.num_experts (0: a dense MLP of d_ff), top_k, one expert's hidden size, the shared
  expert's and capacity_factor, whose block jax3d/model/moe.py is then the layer's MLP, traced as
  it is). Its weights
  count only under remat 'none': under a checkpoint they are sliced again from the loop-invariant
  stack in the backward pass (jax3d/parallel/pipeline/chunk.py `run_layers`); without one, XLA keeps
  the per-iteration weight values the layer computes from them (reshapes, casts). Linear in the
  rows: traced at 1 and 2 rows.

  With `sequence_parallel` the residual stream (what is [rows, d_model]: the input, the RMSNorm
  outputs, the residual adds, the row-parallel outputs) is split over tp. Read off the same layer:
  of the bytes per row, the stream's are the ones that grow with d_model (the tp shard's heads,
  head size and d_ff held fixed), so a trace at twice d_model measures them."""
  head_dim, qkv_bias, qk_norm = features
  trace = lambda b, d: _traced_residuals(
    d,
    n_heads,
    n_kv_heads,
    d_ff,
    seq,
    tp,
    policy,
    compute,
    param,
    kernel_of(flash),
    b,
    (head_dim or d_model // n_heads, qkv_bias, qk_norm),
    moe,
  )
  one, two = trace(1, d_model), trace(2, d_model)
  total = one + (batch - 1) * (two - one)
  if not sequence_parallel or tp == 1:
    return total
  stream_per_row = (trace(2, 2 * d_model) - trace(1, 2 * d_model)) - (two - one)
  return total - batch * stream_per_row * (1 - 1 / tp)


@functools.cache
def _traced_residuals(
  d_model, n_heads, n_kv_heads, d_ff, seq, tp, policy, compute, param, kernel, batch, features, moe
) -> float:
  """The residuals of the real layer at abstract shapes (nothing is computed or allocated). XLA's
  attention keeps the s x s scores; blockwise is traced as it is (q, k, v, out, a logsumexp);
  cuDNN's is XLA's trace less the scores, plus a logsumexp and the documents' bias."""
  import flax.linen as nn
  import jax

  from jax3d.model import dims as dims_lib, layers
  from jax3d.parallel import remat

  head_dim, qkv_bias, qk_norm = features
  n_experts, top_k, d_expert, d_shared, capacity_factor = moe
  dims = dims_lib.Dims(  # one tp shard: n/tp heads of the full head size
    n_layers=1,
    d_model=d_model,
    n_heads=n_heads // tp,
    n_kv_heads=n_kv_heads // tp,
    d_ff=d_ff // tp,
    vocab_size=1,
    vocab_padded=1,
    dtype=np.dtype(compute),
    param_dtype=np.dtype(param),
    head_size=head_dim,
    qkv_bias=qkv_bias,
    qk_norm=qk_norm,
    attention='blockwise' if kernel == 'blockwise' else 'xla',
    # a mixture's experts whole (this device's rows dispatched to every expert: under ep the
    # all-to-all's [ep*b, E/ep, C, d] is as many bytes), their hidden sizes split over tp
    n_experts=n_experts,
    top_k=top_k,
    d_expert=d_expert // tp,
    d_shared=d_shared // tp,
    capacity_factor=capacity_factor,
  )
  flash = kernel == 'cudnn'
  x = jax.ShapeDtypeStruct((batch, seq, d_model), dims.dtype)
  block = layers.Block(dims)
  params = jax.eval_shape(lambda x: nn.unbox(block.init(jax.random.key(0), x)['params']), x)
  fn = remat.wrap_layer(lambda h, p: (block.apply({'params': p}, h), None), policy)
  res = _saved_residuals(lambda p, h: fn(h, p)[0].astype(np.float32).sum(), params, x, policy != 'none')
  # XLA's scores and masks are [b, heads or 1, (g,) s, s]; a [b, s, d] activation is not one, also
  # where d_model = seq (Llama 3 70B at 8K: 8192 both; counting it as a score dropped the layer's input)
  scores = lambda a: len(a.shape) >= 4 and a.shape[-2:] == (seq, seq)
  kept = [a for a in res if not (flash and scores(a))]
  lse = batch * (n_heads // tp) * seq * 4 if flash else 0
  # cuDNN's custom VJP keeps its inputs, the documents' bias [b, 1, s, s] among them (attention.py)
  bias = batch * seq * seq * np.dtype(compute).itemsize if flash and any(scores(a) for a in res) else 0
  return float(sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in kept) + lse + bias)


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
