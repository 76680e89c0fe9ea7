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
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

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

  @nn.compact
  def __call__(self, x: jax.Array, xa_names: tuple[str, ...]) -> jax.Array:
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
    xa = jnp.tensordot(x.astype(self.dtype), a.astype(self.dtype), axes=n_in)
    xa = constrain(xa.reshape(int(np.prod(rows)), self.rank), xa_names)
    y = jnp.tensordot(xa, b.astype(self.dtype), axes=1) * jnp.asarray(self.scale, self.dtype)
    return y.reshape(rows + self.out_shape)


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
  float32, stored in the base's dtype), and no adapters: the model the adapted one computes."""
  train, base = trainable(dims, params)
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
