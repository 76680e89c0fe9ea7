"""Context parallelism (mesh.cp > 1): each row's tokens split over the devices of the 'cp' axis.

Layout (load balance, as Megatron-LM and MaxText): a row of t tokens is cut into 2*cp chunks of
c = t/(2cp) and laid out so that cp rank i holds chunks i and 2cp-1-i; under causal attention
every rank then has the same work (an early chunk with few keys, a late one with many). `order`
is that permutation; `lay_out` applies it to every [B, T] array of a batch on entering the step
(the batch arrives with its rows over dp and replicated over cp, so this is a local slice per
device, no communication), and adds the rotary positions 0..t-1 when the batch has none: the
positions travel with the tokens, so RoPE is right in any order. The loss is a sum over tokens
divided by the batch's weight sum, so the order changes neither; `natural` puts per-token outputs
(logits) back in the rows' own order.

Attention over cp is jax3d/model/cp_attention.py (the blockwise kernel, by train.cp_strategy); it
composes the collectives over 'cp' offered here: `rank`, `gather` (all-gather of the sequence),
`scatter_sum` (its transpose, a reduce-scatter) and `rotate` (one step round the cp ring), with
the causal positions of a rank's tokens (`positions`, read off `order`). The parameters are
replicated over cp, so their gradients are summed over dp x cp by the compiler.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax3d.parallel.sharding import CP

POSITIONS = 'positions'


def order(t: int, cp: int) -> np.ndarray:
  """int [t]: the row index of the token at each place of the cp layout (rank i: chunks i and
  2cp-1-i of c = t/(2cp) tokens each, ranks in order)."""
  c = t // (2 * cp)
  chunks = np.arange(t).reshape(2 * cp, c)
  return np.concatenate([np.concatenate([chunks[i], chunks[2 * cp - 1 - i]]) for i in range(cp)])


def lay_out(batch: dict[str, jax.Array], cp: int) -> dict[str, jax.Array]:
  """Every [B, T] array of `batch` in the cp layout (`order`), with rotary positions 0..T-1 added
  where the batch has none (rows of one sequence)."""
  if cp == 1:
    return batch
  b, t = batch['inputs'].shape
  if POSITIONS not in batch:
    batch = {**batch, POSITIONS: jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))}
  idx = order(t, cp)
  return {k: v[:, idx] for k, v in batch.items()}


def natural(x_bt: jax.Array, cp: int) -> jax.Array:
  """[B, T, ...] in the cp layout -> the rows' own order (the inverse of `lay_out`)."""
  return x_bt if cp == 1 else x_bt[:, np.argsort(order(x_bt.shape[1], cp))]


def in_layout(fn: Callable, tokens_bt: jax.Array, doc: dict[str, jax.Array] | None, cp: int) -> jax.Array:
  """fn(tokens, doc) -> [B, T, ...] per token, run on the rows in the cp layout and returned in
  their own order (logits for scoring and verification)."""
  if cp == 1:
    return fn(tokens_bt, doc)
  laid = lay_out({'inputs': tokens_bt, **(doc or {})}, cp)
  return natural(fn(laid.pop('inputs'), laid), cp)


def cp_size() -> int:
  """The size of the 'cp' axis of the mesh in context (1 when it has none)."""
  mesh = jax.sharding.get_abstract_mesh()
  return dict(mesh.shape).get(CP, 1) if not mesh.empty else 1


def manual() -> bool:
  """Whether 'cp' is a manual axis here (the pipeline's loop, the explicit dp x cp reduction): each
  device then holds its own tokens of every row, in the cp layout."""
  mesh = jax.sharding.get_abstract_mesh()
  return not mesh.empty and CP in mesh.manual_axes


def split(t: int) -> int:
  """The cp ranks a sequence of length t is split over by the compiler: the mesh's cp, or 1 where t
  does not divide into 2*cp chunks (the parameters' initialisation traces a layer on one token;
  training's seq_len always divides, train.seq_len's rule) or where cp is manual (`manual`: the t
  tokens are this rank's own)."""
  cp = cp_size()
  return cp if t % (2 * cp) == 0 and not manual() else 1


