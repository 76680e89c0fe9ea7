"""A Llama-style decoder in Flax: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

The model speaks logical axes only (see jax3d/parallel/sharding.py); tensor parallelism is the
Megatron layout expressed as annotations: Q/K/V and gate/up are column-parallel (heads, mlp on tp),
the output and down projections row-parallel, so XLA inserts exactly one all-reduce after attention
and one after the MLP. Embedding and head are vocabulary-parallel; the loss never gathers the
logits.

Layer weights are stacked on a leading `layers` axis, ready for `lax.scan` and pipeline stages.

Shape legend: b batch, t time, r rows (b*t), d model, f ffw, n query heads, k kv heads,
h head dim, g query heads per kv head, c g+2 (queries, key, value), v vocab.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jax3d import config as config_lib
from jax3d.model import formulas
from jax3d.parallel import tensor
from jax3d.parallel.sharding import constrain

PyTree = Any  # nested dicts of arrays (or of their abstract shapes)
KVCache = tuple[jax.Array, jax.Array]  # one layer's (keys [b, s, k, h], values [b, s, k, h])


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
  attention: str = 'auto'

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads

  @staticmethod
  def from_config(cfg: ml_collections.ConfigDict, plan: config_lib.RunPlan | None = None) -> Dims:
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
      param_dtype=jnp.dtype(cfg.train.param_dtype),
      attention=cfg.train.attention,
    )

  def param_count(self) -> int:
    """Parameters of the real model (padded vocabulary rows excluded): formulas.param_count."""
    return formulas.param_count(self)


def _init(names, stddev):
  return nn.with_logical_partitioning(nn.initializers.normal(stddev), names)


class RMSNorm(nn.Module):
  dims: Dims

  @nn.compact
  def __call__(self, x):
    scale = self.param(
      'scale',
      nn.with_logical_partitioning(nn.initializers.ones, ('norm',)),
      (x.shape[-1],),
      self.dims.param_dtype,
    )
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.dims.norm_eps)
    return (y * scale.astype(jnp.float32)).astype(self.dims.dtype)


def rope(x_btnh: jax.Array, theta: float, positions_t: jax.Array | None = None) -> jax.Array:
  """Rotary position embedding (half-split form), computed in fp32. `positions_t` (int, [t]) are
  the tokens' positions; None means 0..t-1 (then the angles are constants of the trace)."""
  t, h = x_btnh.shape[1], x_btnh.shape[-1]
  inv_freq = 1.0 / (theta ** (np.arange(0, h, 2, dtype=np.float32) / h))  # (h/2,)
  pos_t = np.arange(t, dtype=np.float32) if positions_t is None else positions_t.astype(jnp.float32)
  ang_th = pos_t[:, None] * inv_freq[None, :]  # (t, h/2)
  cos, sin = jnp.cos(ang_th)[None, :, None, :], jnp.sin(ang_th)[None, :, None, :]
  x1, x2 = jnp.split(x_btnh.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_btnh.dtype)


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

  @nn.compact
  def __call__(self, x):
    feat = self.features if isinstance(self.features, tuple) else (self.features,)
    axes = tuple(a % x.ndim for a in (self.axis if isinstance(self.axis, tuple) else (self.axis,)))
    kernel = self.param(
      'kernel', nn.initializers.zeros_init(), tuple(x.shape[a] for a in axes) + feat, self.param_dtype
    )
    return tensor.sequence_parallel_dense(x, kernel, axes, self.names, self.dtype)


