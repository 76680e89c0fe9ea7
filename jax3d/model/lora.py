"""LoRA: low-rank adapters on the decoder's projections, the base frozen (config section `lora`).

Each targeted projection W (a Hugging Face module: q_proj, k_proj, v_proj, o_proj, gate_proj,
up_proj, down_proj) gets A [in, r] and B [r, out], and its output becomes x W + (x A) B alpha/r.
jax3d fuses Q/K/V and gate/up into one matmul each, but the adapters stay one per Hugging Face
module (so a PEFT adapter maps onto them one to one: A = lora_A.weight^T, B = lora_B.weight^T with
the output features in jax3d's order). A starts as PEFT's (uniform, bound 1/sqrt(in)), B at zero.

The adapters are parameters of the layer (`Block`'s 'lora_q', 'lora_k', ... with leaves 'a' and
'b'), stacked over the layer axis and sharded like it: a column-parallel projection's A is
replicated and its B split over tp like the output; a row-parallel one's A split like the input,
B replicated. Training differentiates and optimizes only them (`split`): the base gets no
gradient and no optimizer state, and passes through the step unchanged.

Dropout (lora.dropout = p, PEFT's lora_dropout): in training steps only, the adapter's input x is
x * keep / (1 - p) before A (the base's input is not dropped). `keep` is a function of global
coordinates alone, so every layout, micro-batch split and accumulation chunking draws the same
mask: the step hands each token a random word (`noise_words`: threefry bits from the seed and the
step over the global [batch, seq]); each layer a salt of its own frozen weights (`layer_salt`: an
integer sum of their bits, exact in any order, so a key per layer without a layer index in the
pipeline's loop); and keep(token, adapter, feature j) = hash(word, salt, target, j) >= p * 2**32.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jax3d.model import quant
from jax3d.parallel.sharding import constrain

PREFIX = 'lora_'  # a layer's adapter of target t is its submodule PREFIX + t
# target -> (Hugging Face module under model.layers.{i}., column-parallel)
MODULES = {
  'q': ('self_attn.q_proj', True),
  'k': ('self_attn.k_proj', True),
  'v': ('self_attn.v_proj', True),
  'o': ('self_attn.o_proj', False),
  'gate': ('mlp.gate_proj', True),
  'up': ('mlp.up_proj', True),
  'down': ('mlp.down_proj', False),
}


class Adapter(nn.Module):
  """One projection's adapter: (x A) B * alpha/r, x contracted over its last len(in_shape) axes.
  `in_names`/`out_names`: the logical axes of the projection's input and output features (the
  kernel's), which A and B take; `xa_names`: the logical axes of x A's rows (the low-rank
  activation, where the collectives of the tp layout happen: an all-gather of its rows under
  sequence parallelism for a column-parallel projection, a sum over tp for a row-parallel one)."""

  in_shape: tuple[int, ...]
  out_shape: tuple[int, ...]
  in_names: tuple[str, ...]
  out_names: tuple[str, ...]
  rank: int
  scale: float
  dtype: Any
  param_dtype: Any
  dropout: float = 0.0

  @nn.compact
  def __call__(self, x: jax.Array, xa_names: tuple[str, ...], noise: Noise | None = None) -> jax.Array:
    """`noise`: a training step's (words of x's rows, the layer's salt): dropout on x; None: none."""
    n_in = len(self.in_shape)
    in_axis = tuple(range(n_in))
    a_init = nn.initializers.variance_scaling(1 / 3, 'fan_in', 'uniform', in_axis=in_axis, out_axis=-1)
    a = self.param(
      'a',
      nn.with_logical_partitioning(a_init, self.in_names + ('lora',)),
      self.in_shape + (self.rank,),
      self.param_dtype,
    )
    b = self.param(
      'b',
      nn.with_logical_partitioning(nn.initializers.zeros_init(), ('lora',) + self.out_names),
      (self.rank,) + self.out_shape,
      self.param_dtype,
    )
    rows = x.shape[:-n_in]
    x = x.astype(self.dtype)
    if noise is not None and self.dropout > 0:
      words, salt = noise
      target = list(MODULES).index(self.name.removeprefix(PREFIX))
      keep = keep_mask(words.reshape(rows), target_salt(salt, target), self.in_shape, self.dropout)
      x = jnp.where(keep, x / jnp.asarray(1 - self.dropout, self.dtype), jnp.zeros((), self.dtype))
    xa = jnp.tensordot(x, a.astype(self.dtype), axes=n_in)
    xa = constrain(xa.reshape(int(np.prod(rows)), self.rank), xa_names)
    y = jnp.tensordot(xa, b.astype(self.dtype), axes=1) * jnp.asarray(self.scale, self.dtype)
    return y.reshape(rows + self.out_shape)