def active(t: int) -> bool:
  """Whether attention over t tokens runs split over cp (`attend`): the compiler's split, or this
  rank's own tokens where cp is manual."""
  return split(t) > 1 or (manual() and cp_size() > 1)


def rows(x_bt: jax.Array) -> jax.Array:
  """[b, t, ...] -> the layer's flattened rows [b*t, ...]: b-major, or with cp > 1 cp-major
  ([cp, b, t/cp] flattened), so that rows split over (cp, dp) are each device's own tokens (a
  b-major flattening of a sequence split over cp is no split of the rows: GSPMD would reshard)."""
  b, t = x_bt.shape[:2]
  cp = split(t)
  if cp == 1:
    return x_bt.reshape(b * t, *x_bt.shape[2:])
  return x_bt.reshape(b, cp, t // cp, *x_bt.shape[2:]).swapaxes(0, 1).reshape(b * t, *x_bt.shape[2:])


def unrows(x_r: jax.Array, b: int, t: int) -> jax.Array:
  """The inverse of `rows`: [b*t, ...] -> [b, t, ...]."""
  cp = split(t)
  if cp == 1:
    return x_r.reshape(b, t, *x_r.shape[1:])
  return x_r.reshape(cp, b, t // cp, *x_r.shape[1:]).swapaxes(0, 1).reshape(b, t, *x_r.shape[1:])


def shares(t: int) -> int:
  """The cp ranks' shares of a row of t tokens held here: `split` in the compiler's view, 1 where cp
  is manual (this rank's own)."""
  return split(t) if not manual() else 1


def row_tokens(t: int) -> int:
  """The whole row's tokens, of the t held here (t times cp where cp is manual)."""
  return t * cp_size() if manual() else t


def row_sum(a_bn: jax.Array) -> jax.Array:
  """[b, n, ...] per cp share of each row (n = `shares`) -> [b, ...] the whole row's sum: over n,
  and over the cp ranks (a psum) where cp is manual. For what takes no gradient (counts)."""
  a_b = jnp.sum(a_bn, axis=1)
  return jax.lax.psum(a_b, CP) if manual() and cp_size() > 1 else a_b


def positions(rank: Any, b: int, t: int, cp: int) -> jax.Array:
  """int [b, t/cp]: the row indices of the tokens cp rank `rank` holds (chunks rank and
  2cp-1-rank), the causal positions of its queries and keys."""
  p = jnp.asarray(order(t, cp).reshape(cp, t // cp), jnp.int32)[rank]  # the layout, from `order`
  return jnp.broadcast_to(p, (b, t // cp))


# --- collectives over 'cp', inside a region manual over it (jax3d/model/cp_attention.py) -----------
def rank() -> jax.Array:
  """This device's rank on the 'cp' axis."""
  return jax.lax.axis_index(CP)


def gather(a: jax.Array, t: int, cp: int) -> jax.Array:
  """[b, t/cp, ...] of every cp rank -> the whole rows [b, t, ...] in their natural order (an
  all-gather over cp, then a static gather: rank-major to natural)."""
  return jax.lax.all_gather(a, CP, axis=1, tiled=True)[:, np.argsort(order(t, cp))]


def scatter_sum(d: jax.Array, t: int, cp: int) -> jax.Array:
  """The transpose of `gather`: [b, t, ...] in natural order, summed over the cp ranks, each rank
  keeping its own tokens [b, t/cp, ...] (a reduce-scatter)."""
  return jax.lax.psum_scatter(d[:, order(t, cp)], CP, scatter_dimension=1, tiled=True)


def rotate(tree: Any, cp: int) -> Any:
  """Every array of `tree` sent one step round the cp ring (rank r -> r+1, one `ppermute` each)."""
  perm = [(r, (r + 1) % cp) for r in range(cp)]
  return jax.tree.map(lambda a: jax.lax.ppermute(a, CP, perm), tree)