class Block(nn.Module):
  """One decoder layer. Called on a micro-batch inside a pipeline stage (batch -> dp).

  The projections work on the rows r = b*t flattened: XLA:CPU's weight-gradient matmuls are about
  twice as fast on 2-D operands as on [b, t, ...] ones (it transposes the 3-D operand first), except
  the attention output's (below).
  Q, K and V are one matmul, laid out by KV head [d, k, g+2, h] (g = n/k query heads per KV head,
  then K, then V), and gate and up are one matmul [d, 2, f]: with tp splitting k (and f), each
  pair's backward pass sums its input gradient over tp once, not once per projection.

  Training calls it on x [b, t, d] alone: positions 0..t-1, causal attention, returns x. Decoding
  passes `positions_t` (int [t], consecutive) and `cache` = (k_bskh, v_bskh), the layer's keys
  and values of s >= positions_t[-1] + 1 positions: the new K/V are written at positions_t, the
  queries attend over cache entries [0, positions_t[-1] + 1), and it returns (x, new cache).

  Sequence parallelism (`seq_len` set): training on the flattened rows x_rd [b*t, d], in and out,
  the residual stream (input, RMSNorms, residual adds) annotated 'rows_sp' (split over tp), so the
  row-parallel sums become reduce-scatters and all-gathers feed the column-parallel matmuls.
  """

  dims: Dims
  seq_len: int | None = None  # sequence parallelism: x is [b*t, d] rows of sequences of seq_len

  @nn.compact
  def __call__(self, x_btd, positions_t=None, cache=None):
    dm = self.dims
    sp = self.seq_len is not None
    b, t, d = (x_btd.shape[0] // self.seq_len, self.seq_len, x_btd.shape[1]) if sp else x_btd.shape
    rows = 'rows_sp' if sp else 'batch'
    stream = (lambda a: constrain(a, (rows, 'embed'))) if sp else (lambda a: a)  # the SP residual stream
    n, k, h = dm.n_heads, dm.n_kv_heads, dm.head_dim
    g = n // k
    std, out_std = 0.02, 0.02 / np.sqrt(2 * dm.n_layers)
    dense = lambda feat, axis, names, s, name: (
      SequenceParallelDense(feat, axis, names, dm.dtype, dm.param_dtype, name=name)
      if sp
      else nn.DenseGeneral(
        feat,
        axis=axis,
        use_bias=False,
        dtype=dm.dtype,
        param_dtype=dm.param_dtype,
        kernel_init=_init(names, s),
        name=name,
      )
    )
    x_rd = constrain(x_btd.reshape(b * t, d), (rows, 'embed'))

    # Attention: column-parallel QKV (KV heads on tp), row-parallel output (one all-reduce).
    a_rd = stream(RMSNorm(dm, name='attn_norm')(x_rd))
    qkv_rkch = dense((k, g + 2, h), -1, ('embed', 'kv_heads', 'qkv', 'head_dim'), std, 'qkv')(a_rd)
    qkv_rkch = constrain(qkv_rkch, ('batch', 'kv_heads', 'qkv', 'head_dim'))
    q_btnh = qkv_rkch[:, :, :g].reshape(b, t, n, h)  # query head i belongs to KV head i // g
    k_btkh = qkv_rkch[:, :, g].reshape(b, t, k, h)
    v_btkh = qkv_rkch[:, :, g + 1].reshape(b, t, k, h)
    q_btnh = constrain(rope(q_btnh, dm.rope_theta, positions_t), ('batch', 'seq', 'heads', 'head_dim'))
    k_btkh = constrain(rope(k_btkh, dm.rope_theta, positions_t), ('batch', 'seq', 'kv_heads', 'head_dim'))
    v_btkh = constrain(v_btkh, ('batch', 'seq', 'kv_heads', 'head_dim'))
    if cache is None:
      impl = None if dm.attention == 'auto' else dm.attention
      o_btnh = jax.nn.dot_product_attention(q_btnh, k_btkh, v_btkh, is_causal=True, implementation=impl)
    else:
      positions_t = jnp.arange(t) if positions_t is None else positions_t
      cache = tuple(
        jax.lax.dynamic_update_slice_in_dim(c_bskh, new_btkh.astype(c_bskh.dtype), positions_t[0], axis=1)
        for c_bskh, new_btkh in zip(cache, (k_btkh, v_btkh), strict=True)
      )
      o_btnh = cached_attention(q_btnh, *cache, positions_t)
    # Outside SP the output projection reads o as [b, t, n, h], not as rows: its weight gradient
    # then contracts two dims, and XLA:CPU transposes o for a YNNPACK matmul where from rows it
    # keeps a transposed-operand dot and runs it in Eigen, slower.
    o_names = ('batch', 'heads', 'head_dim') if sp else ('batch', 'seq', 'heads', 'head_dim')
    o = checkpoint_name(constrain(o_btnh.reshape(b * t, n, h) if sp else o_btnh, o_names), 'attn_out')
    o_rd = dense(d, (-2, -1), ('heads', 'head_dim', 'embed'), out_std, 'o')(o).reshape(b * t, d)
    x_rd = x_rd + constrain(o_rd, (rows, 'embed'))

    # SwiGLU MLP: column-parallel gate/up (mlp on tp), row-parallel down (one all-reduce).
    m_rd = stream(RMSNorm(dm, name='mlp_norm')(x_rd))
    gu_r2f = constrain(
      dense((2, dm.d_ff), -1, ('embed', 'gate_up', 'mlp'), std, 'gate_up')(m_rd), ('batch', 'gate_up', 'mlp')
    )
    h_rf = constrain(swiglu(gu_r2f).astype(dm.dtype), ('batch', 'mlp'))
    y_rd = dense(d, -1, ('mlp', 'embed'), out_std, 'down')(h_rf)
    x_rd = x_rd + constrain(checkpoint_name(y_rd, 'mlp_out'), (rows, 'embed'))
    if sp:
      return x_rd
    return x_rd.reshape(b, t, d) if cache is None else (x_rd.reshape(b, t, d), cache)


class Embed(nn.Module):
  """Vocabulary-parallel token embedding (vocab rows on tp)."""

  dims: Dims

  @nn.compact
  def __call__(self, tokens_bt):
    table_vd = self.param(
      'embedding',
      _init(('vocab', 'embed'), 1.0),
      (self.dims.vocab_padded, self.dims.d_model),
      self.dims.param_dtype,
    )
    x_btd = jnp.take(table_vd, tokens_bt, axis=0).astype(self.dims.dtype)
    return constrain(x_btd, ('batch_all', 'seq', 'embed'))


class Head(nn.Module):
  """Final norm and vocabulary-parallel output projection; logits in fp32, vocab on tp."""

  dims: Dims

  @nn.compact
  def __call__(self, x_btd):
    dm = self.dims
    x_btd = RMSNorm(dm, name='norm')(constrain(x_btd, ('batch_all', 'seq', 'embed')))
    logits_btv = nn.DenseGeneral(
      dm.vocab_padded,
      use_bias=False,
      dtype=dm.dtype,
      param_dtype=dm.param_dtype,
      kernel_init=_init(('embed', 'vocab'), 1.0 / np.sqrt(dm.d_model)),
      name='out',
    )(x_btd)
    logits_btv = logits_btv.astype(jnp.float32)
    if dm.vocab_padded > dm.vocab_size:  # padded entries can never be predicted
      pad_v = jnp.arange(dm.vocab_padded) >= dm.vocab_size
      logits_btv = jnp.where(pad_v, -1e30, logits_btv)
    return constrain(logits_btv, ('batch_all', 'seq', 'vocab'))


def cross_entropy_sum(logits_btv: jax.Array, targets_bt: jax.Array) -> jax.Array:
  """Sum of token losses. Vocab-parallel: max, sum-exp and the target logit are reduced over the
  vocab shards (tp); the full-vocabulary logits are never gathered on one device."""
  lse_bt = jax.nn.logsumexp(logits_btv, axis=-1)
  onehot_btv = jax.nn.one_hot(targets_bt, logits_btv.shape[-1], dtype=logits_btv.dtype)
  target_bt = jnp.sum(logits_btv * onehot_btv, axis=-1)
  return jnp.sum(lse_bt - target_bt)


# ---------------------------------------------------------------------------------------------
# Parameters: init (with stacked layers) and their logical axes.
# ---------------------------------------------------------------------------------------------
def _unboxed_init(module, key, *args):
  return nn.unbox(module.init(key, *args)['params'])


def init_params(key: jax.Array, dims: Dims, layer_order: np.ndarray) -> PyTree:
  """All parameters. Layer j of the stack holds canonical layer `layer_order[j]`, whose values come
  from that layer's own key, so the values never depend on the layout (pipeline order, sharding)."""
  k_embed, k_layers, k_head = jax.random.split(key, 3)
  tok = jnp.zeros((1, 1), jnp.int32)
  x = jnp.zeros((1, 1, dims.d_model), dims.dtype)
  layer_keys = jax.random.split(k_layers, dims.n_layers)[jnp.asarray(layer_order)]
  return {
    'embed': _unboxed_init(Embed(dims), k_embed, tok),
    'layers': jax.vmap(lambda k: _unboxed_init(Block(dims), k, x))(layer_keys),
    'head': _unboxed_init(Head(dims), k_head, x),
  }


def param_logical_axes(dims: Dims) -> PyTree:
  """The same tree as `init_params`, with each leaf's logical axis names (a tuple)."""
  tok = jax.ShapeDtypeStruct((1, 1), jnp.int32)  # shapes only: nothing runs or compiles
  x = jax.ShapeDtypeStruct((1, 1, dims.d_model), dims.dtype)

  def names(module, *args):
    boxed = jax.eval_shape(lambda *a: module.init(jax.random.key(0), *a)['params'], *args)
    return jax.tree.map(lambda b: tuple(b.names), boxed, is_leaf=lambda b: isinstance(b, nn.Partitioned))

  layer = jax.tree.map(
    lambda n: ('layers',) + n, names(Block(dims), x), is_leaf=lambda n: isinstance(n, tuple)
  )
  return {'embed': names(Embed(dims), tok), 'layers': layer, 'head': names(Head(dims), x)}


def block_apply(
  dims: Dims,
  layer_params: PyTree,
  x_btd: jax.Array,
  positions_t: jax.Array | None = None,
  cache: KVCache | None = None,
  seq_len: int | None = None,
) -> jax.Array | tuple[jax.Array, KVCache]:
  """One layer: x, or (x, new cache) when a KV cache is given; with `seq_len`, x is the flattened
  rows [b*t, d] of sequence parallelism (see Block)."""
  return Block(dims, seq_len).apply({'params': layer_params}, x_btd, positions_t, cache)


def embed_apply(dims: Dims, params: PyTree, tokens_bt: jax.Array) -> jax.Array:
  """Token embeddings [b, t, d] of `tokens_bt` (the `embed` part of the full parameter tree)."""
  return Embed(dims).apply({'params': params['embed']}, tokens_bt)


def head_apply(dims: Dims, params: PyTree, x_btd: jax.Array) -> jax.Array:
  """fp32 logits [b, t, v_padded] of `x_btd` (the `head` part of the full parameter tree)."""
  return Head(dims).apply({'params': params['head']}, x_btd)