# --- dropout: masks from global coordinates ----------------------------------------------------
Noise = tuple[jax.Array, jax.Array]  # (uint32 words of x's rows, uint32 salt of the layer)
NOISE = 'lora_noise'  # the training batch's key of the tokens' words ([B, T] uint32, a per-row input)
_GOLDEN = 0x9E3779B9


def _mix(u: jax.Array) -> jax.Array:
  """A bijective 32-bit integer hash with full avalanche (Wellons' lowbias32)."""
  u = u ^ (u >> 16)
  u = u * jnp.uint32(0x7FEB352D)
  u = u ^ (u >> 15)
  u = u * jnp.uint32(0x846CA68B)
  return u ^ (u >> 16)


def noise_words(seed: int, step: jax.Array, shape: tuple[int, int]) -> jax.Array:
  """The tokens' random words [B, T] (uint32) of training step `step`: threefry bits of
  fold_in(key(seed), step) over the global batch shape (the same bits on every sharding)."""
  return jax.random.bits(jax.random.fold_in(jax.random.key(seed), step), shape, jnp.uint32)


def layer_salt(layer_params: Any) -> jax.Array:
  """A uint32 salt of one layer from its frozen attention weights (every leaf of its 'qkv'): the
  wrapping sum of their bit patterns, the same in any summation order, so the same on every
  layout; layers differ in their weights, so each draws its own masks."""
  total = jnp.zeros((), jnp.uint32)
  for w in jax.tree.leaves(jax.lax.stop_gradient(layer_params['qkv'])):
    bits = jax.lax.bitcast_convert_type(w, jnp.dtype(f'uint{w.dtype.itemsize * 8}'))
    total = total + jnp.sum(bits.astype(jnp.uint32), dtype=jnp.uint32)
  return _mix(total)


def target_salt(salt: jax.Array, target: int) -> jax.Array:
  """The salt of adapter `target` (its index in MODULES) of the layer of `salt`."""
  return _mix(salt + jnp.uint32(target + 1) * jnp.uint32(_GOLDEN))


def keep_mask(words: jax.Array, salt: jax.Array, in_shape: tuple[int, ...], p: float) -> jax.Array:
  """Where dropout p keeps x [rows..., in...]: hash(word of the row, salt, feature index) at or
  above p * 2**32 (probability 1 - p within 2**-32). `words` [rows...] uint32."""
  row = _mix(words.astype(jnp.uint32) ^ salt)
  j = jnp.arange(int(np.prod(in_shape)), dtype=jnp.uint32).reshape(in_shape)
  bits = _mix(row.reshape(row.shape + (1,) * len(in_shape)) + j * jnp.uint32(_GOLDEN))
  return bits >= jnp.uint32(min(round(p * 2**32), 2**32 - 1))


# --- the parameter tree: trainable (the adapters) and frozen (the base) ---------------------------
def is_adapter(path: tuple[Any, ...]) -> bool:
  """Whether the leaf at `path` (keys, or jax path entries) belongs to an adapter."""
  return any(str(getattr(k, 'key', k)).startswith(PREFIX) for k in path)


