"""The decoder layer and its pieces: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

The layer speaks logical axes only (see jax3d/parallel/sharding.py); tensor parallelism is the
Megatron layout expressed as annotations: Q/K/V and gate/up are column-parallel (heads, mlp on tp),
the output and down projections row-parallel, so XLA inserts exactly one all-reduce after attention
and one after the MLP. Under sequence parallelism the projections' collectives are written out in
jax3d/parallel/tensor.py (`SequenceParallelDense`).

Shape legend: b batch, t time, r rows (b*t), d model, f ffw, n query heads, k kv heads,
h head dim, g query heads per kv head, c g+2 (queries, key, value), s cache positions.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jax3d.model import attention, fp8, lora, moe, rope as rope_lib
from jax3d.model.dims import Dims
from jax3d.parallel import context, tensor
from jax3d.parallel.sharding import constrain

KVCache = tuple[jax.Array, jax.Array]  # one layer's (keys [b, s, k, h], values [b, s, k, h])


def normal_init(names: tuple[str, ...], stddev: float) -> Any:
  """A normal(stddev) initializer whose parameter carries the logical axis `names`."""
  return nn.with_logical_partitioning(nn.initializers.normal(stddev), names)


class RMSNorm(nn.Module):
  """RMSNorm over the last axis (the model's, or one head's with axis name 'head_dim')."""

  dims: Dims
  axis_name: str = 'norm'

  @nn.compact
  def __call__(self, x):
    scale = self.param(
      'scale',
      nn.with_logical_partitioning(nn.initializers.ones, (self.axis_name,)),
      (x.shape[-1],),
      self.dims.param_dtype,
    )
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.dims.norm_eps)
    return (y * scale.astype(jnp.float32)).astype(self.dims.dtype)


def write_cache(cache: KVCache, k_btkh: jax.Array, v_btkh: jax.Array, positions_t: jax.Array) -> KVCache:
  """The KV cache with the new keys and values written at `positions_t` (consecutive)."""
  return tuple(
    jax.lax.dynamic_update_slice_in_dim(c_bskh, new_btkh.astype(c_bskh.dtype), positions_t[0], axis=1)
    for c_bskh, new_btkh in zip(cache, (k_btkh, v_btkh), strict=True)
  )


def cached_attention(
  q_btnh: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array, positions_t: jax.Array
) -> jax.Array:
  """Causal attention, in fp32, of queries at `positions_t` over a KV cache of s entries: the query
  at position p sees entries 0..p, so entries past the last query (not yet written) are ignored."""
  b, t, n, h = q_btnh.shape
  k = k_bskh.shape[2]
  q_btkgh = q_btnh.reshape(b, t, k, n // k, h)  # query head i belongs to KV head i // g
  s_bkgts = jnp.einsum(
    'btkgh,bskh->bkgts', q_btkgh.astype(jnp.float32), k_bskh.astype(jnp.float32)
  ) / np.sqrt(h)
  mask_ts = jnp.arange(k_bskh.shape[1])[None, :] <= positions_t[:, None]
  s_bkgts = jnp.where(mask_ts[None, None, None], s_bkgts, -1e30)
  o_btkgh = jnp.einsum('bkgts,bskh->btkgh', jax.nn.softmax(s_bkgts, axis=-1), v_bskh.astype(jnp.float32))
  return o_btkgh.reshape(b, t, n, h).astype(q_btnh.dtype)


def _gate_up_f32(gu_r2f: jax.Array) -> tuple[jax.Array, jax.Array]:
  return gu_r2f[:, 0].astype(jnp.float32), gu_r2f[:, 1].astype(jnp.float32)


@jax.custom_vjp
def swiglu(gu_r2f: jax.Array) -> jax.Array:
  """silu(gate) * up of the fused gate/up projection's output [r, 2, f], in fp32 (returned fp32).

  fp32, rounded once by the caller: XLA:CPU rounds every bf16 elementwise op back to bf16 (silu's
  negate, exp, add, divide and the product, and their derivatives), which costs time and the
  accuracy of five roundings. The gradient is written out so that it leaves as one
  [r, 2, f] array: autodiff's transpose of the two slices is two zero-padded copies of the whole
  array and their sum, and it keeps silu's fp32 intermediates as residuals; this keeps only gu."""
  g_rf, u_rf = _gate_up_f32(gu_r2f)
  return nn.silu(g_rf) * u_rf


def _swiglu_fwd(gu_r2f: jax.Array) -> tuple[jax.Array, jax.Array]:
  return swiglu(gu_r2f), gu_r2f


