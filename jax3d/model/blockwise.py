"""Blockwise (flash-style) attention in JAX: memory that grows with the sequence, not its square.

Queries in blocks of `block` rows, keys in blocks of `block` columns; each query block runs over the
key blocks with an online softmax (running max, running sum, fp32 accumulator), so no [t, t] array
exists per head, forward or backward. The backward (`jax.custom_vjp`) recomputes each block's scores
from (q, k, v, out, logsumexp): per key block, its dK and dV over the query blocks, dQ accumulated.

Who sees whom comes from two integer arrays per side, never a mask: query i sees key j iff
  segment(j) == segment(i)  and  position(j) <= position(i).
`positions` order the tokens causally (a row's token index; a reordered or split sequence passes
its tokens' original indices), `segments` are the documents (None: one document). Queries and keys
may have different lengths (keys gathered from elsewhere). Block pairs that no row of the batch
needs (every key after every query, or segment ranges that do not meet) are skipped: each query
block's loop runs from its first needed key block to its last (a while loop with those bounds;
for rows in their natural order the needed blocks are contiguous, so every unneeded one is
skipped), and each key block's backward likewise over query blocks. Not `lax.cond`: under a
differentiated scan (the layers' loop) jax 0.10's partial evaluation of a cond inside the custom
VJP's forward kept every block's scores as residuals, t^2 again.

Keys may also come in several calls (context parallelism's ring, jax3d/model/cp_attention.py):
`start`, `accumulate` once per group of keys (the same online softmax, its running statistics
carried between calls), `finish`; then `backward` once per group with the finished logsumexp.

Grouped-query attention without repeating K/V: queries [b, t, n, h] are read as [b, t, kv, g, h].
Shapes: b batch, t/s query/key length, n query heads, kv key/value heads, g = n / kv, h head size;
the blocked layouts put the block index first: q [nq, b, bq, kv, g, h], k [nk, b, bk, kv, h].
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jax3d.parallel import sharding

BLOCK = 512  # rows and columns of a block (clipped to the lengths)
_FAR = 2**30  # the position of a padded key: after every query; a padded query's is -1
F32 = jnp.float32


def attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  q_positions: jax.Array,
  k_positions: jax.Array,
  q_segments: jax.Array | None = None,
  k_segments: jax.Array | None = None,
  block: int = BLOCK,
) -> jax.Array:
  """Attention [b, t, n, h] of q [b, t, n, h] over k, v [b, s, kv, h]: positions int [b, t] and
  [b, s], segments the same or None (one document). Differentiable in q, k and v."""
  return _attention(q, k, v, q_positions, k_positions, q_segments, k_segments, block)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _attention(q, k, v, qp, kp, qs, ks, block):
  return forward(q, k, v, qp, kp, qs, ks, block)[0]


def _attention_fwd(q, k, v, qp, kp, qs, ks, block):
  # stop_gradient: under a differentiated scan, jax 0.10 linearises a custom_vjp's forward rule too
  # and keeps its block loops' internals ([nq, nk] blocks of scores) as residuals nobody reads
  out, lse = forward(*jax.lax.stop_gradient((q, k, v)), qp, kp, qs, ks, block)
  return out, (q, k, v, qp, kp, qs, ks, out, lse)


def _attention_bwd(block, res, g):
  return (*backward(*res, g, block=block), None, None, None, None)


_attention.defvjp(_attention_fwd, _attention_bwd)


class _Blocks:
  """The operands cut into blocks (padded to whole blocks) and which block pairs are needed."""

  def __init__(self, q, k, qp, kp, qs, ks, block: int):
    b, t, n, h = q.shape
    s, kv = k.shape[1], k.shape[2]
    self.b, self.t, self.s, self.n, self.kv, self.g, self.h = b, t, s, n, kv, n // kv, h
    self.bq, self.bk = min(block, t), min(block, s)
    self.nq, self.nk = -(-t // self.bq), -(-s // self.bk)
    self.scale = h**-0.5
    qp = _pad(jnp.broadcast_to(qp, (b, t)), self.nq * self.bq, -1)
    kp = _pad(jnp.broadcast_to(kp, (b, s)), self.nk * self.bk, _FAR)
    self.qp, self.kp = _blocked_ids(qp, self.nq), _blocked_ids(kp, self.nk)  # [n?, b, b?]
    self.qs = (
      None if qs is None else _blocked_ids(_pad(jnp.broadcast_to(qs, (b, t)), self.nq * self.bq, -1), self.nq)
    )
    self.ks = (
      None if ks is None else _blocked_ids(_pad(jnp.broadcast_to(ks, (b, s)), self.nk * self.bk, -2), self.nk)
    )
    # needed[i, j]: some row of the batch has a query of block i that sees a key of block j
    need = self.kp.min(-1)[None] <= self.qp.max(-1)[:, None]  # [nq, nk, b]
    if self.qs is not None:
      qlo, qhi, klo, khi = self.qs.min(-1), self.qs.max(-1), self.ks.min(-1), self.ks.max(-1)
      need &= (klo[None] <= qhi[:, None]) & (khi[None] >= qlo[:, None])
    self.needed = need.any(-1)
    # inside a shard_map: the manual axes the operands vary over (a loop's carry must match its body)
    ops = [x for x in (q, k, qp, kp, qs, ks) if x is not None]
    self.axes = tuple(sorted({a for x in ops for a in jax.typeof(x).manual_axis_type.varying}))

  def vary(self, tree: Any) -> Any:
    """`tree`'s arrays (made from constants) marked varying over the operands' manual axes."""
    return jax.tree.map(lambda a: sharding.vary(a, self.axes), tree)

  def queries(self, x: jax.Array, heads: int) -> jax.Array:
    """[b, t, heads, ...] -> [nq, b, bq, heads, ...] (padded)."""
    return _blocked(x, self.nq, self.bq, heads)

  def keys(self, x: jax.Array) -> jax.Array:
    return _blocked(x, self.nk, self.bk, x.shape[2])

  def visible(self, i: Any, j: Any) -> jax.Array:
    """[b, 1, 1, bq, bk]: query (row of block i) sees key (column of block j)."""
    m = self.kp[j][:, None, :] <= self.qp[i][:, :, None]
    if self.qs is not None:
      m &= self.ks[j][:, None, :] == self.qs[i][:, :, None]
    return m[:, None, None]

  def scores(self, q_i: jax.Array, k_j: jax.Array, i: Any, j: Any) -> tuple[jax.Array, jax.Array]:
    """(fp32 scaled scores [b, kv, g, bq, bk], visibility) of query block i and key block j."""
    s = jnp.einsum('bqkgh,bskh->bkgqs', q_i, k_j, preferred_element_type=F32) * self.scale
    return s, self.visible(i, j)


A = jax.Array
OptA = jax.Array | None


def forward(
  q: A, k: A, v: A, qp: A, kp: A, qs: OptA = None, ks: OptA = None, block: int = BLOCK
) -> tuple[A, A]:
  """(out [b, t, n, h] in q's dtype, logsumexp [nq, b, kv, g, bq] fp32)."""
  return _forward(q, k, v, qp, kp, qs, ks, block, None)


def accumulate(q: A, k: A, v: A, qp: A, kp: A, qs: OptA, ks: OptA, block: int, state: Any) -> Any:
  """The online softmax continued over more keys: `state` (the running max, sum and fp32 weighted
  sum [nq, b, kv, g, bq(, h)] of the keys seen so far, `start`'s for none) updated with these keys,
  block by block as `forward` does. `finish` turns it into `forward`'s (out, logsumexp): keys
  given in several calls (a ring of K/V blocks) give the same numbers as one call with them all."""
  return _forward(q, k, v, qp, kp, qs, ks, block, state)


def start(q: A, kv: int, block: int = BLOCK) -> Any:
  """The statistics of queries q [b, t, n, h] (kv key heads) that have seen no key yet."""
  b, t, n, h = q.shape
  bq = min(block, t)
  lead = (-(-t // bq), b, kv, n // kv, bq)
  return jax.tree.map(lambda a: sharding.vary_like(a, q), _fresh(lead, h))


def finish(state: Any, like: A) -> tuple[A, A]:
  """`accumulate`'s statistics -> `forward`'s (out shaped and typed as `like`, the queries; lse)."""
  out, lse = _finished(*state, like.dtype)
  return _unblock(out, like.shape[1]).reshape(like.shape), lse


def _fresh(shape: tuple, h: int) -> tuple[A, A, A]:
  """(running max, sum, weighted sum) of no key: -inf, 0, 0 of `shape` (+ (h,) for the sum)."""
  return jnp.full(shape, -jnp.inf, F32), jnp.zeros(shape, F32), jnp.zeros((*shape, h), F32)


def _finished(m: A, l: A, acc: A, dtype: Any) -> tuple[A, A]:
  """The statistics of a query block [..., kv, g, bq(, h)] -> (out [..., bq, kv, g, h], lse)."""
  out = acc / jnp.where(l > 0, l, 1.0)[..., None]
  lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), 0.0)
  return jnp.moveaxis(out, -2, -4).astype(dtype), lse


def _forward(q, k, v, qp, kp, qs, ks, block, state):
  """`forward` (state None) or `accumulate`: each query block's loop over its needed key blocks."""
  z = _Blocks(q, k, qp, kp, qs, ks, block)
  qb = z.queries(q.reshape(z.b, z.t, z.kv, z.g, z.h), z.kv)
  kb, vb = z.keys(k), z.keys(v)

  def one_query_block(i, carried):
    q_i = qb[i]

    def step(j, carry):
      m, l, acc = carry
      s, vis = z.scores(q_i, kb[j], i, j)
      m_new = jnp.maximum(m, jnp.where(vis, s, -jnp.inf).max(-1))
      m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
      p = jnp.where(vis, jnp.exp(s - m_safe[..., None]), 0.0)
      c = jnp.exp(jnp.where(jnp.isfinite(m), m - m_safe, -jnp.inf))
      pv = jnp.einsum('bkgqs,bskh->bkgqh', p.astype(v.dtype), vb[j], preferred_element_type=F32)
      return m_new, l * c + p.sum(-1), acc * c[..., None] + pv

    init = z.vary(_fresh((z.b, z.kv, z.g, z.bq), z.h) if carried is None else carried)
    stats = _over_blocks(z.needed[i], step, init)
    return stats if state is not None else _finished(*stats, q.dtype)

  if state is not None:
    return _map(one_query_block, z.nq, state)
  out, lse = _map(one_query_block, z.nq)
  return _unblock(out, z.t).reshape(z.b, z.t, z.n, z.h), lse


def backward(
  q: A,
  k: A,
  v: A,
  qp: A,
  kp: A,
  qs: OptA,
  ks: OptA,
  out: A,
  lse: A,
  g: A,
  block: int = BLOCK,
  dtype: Any = None,
) -> tuple[A, A, A]:
  """(dq, dk, dv) of `forward`'s out, recomputing each block's probabilities from lse: in the
  operands' dtypes, or all in `dtype` (fp32 for a caller that sums them over several calls).
  Over some of the keys (a ring's visiting block) with the logsumexp of all of them: the
  gradients of those keys, and their part of dq."""
  z = _Blocks(q, k, qp, kp, qs, ks, block)
  grouped = lambda x: z.queries(x.reshape(z.b, z.t, z.kv, z.g, z.h), z.kv)
  qb, gb = grouped(q), grouped(g)
  dsum = (g.astype(F32) * out.astype(F32)).sum(-1).reshape(z.b, z.t, z.kv, z.g)
  db = jnp.moveaxis(z.queries(dsum, z.kv), 2, -1)  # [nq, b, kv, g, bq]
  kb, vb = z.keys(k), z.keys(v)

  def one_key_block(dq, j):
    k_j, v_j = kb[j], vb[j]

    def step(i, carry):
      dk, dv, dq = carry
      s, vis = z.scores(qb[i], k_j, i, j)
      p = jnp.where(vis, jnp.exp(s - lse[i][..., None]), 0.0)
      dv = dv + jnp.einsum('bkgqs,bqkgh->bskh', p.astype(g.dtype), gb[i], preferred_element_type=F32)
      dp = jnp.einsum('bqkgh,bskh->bkgqs', gb[i], v_j, preferred_element_type=F32)
      ds = (p * (dp - db[i][..., None]) * z.scale).astype(q.dtype)
      dk = dk + jnp.einsum('bkgqs,bqkgh->bskh', ds, qb[i], preferred_element_type=F32)
      dq_i = jnp.einsum('bkgqs,bskh->bqkgh', ds, k_j, preferred_element_type=F32)
      return dk, dv, dq.at[i].add(dq_i)

    zeros = z.vary(jnp.zeros(k_j.shape, F32))
    dk, dv, dq = _over_blocks(z.needed[:, j], step, (zeros, zeros, dq))
    return dq, (dk, dv)

  dq0 = z.vary(jnp.zeros(qb.shape, F32))
  if z.nk == 1:
    dq, (dk, dv) = one_key_block(dq0, 0)
    dk, dv = dk[None], dv[None]
  else:
    dq, (dk, dv) = jax.lax.scan(one_key_block, dq0, jnp.arange(z.nk))
  dq = _unblock(dq, z.t).reshape(z.b, z.t, z.n, z.h).astype(dtype or q.dtype)
  return dq, _unblock(dk, z.s).astype(dtype or k.dtype), _unblock(dv, z.s).astype(dtype or v.dtype)


def _over_blocks(needed: jax.Array, step: Any, carry: Any) -> Any:
  """`step(j, carry)` for the blocks j from the first to the last `needed` one (a while loop with
  those bounds: the blocks outside are skipped; for rows in their natural order the needed blocks
  are contiguous). One block runs unconditionally (its masked entries are zero anyway)."""
  n = needed.shape[0]
  if n == 1:
    return step(0, carry)
  lo = jnp.argmax(needed)
  hi = jnp.where(needed.any(), n - jnp.argmax(needed[::-1]), lo)
  return jax.lax.fori_loop(lo, hi, step, carry)


def _map(fn: Any, n: int, xs: Any = None) -> Any:
  """`fn(i, xs[i])` (xs[i] None without xs) over block indices 0..n-1, stacked on a new leading
  axis (a loop, so blocks can skip)."""
  if n == 1:
    return jax.tree.map(lambda x: x[None], fn(0, jax.tree.map(lambda a: a[0], xs)))
  return jax.lax.map(lambda a: fn(*a), (jnp.arange(n), xs))


def _unblock(x: jax.Array, length: int) -> jax.Array:
  """[n?, b, b?, ...] -> [b, length, ...]."""
  x = jnp.moveaxis(x, 0, 1)
  return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :length]


def _pad(x: jax.Array, length: int, value: int) -> jax.Array:
  """x [b, t, ...] padded on axis 1 to `length` with `value`."""
  extra = length - x.shape[1]
  if not extra:
    return x
  return jnp.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2), constant_values=value)


def _blocked(x: jax.Array, nblocks: int, size: int, heads: int) -> jax.Array:
  """[b, t, heads, ...] -> [nblocks, b, size, heads, ...], zero-padded."""
  x = _pad(x, nblocks * size, 0)
  return jnp.moveaxis(x.reshape(x.shape[0], nblocks, size, *x.shape[2:]), 1, 0)


def _blocked_ids(x: jax.Array, nblocks: int) -> jax.Array:
  """int [b, T] -> [nblocks, b, T / nblocks]."""
  return jnp.moveaxis(x.reshape(x.shape[0], nblocks, -1), 1, 0)
