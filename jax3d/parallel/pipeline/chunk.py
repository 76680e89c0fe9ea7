"""One chunk of a stage's layers on one micro-batch: its forward, and its backward from residuals.

Both schedules run a stage's layers in chunks (v chunks per stage, `lc` layers each) and write
their backward pass out: GPipe (gpipe.py) under 'full' and 'stage' remat, 1F1B (one_f_one_b.py)
always. `Chunk.forward` runs the chunk under `jax.vjp`, the layers under the remat policy, and
returns the VJP's residual leaves but the weights (the backward reads those again): what the policy
saves ('none' every intermediate, 'dots' the projections, 'full' each layer's input, 'stage' the
chunk's input). `Chunk.backward` rebuilds the VJP from them and runs it: the weight gradients of
the chunk's layers and the input's gradient. The weights are cast to the compute dtype before
the `jax.vjp`, so a mixed-precision layer's own cast is a no-op and leaves no cast copy of the
weights among the residuals.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jax3d.parallel import remat
from jax3d.parallel.layer_fn import LayerFn, Side
from jax3d.parallel.sharding import vary


def run_layers(
  layer_fn: LayerFn,
  layers: Any,
  x: jax.Array,
  policy: str,
  chunk: jax.Array | None = None,
  side: Side | None = None,
) -> jax.Array:
  """Sequential scan of `layer_fn` over the stacked `layers` (each layer under the remat policy),
  every layer given the micro-batch's `side` arrays.

  With `chunk`, `layers` is [v, lc, ...] and the layers of chunk `chunk` (a traced index) run:
  each layer's weights are sliced inside its checkpoint, so the backward pass slices them again
  instead of saving a copy of the chunk's weights for every pipeline iteration."""
  side = {} if side is None else side
  if chunk is None:
    step = remat.wrap_layer(lambda h, p: (layer_fn(p, h, side), None), policy)
    return jax.lax.scan(step, x, layers)[0]

  def one(h, j):
    return layer_fn(jax.tree.map(lambda a: a[chunk, j], layers), h, side), None

  lc = jax.tree.leaves(layers)[0].shape[1]
  return jax.lax.scan(remat.wrap_layer(one, policy), x, jnp.arange(lc))[0]


@dataclasses.dataclass(frozen=True)
class Chunk:
  """A chunk's forward with its VJP residuals, and its backward from them."""

  layer_fn: LayerFn
  policy: str
  dtype: Any  # the compute dtype of the activations

  def weights(self, params_r: Any) -> Any:
    """The chunk's weights [lc, ...] in the compute dtype."""
    cast = lambda a: a.astype(self.dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a
    return jax.tree.map(cast, params_r)

  def apply(self, params_r: Any, x: jax.Array, side_u: Side) -> jax.Array:
    """The chunk's output alone (no residuals): the layers under the remat policy."""
    run = lambda p, h: run_layers(self.layer_fn, p, h, self.policy, side=side_u)
    return remat.wrap_iteration(run, self.policy)(params_r, x)

  def forward(self, params_r: Any, x: jax.Array, side_u: Side) -> tuple[jax.Array, list, tuple]:
    """(y, the residuals to keep, their layout): the VJP's leaves but the weights; the layout (the
    VJP's treedef, which leaves are weights) rebuilds it (`backward`)."""
    w = self.weights(params_r)
    y, vjp = jax.vjp(lambda p, h: self.apply(p, h, side_u), w, x)
    leaves, tree = jax.tree.flatten(vjp)
    w_leaves = jax.tree.leaves(w)
    where = tuple(next((i for i, a in enumerate(w_leaves) if a is leaf), None) for leaf in leaves)
    kept = [leaf for leaf, i in zip(leaves, where, strict=True) if i is None]
    return y, kept, (tree, where)

  def backward(self, params_r: Any, kept: list, layout: tuple, ct: jax.Array) -> tuple[Any, jax.Array]:
    """(the weight gradients [lc, ...] in the weights' dtype, ct_x) from a forward's residuals."""
    tree, where = layout
    w_leaves, rest = jax.tree.leaves(self.weights(params_r)), iter(kept)
    vjp = jax.tree.unflatten(tree, [next(rest) if i is None else w_leaves[i] for i in where])
    g_w, ct_x = vjp(ct.astype(self.dtype))
    return jax.tree.map(lambda g, a: g.astype(a.dtype), g_w, params_r), ct_x

  def slots(self, params_r: Any, x: jax.Array, side_u: Side, n: int, axes: tuple) -> tuple[list, tuple]:
    """(n zero slots of each residual [n, ...], the layout): one forward traced for its shapes,
    its values unused (dead code). The slots vary over the manual `axes` too: a residual traced
    here from chunk 0 may vary over fewer axes than one from the chunk a stage picks (`kept`)."""
    _, kept, layout = self.forward(params_r, x, side_u)
    return [vary(zeros(a, (n, *a.shape)), axes) for a in kept], layout


def kept(leaves: list, slots: list) -> list:
  """Residual leaves varying over the manual axes of their slots (a scan carries the slots)."""
  return [
    vary(a, tuple(sorted(jax.typeof(s).manual_axis_type.varying))) for a, s in zip(leaves, slots, strict=True)
  ]


def zeros(a: jax.Array, shape: tuple[int, ...] | None = None, dtype: Any = None) -> jax.Array:
  """Zeros like `a` (or of `shape`, `dtype`), varying over the same manual axes."""
  z = jnp.zeros_like(a, dtype=dtype)
  varying = tuple(sorted(jax.typeof(a).manual_axis_type.varying))  # sorted: not the hash seed's order
  return vary(jnp.broadcast_to(z, shape) if shape else z, varying)


def add_at(acc: jax.Array, g: jax.Array, index: tuple[jax.Array, ...]) -> jax.Array:
  """acc with g added at `index` of its leading dims, written as XLA fuses it into one in-place
  add of the slice (a zero buffer with g placed in it, added: `.at[].add` is a scatter-add)."""
  start = (*index, *(0,) * g.ndim)
  g = g.reshape((1,) * len(index) + g.shape)
  return acc + jax.lax.dynamic_update_slice(jnp.zeros_like(acc), g.astype(acc.dtype), start)


def put(buf: jax.Array, slot: jax.Array, value: jax.Array, valid: jax.Array) -> jax.Array:
  """buf with `value` written at `slot` where `valid` (else unchanged): one slot read and written."""
  return buf.at[slot].set(jnp.where(valid, value.astype(buf.dtype), buf[slot]))