def _swiglu_bwd(gu_r2f: jax.Array, dh_rf: jax.Array) -> tuple[jax.Array]:
  g_rf, u_rf = _gate_up_f32(gu_r2f)
  sig_rf = jax.nn.sigmoid(g_rf)
  dh_rf = dh_rf.astype(jnp.float32)
  dg_rf = dh_rf * u_rf * (sig_rf + g_rf * sig_rf * (1 - sig_rf))  # silu'(g) = s + g s (1 - s)
  du_rf = dh_rf * g_rf * sig_rf
  return (jnp.stack([dg_rf, du_rf], axis=1).astype(gu_r2f.dtype),)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


class SequenceParallelDense(nn.Module):
  """The projection `nn.DenseGeneral(features, axis)` of the same name (and kernel) under sequence
  parallelism: its kernel here, its collectives in jax3d/parallel/tensor.py (a column-parallel
  projection gathers its input's rows, a row-parallel one reduce-scatters its partial sums over
  them). Apply only: parameters are created by the plain Block."""

  features: int | tuple[int, ...]
  axis: int | tuple[int, ...]
  names: tuple[str, ...]
  dtype: Any
  param_dtype: Any
  use_bias: bool = False

  @nn.compact
  def __call__(self, x):
    feat = self.features if isinstance(self.features, tuple) else (self.features,)
    axes = tuple(a % x.ndim for a in (self.axis if isinstance(self.axis, tuple) else (self.axis,)))
    kernel = self.param(
      'kernel', nn.initializers.zeros_init(), tuple(x.shape[a] for a in axes) + feat, self.param_dtype
    )
    y = tensor.sequence_parallel_dense(x, kernel, axes, self.names, self.dtype)
    if not self.use_bias:
      return y
    bias = self.param('bias', nn.initializers.zeros_init(), feat, self.param_dtype)
    return y + bias.astype(self.dtype)