def split(tree: Any, on: bool) -> tuple[Any, Any]:
  """(trainable, frozen) of a parameter-shaped tree of nested dicts: with LoRA `on`, the adapters'
  leaves and the rest, each a tree of the same nesting holding only its leaves; else (tree, {})."""
  if not on:
    return tree, {}

  def part(t: Any, inside: bool) -> tuple[Any, Any]:
    if not isinstance(t, dict):
      return (t, None) if inside else (None, t)
    train, frozen = {}, {}
    for k, v in t.items():
      a, b = part(v, inside or str(k).startswith(PREFIX))
      if not _empty(a):
        train[k] = a
      if not _empty(b):
        frozen[k] = b
    return train, frozen

  return part(tree, False)


def trainable(dims: Any, tree: Any) -> tuple[Any, Any]:
  """(trainable, frozen) parts of a parameter-shaped tree for the model `dims`
  (jax3d.model.dims.Dims): with LoRA (lora.rank > 0) the adapters and the base, else the whole
  tree and nothing."""
  return split(tree, dims.lora_rank > 0)


def merge(a: Any, b: Any) -> Any:
  """The tree holding the leaves of both `a` and `b` (the inverse of `split`)."""
  if not isinstance(a, dict) or not isinstance(b, dict):
    return a if _empty(b) else b
  out = dict(a)
  for k, v in b.items():
    out[k] = merge(out[k], v) if k in out else v
  return out


def _delta(adapter: dict, scale: float) -> jax.Array:
  """A B alpha/r of one stacked adapter: [layers, in..., out...] in float32."""
  a, b = adapter['a'].astype(jnp.float32), adapter['b'].astype(jnp.float32)
  flat = jnp.einsum(
    'lir,lro->lio', a.reshape(a.shape[0], -1, a.shape[-1]), b.reshape(b.shape[0], b.shape[1], -1)
  )
  return (flat * scale).reshape(a.shape[:-1] + b.shape[2:])


# target -> (the base kernel it adds to, the index of its block there given g = n_heads / n_kv_heads)
_IN_KERNEL = {
  'q': ('qkv', lambda g: (slice(None),) * 3 + (slice(0, g),)),  # qkv [L, d, k, g+2, h]
  'k': ('qkv', lambda g: (slice(None),) * 3 + (g,)),
  'v': ('qkv', lambda g: (slice(None),) * 3 + (g + 1,)),
  'o': ('o', lambda g: ()),
  'gate': ('gate_up', lambda g: (slice(None),) * 2 + (0,)),  # gate_up [L, d, 2, f]
  'up': ('gate_up', lambda g: (slice(None),) * 2 + (1,)),
  'down': ('down', lambda g: ()),
}


def merged(dims: Any, params: Any) -> Any:
  """The base parameters with every adapter merged into its kernel, W + A B alpha/r (summed in
  float32, stored in the base's dtype; an int8 kernel dequantized first, jax3d/model/quant.py),
  and no adapters: the model the adapted one computes."""
  train, base = trainable(dims, params)
  base = quant.dequantized(base, dims.param_dtype)
  layers = dict(base['layers'])
  g = dims.n_heads // dims.n_kv_heads
  for name, adapter in train.get('layers', {}).items():
    kernel, index = _IN_KERNEL[name.removeprefix(PREFIX)]
    w = layers[kernel]['kernel']
    new = w.astype(jnp.float32).at[index(g)].add(_delta(adapter, dims.lora_scale))
    layers[kernel] = {**layers[kernel], 'kernel': new.astype(w.dtype)}
  return {**base, 'layers': layers}


def _empty(t: Any) -> bool:
  return t is None or (isinstance(t, dict) and not t)


def count(tree: Any) -> int:
  return int(sum(np.prod(x.shape) for x in jax.tree.leaves(tree)))
