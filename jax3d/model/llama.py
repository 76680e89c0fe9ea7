"""A Llama-style decoder in Flax: the embedding, the stacked layers (jax3d/model/layers.py), the head
and the loss, with their parameters and logical axes.

The model speaks logical axes only (see jax3d/parallel/sharding.py); tensor parallelism is the
Megatron layout expressed as annotations (jax3d/model/layers.py). Embedding and head are
vocabulary-parallel; the loss never gathers the logits.

Layer weights are stacked on a leading `layers` axis, ready for `lax.scan` and pipeline stages.

Shape legend: b batch, t time, d model, v vocab.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jax3d.model import lora, moe, quant
from jax3d.model.dims import Dims
from jax3d.model.layers import Block, KVCache, RMSNorm, normal_init
from jax3d.parallel.sharding import constrain

PyTree = Any  # nested dicts of arrays (or of their abstract shapes)
STATS_PROBE = 'moe_stats'  # the head's zero vector whose gradient is the router statistics' sum


class Embed(nn.Module):
  """Vocabulary-parallel token embedding (vocab rows on tp). Tied to the head (model.tie_embeddings)
  it starts at the head's scale, 1/sqrt(d): the head's logits would be sqrt(d) times too large."""

  dims: Dims

  @nn.compact
  def __call__(self, tokens_bt):
    dm = self.dims
    table_vd = self.param(
      'embedding',
      normal_init(('vocab', 'embed'), 1.0 / np.sqrt(dm.d_model) if dm.tie_embeddings else 1.0),
      (dm.vocab_padded, dm.d_model),
      dm.param_dtype,
    )
    x_btd = jnp.take(table_vd, tokens_bt, axis=0).astype(self.dims.dtype)
    return constrain(x_btd, ('batch_all', 'seq', 'embed'))


class Head(nn.Module):
  """Final norm and vocabulary-parallel output projection; logits in fp32, vocab on tp. Tied
  (model.tie_embeddings), the projection is the embedding table `table_vd` (one parameter: its
  gradient is the sum of both uses) and the head has no `out` kernel of its own."""

  dims: Dims

  @nn.compact
  def __call__(self, x_btd, table_vd=None):
    dm = self.dims
    x_btd = RMSNorm(dm, name='norm')(constrain(x_btd, ('batch_all', 'seq', 'embed')))
    if dm.tie_embeddings:
      logits_btv = jnp.einsum('btd,vd->btv', x_btd.astype(dm.dtype), table_vd.astype(dm.dtype))
    else:
      logits_btv = nn.DenseGeneral(
        dm.vocab_padded,
        use_bias=False,
        dtype=dm.dtype,
        param_dtype=dm.param_dtype,
        kernel_init=normal_init(('embed', 'vocab'), 1.0 / np.sqrt(dm.d_model)),
        name='out',
      )(x_btd)
    logits_btv = logits_btv.astype(jnp.float32)
    if dm.vocab_padded > dm.vocab_size:  # padded entries can never be predicted
      pad_v = jnp.arange(dm.vocab_padded) >= dm.vocab_size
      logits_btv = jnp.where(pad_v, -1e30, logits_btv)
    if dm.n_experts:  # the router statistics' probe: zero, its gradient their sum (jax3d/loss.py)
      self.param(
        STATS_PROBE,
        nn.with_logical_partitioning(nn.initializers.zeros_init(), ('router',)),
        (moe.n_stats(dm),),
        jnp.float32,
      )
    return constrain(logits_btv, ('batch_all', 'seq', 'vocab'))


def cross_entropy_sum(
  logits_btv: jax.Array, targets_bt: jax.Array, weights_bt: jax.Array | None = None
) -> jax.Array:
  """Sum of token losses, each times its weight (`weights_bt`, float [b, t]; None: 1). A zero
  weight (padding, an unsupervised token) gives its target zero gradient. Vocab-parallel: max,
  sum-exp and the target logit are reduced over the vocab shards (tp); the full-vocabulary logits
  are never gathered on one device."""
  ce_bt = token_cross_entropy(logits_btv, targets_bt)
  return jnp.sum(ce_bt if weights_bt is None else ce_bt * weights_bt.astype(ce_bt.dtype))


def token_cross_entropy(logits_btv: jax.Array, targets_bt: jax.Array) -> jax.Array:
  """Each token's loss [b, t]: logsumexp(logits) - logits[target], the negative log-probability of
  the target (vocab-parallel, as `cross_entropy_sum`, which sums it)."""
  lse_bt = jax.nn.logsumexp(logits_btv, axis=-1)
  onehot_btv = jax.nn.one_hot(targets_bt, logits_btv.shape[-1], dtype=logits_btv.dtype)
  return lse_bt - jnp.sum(logits_btv * onehot_btv, axis=-1)


def head_loss_sum(
  dims: Dims,
  params: PyTree,
  y_btd: jax.Array,
  targets_bt: jax.Array,
  weights_bt: jax.Array | None = None,
  chunks: int = 1,
) -> jax.Array:
  """sum(w * CE) of the head's logits of `y_btd` (train.loss_chunks = `chunks`): with chunks > 1
  the sequence is cut into `chunks` contiguous pieces of t/chunks positions (every row kept whole,
  so the rows' sharding over dp and pp is untouched) and a scan runs the head and the loss of one
  piece at a time under `jax.checkpoint`: the backward recomputes a piece's logits instead of
  keeping them, so fp32 logits exist for 1/chunks of the tokens at a time. `chunks` divides t."""
  if chunks == 1:
    return cross_entropy_sum(head_apply(dims, params, y_btd), targets_bt, weights_bt)
  b, t = targets_bt.shape
  split = lambda a: jnp.moveaxis(a.reshape(b, chunks, t // chunks, *a.shape[2:]), 1, 0)

  @jax.checkpoint
  def piece(params, y_btd, targets_bt, weights_bt):
    return cross_entropy_sum(head_apply(dims, params, y_btd), targets_bt, weights_bt)

  # each piece's sum is a scan output, not a carry (inside a shard_map the loss varies over the
  # manual axes and a carry would have to start varying too: the model names no mesh axes)
  xs = (split(y_btd), split(targets_bt), None if weights_bt is None else split(weights_bt))
  return jnp.sum(jax.lax.scan(lambda _, xs: (None, piece(params, *xs)), None, xs)[1])


# ---------------------------------------------------------------------------------------------
# Parameters: init (with stacked layers) and their logical axes.
# ---------------------------------------------------------------------------------------------
def _unboxed_init(module, key, *args):
  return nn.unbox(module.init(key, *args)['params'])


def _init_dims(dims: Dims) -> Dims:
  """The model traced to create its parameters, on a dummy token: with XLA's attention, which
  creates the same parameters as any kernel and needs no per-device region (cuDNN's is split over
  the mesh, which one token is not)."""
  return dataclasses.replace(dims, attention='xla')


def init_params(key: jax.Array, dims: Dims, layer_order: np.ndarray) -> PyTree:
  """All parameters. Layer j of the stack holds canonical layer `layer_order[j]`, whose values come
  from that layer's own key, so the values never depend on the layout (pipeline order, sharding).
  An int8 base (jax3d/model/quant.py) is quantized from the float32 initialisation."""
  if dims.base_int8:  # the kernels quantized from float32, the rest of the base in its float dtype
    f32 = init_params(key, dataclasses.replace(dims, param_dtype=jnp.float32, base_int8=False), layer_order)
    keep = lambda p, a: lora.is_adapter(p) or a.dtype == jnp.int8 or p[-1].key == quant.SCALE
    cast = lambda p, a: a if keep(p, a) else a.astype(dims.param_dtype)
    return jax.tree_util.tree_map_with_path(cast, quant.quantized(dims, f32))
  k_embed, k_layers, k_head = jax.random.split(key, 3)
  tok = jnp.zeros((1, 1), jnp.int32)
  x = jnp.zeros((1, 1, dims.d_model), dims.dtype)
  layer_keys = jax.random.split(k_layers, dims.n_layers)[jnp.asarray(layer_order)]
  embed = _unboxed_init(Embed(dims), k_embed, tok)
  layers = jax.vmap(lambda k: _unboxed_init(Block(_init_dims(dims)), k, x))(layer_keys)
  head = _unboxed_init(Head(dims), k_head, x, embed['embedding'])
  return {'embed': embed, 'layers': layers, 'head': head}


def param_logical_axes(dims: Dims) -> PyTree:
  """The same tree as `init_params`, with each leaf's logical axis names (a tuple)."""
  dims = _init_dims(dims)
  tok = jax.ShapeDtypeStruct((1, 1), jnp.int32)  # shapes only: nothing runs or compiles
  x = jax.ShapeDtypeStruct((1, 1, dims.d_model), dims.dtype)
  table = jax.ShapeDtypeStruct((dims.vocab_padded, dims.d_model), dims.param_dtype)

  def names(module, *args):
    boxed = jax.eval_shape(lambda *a: module.init(jax.random.key(0), *a)['params'], *args)
    return jax.tree.map(lambda b: tuple(b.names), boxed, is_leaf=lambda b: isinstance(b, nn.Partitioned))

  layer = jax.tree.map(
    lambda n: ('layers',) + n, names(Block(dims), x), is_leaf=lambda n: isinstance(n, tuple)
  )
  axes = {'embed': names(Embed(dims), tok), 'layers': layer, 'head': names(Head(dims), x, table)}
  return quant.logical_axes(dims, axes)


def block_apply(
  dims: Dims,
  layer_params: PyTree,
  x_btd: jax.Array,
  positions_t: jax.Array | None = None,
  cache: KVCache | None = None,
  seq_len: int | None = None,
  segment_ids: jax.Array | None = None,
  noise: tuple[jax.Array, jax.Array] | None = None,
  stats_row: bool = False,
) -> jax.Array | tuple[jax.Array, KVCache]:
  """One layer: x, or (x, new cache) when a KV cache is given; with `seq_len`, x is the flattened
  rows [b*t, d] of sequence parallelism; `positions_t` [t] or per row [b, t], and `segment_ids`
  [b, t] for rows of documents (see Block); `noise`: a training step's LoRA dropout words [b, t]
  and the layer's salt (jax3d/model/lora.py), or none (no dropout); `stats_row`: x carries one
  more position, the router statistics' row, that the layer adds its own to (layers.Block)."""
  layer_params = quant.dequantized(layer_params, dims.dtype, stacked=False)  # int8 kernels: this layer's
  block = Block(dims, seq_len, stats_row)
  return block.apply({'params': layer_params}, x_btd, positions_t, cache, segment_ids, noise)


# The layer's parameters that it uses only as matmul operands in the compute dtype (flax's
# DenseGeneral kernels, the experts' and shared expert's matrices): ZeRO-3 may cast them before
# gathering them (jax3d/parallel/zero3.py). Not the norms' scales, biases, the fp32 router or LoRA.
MATMUL_WEIGHTS = frozenset({'kernel', 'experts_gate_up', 'experts_down', 'shared_gate_up', 'shared_down'})


def gather_dtypes(dims: Dims, layers: PyTree) -> PyTree:
  """A tree like the stacked `layers` (arrays or their shapes) of the dtype ZeRO-3 gathers each
  leaf in: the compute dtype for a float matmul weight stored wider than it (cast before the
  gather: the same values reach the matmul, at half the wire bytes for fp32 weights and bf16
  compute), its own dtype for the others."""
  compute = jnp.dtype(dims.dtype)

  def leaf(path, a):
    name = getattr(path[-1], 'key', None)
    wide = jnp.issubdtype(a.dtype, jnp.floating) and jnp.dtype(a.dtype).itemsize > compute.itemsize
    return compute if name in MATMUL_WEIGHTS and wide else jnp.dtype(a.dtype)

  return jax.tree_util.tree_map_with_path(leaf, layers)


def embed_apply(dims: Dims, params: PyTree, tokens_bt: jax.Array) -> jax.Array:
  """Token embeddings [b, t, d] of `tokens_bt` (the `embed` part of the full parameter tree)."""
  return Embed(dims).apply({'params': params['embed']}, tokens_bt)


def head_apply(dims: Dims, params: PyTree, x_btd: jax.Array) -> jax.Array:
  """fp32 logits [b, t, v_padded] of `x_btd` (the `head` part of the full parameter tree, and the
  embedding table when tied)."""
  table_vd = params['embed']['embedding'] if dims.tie_embeddings else None
  return Head(dims).apply({'params': params['head']}, x_btd, table_vd)