class Block(nn.Module):
  """One decoder layer. Called on a micro-batch inside a pipeline stage (batch -> dp).

  The projections work on the rows r = b*t flattened: XLA:CPU's weight-gradient matmuls are about
  twice as fast on 2-D operands as on [b, t, ...] ones (it transposes the 3-D operand first), except
  the attention output's (below).
  Q, K and V are one matmul, laid out by KV head [d, k, g+2, h] (g = n/k query heads per KV head,
  then K, then V), and gate and up are one matmul [d, 2, f]: with tp splitting k (and f), each
  pair's backward pass sums its input gradient over tp once, not once per projection.

  Training calls it on x [b, t, d] alone: positions 0..t-1, causal attention, returns x; or with
  rows of documents, `positions_t` [b, t] (0 at each document's first token) and `segment_ids`
  [b, t] (1, 2, ... per document, 0 on the padding): a query attends to the keys of its own
  segment at or before it (jax3d/model/attention.py). Decoding
  passes `positions_t` (int [t], consecutive) and `cache` = (k_bskh, v_bskh), the layer's keys
  and values of s >= positions_t[-1] + 1 positions: the new K/V are written at positions_t, the
  queries attend over cache entries [0, positions_t[-1] + 1), and it returns (x, new cache).

  Sequence parallelism (`seq_len` set): training on the flattened rows x_rd [b*t, d], in and out,
  the residual stream (input, RMSNorms, residual adds) annotated 'rows_sp' (split over tp), so the
  row-parallel sums become reduce-scatters and all-gathers feed the column-parallel matmuls.
  """

  dims: Dims
  seq_len: int | None = None  # sequence parallelism: x is [b*t, d] rows of sequences of seq_len
  stats_row: bool = False  # MoE training: x ends in the router statistics' rows (moe.join_stats)

  @nn.compact
  def __call__(self, x_btd, positions_t=None, cache=None, segment_ids=None, noise=None):
    if self.stats_row:
      x_btd, acc_bnd = moe.split_stats(x_btd)
    sp = self.seq_len is not None
    b, t, d = (x_btd.shape[0] // self.seq_len, self.seq_len, x_btd.shape[1]) if sp else x_btd.shape
    x_rd = constrain(x_btd.reshape(b * t, d) if sp else context.rows(x_btd), (self._rows, 'embed'))

    q_btnh, k_btkh, v_btkh = self._qkv(x_rd, b, t, positions_t, noise)
    if cache is None:
      o_btnh = attention.attend(
        q_btnh, k_btkh, v_btkh, segment_ids, self.dims.attention, self.dims.cp_strategy
      )
    else:
      positions_t = jnp.arange(t) if positions_t is None else positions_t
      cache = write_cache(cache, k_btkh, v_btkh, positions_t)
      o_btnh = cached_attention(q_btnh, *cache, positions_t)
    x_rd = x_rd + self._attention_out(o_btnh, b * t, d, noise)
    if self.dims.n_experts:
      y_rd, stats_bns = self._moe(x_rd, b, t, d)
      x_rd = x_rd + y_rd
    else:
      x_rd = x_rd + self._mlp(x_rd, d, noise)
    if sp:
      return x_rd
    x_btd = context.unrows(x_rd, b, t)
    if self.stats_row:  # this layer's statistics added into the rows the layers carry (one per cp rank)
      pad = jnp.pad(stats_bns, ((0, 0), (0, 0), (0, d - stats_bns.shape[-1])))
      acc_bnd = (acc_bnd.astype(jnp.float32) + pad).astype(acc_bnd.dtype)
      return moe.join_stats(x_btd, acc_bnd)
    return x_btd if cache is None else (x_btd, cache)

  def _moe(self, x_rd: jax.Array, b: int, t: int, d: int) -> tuple[jax.Array, jax.Array]:
    """The mixture-of-experts MLP (jax3d/model/moe.py) on the normed stream: (y rows, stats [b, n, S])."""
    m_rd = RMSNorm(self.dims, name='mlp_norm')(x_rd)
    y_btd, stats_bns = moe.MoeMlp(self.dims, name='moe')(context.unrows(m_rd, b, t))
    return constrain(context.rows(y_btd), (self._rows, 'embed')), stats_bns

  @property
  def _rows(self) -> str:
    """The logical name of the residual stream's rows: split over tp too under sequence parallelism."""
    return 'rows_sp' if self.seq_len is not None else 'rows'

  def _stream(self, a_rd: jax.Array) -> jax.Array:
    """The residual stream's annotation under sequence parallelism (rows split over tp)."""
    return constrain(a_rd, (self._rows, 'embed')) if self.seq_len is not None else a_rd

  def _dense(
    self, feat: Any, axis: Any, names: tuple[str, ...], stddev: float, name: str, bias: bool = False
  ) -> nn.Module:
    """The projection `name`: nn.DenseGeneral, or its sequence-parallel form (the same kernel and
    bias); a bias carries the output features' logical axes. With train.matmul_dtype=fp8 its
    matmul is fp8.dot_general (the one place every projection's dot is chosen; config rules keep
    sequence parallelism off beside it)."""
    dm = self.dims
    dot = fp8.dot_general if dm.fp8 else None
    if self.seq_len is not None:
      return SequenceParallelDense(feat, axis, names, dm.dtype, dm.param_dtype, bias, name=name)
    n_out = len(feat) if isinstance(feat, tuple) else 1
    return nn.DenseGeneral(
      feat,
      axis=axis,
      use_bias=bias,
      dtype=dm.dtype,
      param_dtype=dm.param_dtype,
      kernel_init=normal_init(names, stddev),
      bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), names[-n_out:]),
      dot_general=dot,
      name=name,
    )

  def _qkv(
    self, x_rd: jax.Array, b: int, t: int, positions_t: jax.Array | None, noise: lora.Noise | None
  ) -> tuple[jax.Array, ...]:
    """Attention's column-parallel QKV projection (KV heads on tp; with model.qkv_bias its bias
    too), the per-head q/k norms of model.qk_norm (head size whole on every shard), rotated."""
    dm = self.dims
    n, k, h = dm.n_heads, dm.n_kv_heads, dm.head_dim
    g = n // k
    a_rd = self._stream(RMSNorm(dm, name='attn_norm')(x_rd))
    names = ('embed', 'kv_heads', 'qkv', 'head_dim')
    qkv_rkch = self._dense((k, g + 2, h), -1, names, 0.02, 'qkv', bias=dm.qkv_bias)(a_rd)
    qkv_rkch = constrain(qkv_rkch, ('rows', 'kv_heads', 'qkv', 'head_dim'))
    col = (('embed',), 'rows')
    q_rkgh = self._adapt('q', a_rd, qkv_rkch[:, :, :g], *col, ('kv_heads', 'qkv', 'head_dim'), noise)
    k_rkh = self._adapt('k', a_rd, qkv_rkch[:, :, g], *col, ('kv_heads', 'head_dim'), noise)
    v_rkh = self._adapt('v', a_rd, qkv_rkch[:, :, g + 1], *col, ('kv_heads', 'head_dim'), noise)
    q_btnh = context.unrows(q_rkgh, b, t).reshape(b, t, n, h)  # query head i belongs to KV head i // g
    k_btkh = context.unrows(k_rkh, b, t)
    v_btkh = context.unrows(v_rkh, b, t)
    if dm.qk_norm:
      q_btnh = RMSNorm(dm, 'head_dim', name='q_norm')(q_btnh)
      k_btkh = RMSNorm(dm, 'head_dim', name='k_norm')(k_btkh)
    freq = rope_lib.inv_freq(h, dm.rope_theta, dm.rope_scaling)
    q_btnh = constrain(rope_lib.rope(q_btnh, freq, positions_t), ('batch', 'seq', 'heads', 'head_dim'))
    k_btkh = constrain(rope_lib.rope(k_btkh, freq, positions_t), ('batch', 'seq', 'kv_heads', 'head_dim'))
    return q_btnh, k_btkh, constrain(v_btkh, ('batch', 'seq', 'kv_heads', 'head_dim'))

  def _attention_out(self, o_btnh: jax.Array, r: int, d: int, noise: lora.Noise | None) -> jax.Array:
    """Attention's row-parallel output projection (one all-reduce), annotated as the stream."""
    sp = self.seq_len is not None
    n, h = self.dims.n_heads, self.dims.head_dim
    # Outside SP the output projection reads o as [b, t, n, h], not as rows: its weight gradient
    # then contracts two dims, and XLA:CPU transposes o for a YNNPACK matmul where from rows it
    # keeps a transposed-operand dot and runs it in Eigen, slower.
    o_names = ('batch', 'heads', 'head_dim') if sp else ('batch', 'seq', 'heads', 'head_dim')
    o = checkpoint_name(constrain(o_btnh.reshape(r, n, h) if sp else o_btnh, o_names), 'attn_out')
    o_rd = self._dense(d, (-2, -1), ('heads', 'head_dim', 'embed'), self._out_std, 'o')(o)
    o_rd = self._adapt('o', o, o_rd, ('heads', 'head_dim'), self._rows, ('embed',), noise)  # o's own order
    return constrain(o_rd if sp else context.rows(o_rd), (self._rows, 'embed'))

  def _mlp(self, x_rd: jax.Array, d: int, noise: lora.Noise | None) -> jax.Array:
    """The SwiGLU MLP: column-parallel gate/up (mlp on tp), row-parallel down (one all-reduce)."""
    dm = self.dims
    m_rd = self._stream(RMSNorm(dm, name='mlp_norm')(x_rd))
    gu_r2f = constrain(
      self._dense((2, dm.d_ff), -1, ('embed', 'gate_up', 'mlp'), 0.02, 'gate_up')(m_rd),
      ('rows', 'gate_up', 'mlp'),
    )
    if dm.adapted('gate') or dm.adapted('up'):
      g_rf, u_rf = (
        self._adapt(x, m_rd, gu_r2f[:, i], ('embed',), 'rows', ('mlp',), noise)
        for i, x in enumerate(('gate', 'up'))
      )
      gu_r2f = jnp.stack([g_rf, u_rf], axis=1)
    h_rf = constrain(swiglu(gu_r2f).astype(dm.dtype), ('rows', 'mlp'))
    y_rd = self._dense(d, -1, ('mlp', 'embed'), self._out_std, 'down')(h_rf)
    y_rd = self._adapt('down', h_rf, y_rd, ('mlp',), self._rows, ('embed',), noise)
    return constrain(checkpoint_name(y_rd, 'mlp_out'), (self._rows, 'embed'))

  def _adapt(
    self,
    target: str,
    x: jax.Array,
    y: jax.Array,
    in_names: tuple[str, ...],
    xa_rows: str,
    out_names: tuple[str, ...],
    noise: lora.Noise | None = None,
  ) -> jax.Array:
    """`y`, the output of projection `target` of `x`, plus its LoRA adapter's (jax3d/model/lora.py)
    when it has one: x's last len(in_names) axes in, y's last len(out_names) out; `xa_rows` the
    logical name of the low-rank activation's rows (see lora.Adapter); `noise`: a training step's
    dropout words and layer salt (lora.Adapter), or none."""
    dm = self.dims
    if not dm.adapted(target):
      return y
    n_in, n_out = len(in_names), len(out_names)
    if noise is not None and x.ndim - n_in == 1:  # x is the layer's rows: its words in their order
      noise = (context.rows(noise[0]), noise[1])
    adapter = lora.Adapter(
      x.shape[-n_in:],
      y.shape[-n_out:],
      in_names,
      out_names,
      dm.lora_rank,
      dm.lora_scale,
      dm.dtype,
      dm.lora_dtype,
      dm.lora_dropout,
      name=lora.PREFIX + target,
    )
    return y + adapter(x, (xa_rows, 'lora'), noise).reshape(y.shape).astype(y.dtype)

  @property
  def _out_std(self) -> float:
    """The row-parallel projections' initial stddev, scaled down with depth."""
    return 0.02 / np.sqrt(2 * self.dims.n_layers)
