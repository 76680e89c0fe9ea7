"""The mixture-of-experts feed-forward block (moe.num_experts > 0): an fp32 router, top-k experts
per token with their weights renormalised (moe.norm_topk_prob), a capacity per expert and
sequence with the tokens over it dropped and counted, and an optional shared expert.

Routing, per token: logits = x @ router (fp32), probs = softmax(logits), the k largest probs and
their experts; with norm_topk_prob the k weights divided by their sum (Mixtral, Qwen3-MoE). The
output is sum_k w_k * expert_{e_k}(x) (+ shared(x)), each expert a SwiGLU of d_expert.

Capacity (per sequence, so the same tokens are dropped on every layout): C = ceil(capacity_factor *
t * k / E), at most t. A sequence's t*k assignments are ranked choice-major (every token's first
choice before any second choice, each in token order); the one ranked i-th for expert e takes slot
i if i < C, else it is dropped (its weight's share of the output is lost; the residual carries the
token on). Dispatch is a scatter into [b, E, C, d] (one extra slot catches the dropped), the
experts one batched matmul [E, C, d] x [E, d, 2, f], the combine a gather: no [t, E, C] one-hot.

Router statistics of a sequence (`stats`, [b, E + 3]): each expert's share of the t*k assignments
(before capacity), the dropped share, the load-balancing loss E * sum_e (count_e / t) * mean_t
p_e (Mixtral's form, per sequence), and the z-loss mean_t logsumexp(logits)^2 (ST-MoE).

Expert parallelism: with an 'ep' mesh axis, the dispatched [b, E, C, d] goes to the experts'
devices and back by all-to-all (jax3d/parallel/expert.py). The experts' hidden size stays split
over tp (the 'mlp' logical axis).

Shape legend: b batch, t time, d model, E experts, k top-k, C capacity, f expert hidden, S stats.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax3d.model import formulas
from jax3d.model.dims import Dims
from jax3d.parallel import context, expert


def capacity(dims: Dims, t: int) -> int:
  """Slots per expert in a capacity group of t tokens (formulas.capacity)."""
  return formulas.capacity(dims.capacity_factor, t, dims.top_k, dims.n_experts)


def n_stats(dims: Dims) -> int:
  """Router statistics per sequence: E loads, the dropped share, the aux loss, the z-loss."""
  return dims.n_experts + 3


def route(logits_btE: jax.Array, k: int, norm: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(probs [b, t, E], top-k weights [b, t, k], their experts [b, t, k]) of fp32 router logits."""
  probs = jax.nn.softmax(logits_btE, axis=-1)
  w_btk, e_btk = jax.lax.top_k(probs, k)
  if norm:
    w_btk = w_btk / jnp.sum(w_btk, axis=-1, keepdims=True)
  return probs, w_btk, e_btk


def slots(e_btk: jax.Array, n_experts: int, cap: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(slot index [b, k*t] into [E*C + 1] (E*C: dropped), assignments per expert [b, E], dropped
  [b]) of each sequence's assignments ranked choice-major (see the module docstring)."""
  b, t, k = e_btk.shape
  e_bn = jnp.swapaxes(e_btk, 1, 2).reshape(b, k * t)  # choice-major: n = j*t + token
  onehot_bnE = jax.nn.one_hot(e_bn, n_experts, dtype=jnp.int32)
  rank_bn = jnp.sum((jnp.cumsum(onehot_bnE, axis=1) - 1) * onehot_bnE, axis=-1)
  kept_bn = rank_bn < cap
  slot_bn = jnp.where(kept_bn, e_bn * cap + rank_bn, n_experts * cap)
  return slot_bn, jnp.sum(onehot_bnE, axis=1), jnp.sum(~kept_bn, axis=1)


def router_stats(
  logits_gtE: jax.Array,
  probs_gtE: jax.Array,
  counts_gE: jax.Array,
  row_counts_gE: jax.Array,
  dropped_g: jax.Array,
  k: int,
  t_row: int,
) -> jax.Array:
  """[g, E + 3] (fp32): each share's part of its row's loads (share of the row's t_row*k
  assignments), dropped share, aux loss and z-loss, the parts summing to the row's statistics (one
  share: the row itself). The aux loss's part takes the whole row's counts (`row_counts_gE`, no
  gradient) times this share's probabilities, so it is linear in the shares, as the others."""
  n_experts = logits_gtE.shape[2]
  counts, row_counts = counts_gE.astype(jnp.float32), row_counts_gE.astype(jnp.float32)
  aux_g = n_experts * jnp.sum(row_counts / t_row * jnp.sum(probs_gtE, axis=1) / t_row, axis=-1)
  z_g = jnp.sum(jnp.square(jax.nn.logsumexp(logits_gtE, axis=-1)), axis=-1) / t_row
  dropped = dropped_g.astype(jnp.float32) / (t_row * k)
  loads = counts / (t_row * k)
  return jnp.concatenate([loads, dropped[:, None], aux_g[:, None], z_g[:, None]], axis=-1)


def stats_rows() -> int:
  """The router statistics' positions a training row carries here: one per cp rank, at the end of
  its own tokens (each rank's share of the row's statistics: jax3d/parallel/context.py's layout),
  or one where cp is manual (this rank's) or absent."""
  return 1 if context.manual() else context.cp_size()


def join_stats(x_btd: jax.Array, acc_bnd: jax.Array) -> jax.Array:
  """[b, t, d] and the n statistics' rows [b, n, d] -> [b, t + n, d], each row after its cp rank's
  t/n tokens (n = 1: after the row)."""
  b, t, d = x_btd.shape
  n = acc_bnd.shape[1]
  x = jnp.concatenate([x_btd.reshape(b, n, t // n, d), acc_bnd[:, :, None].astype(x_btd.dtype)], axis=2)
  return x.reshape(b, t + n, d)


def split_stats(x_btd: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The inverse of `join_stats` (n = `stats_rows`): ([b, t, d], [b, n, d])."""
  n = stats_rows()
  b, tn, d = x_btd.shape
  x = x_btd.reshape(b, n, tn // n, d)
  return x[:, :, :-1].reshape(b, tn - n, d), x[:, :, -1]


def _swiglu_experts(x_becd: jax.Array, gu_Ed2f: jax.Array, down_Efd: jax.Array, dtype: Any) -> jax.Array:
  """Every expert's SwiGLU on its slots: [b, E, C, d] -> [b, E, C, d] (fp32 inside, `dtype` out)."""
  gu = jnp.einsum('becd,edgf->becgf', x_becd.astype(dtype), gu_Ed2f.astype(dtype))
  h = (nn.silu(gu[..., 0, :].astype(jnp.float32)) * gu[..., 1, :].astype(jnp.float32)).astype(dtype)
  return jnp.einsum('becf,efd->becd', h, down_Efd.astype(dtype))


def _swiglu_experts_vjp(
  x_becd: jax.Array, gu_Ed2f: jax.Array, down_Efd: jax.Array, g_becd: jax.Array, dtype: Any
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The gradients of `_swiglu_experts` with respect to its slots and weights, written out (the
  expert-parallel backward region runs it: jax3d/parallel/expert.py), in the operands' dtypes."""
  x, w_gu, w_down = x_becd.astype(dtype), gu_Ed2f.astype(dtype), down_Efd.astype(dtype)
  gu = jnp.einsum('becd,edgf->becgf', x, w_gu).astype(jnp.float32)
  gate, up = gu[..., 0, :], gu[..., 1, :]
  sig = jax.nn.sigmoid(gate)
  h = (gate * sig * up).astype(dtype)
  g = g_becd.astype(dtype)
  d_down = jnp.einsum('becf,becd->efd', h, g)
  dh = jnp.einsum('becd,efd->becf', g, w_down).astype(jnp.float32)
  d_gate = dh * up * (sig + gate * sig * (1 - sig))  # silu'(g) = s + g s (1 - s)
  d_gu = jnp.stack([d_gate, dh * gate * sig], axis=-2).astype(dtype)
  d_x = jnp.einsum('becgf,edgf->becd', d_gu, w_gu)
  d_w_gu = jnp.einsum('becd,becgf->edgf', x, d_gu)
  return d_x.astype(x_becd.dtype), d_w_gu.astype(gu_Ed2f.dtype), d_down.astype(down_Efd.dtype)


def dispatch_combine(
  x_btd: jax.Array,
  w_btk: jax.Array,
  slot_bn: jax.Array,
  gu_Ed2f: jax.Array,
  down_Efd: jax.Array,
  cap: int,
  dtype: Any,
) -> jax.Array:
  """sum_k w_k expert_{e_k}(x) of each token [b, t, d]: scatter into the experts' slots, the experts
  (over ep by all-to-all where the mesh has it), gather back."""
  b, t, d = x_btd.shape
  n_experts, k = gu_Ed2f.shape[0], w_btk.shape[-1]
  x_bnd = jnp.tile(x_btd, (1, k, 1))  # choice-major, as slot_bn

  def scatter(x_nd, slot_n):
    return jnp.zeros((n_experts * cap + 1, d), x_nd.dtype).at[slot_n].add(x_nd)

  buf = jax.vmap(scatter)(x_bnd, slot_bn)[:, :-1].reshape(b, n_experts, cap, d)
  run = lambda x, gu, down: _swiglu_experts(x, gu, down, dtype)
  run_vjp = lambda x, gu, down, g: _swiglu_experts_vjp(x, gu, down, g, dtype)
  y_becd = expert.exchange(run, run_vjp, buf, gu_Ed2f, down_Efd)
  y_bsd = jnp.concatenate([y_becd.reshape(b, n_experts * cap, d), jnp.zeros((b, 1, d), y_becd.dtype)], 1)
  y_bnd = jnp.take_along_axis(y_bsd, slot_bn[..., None], axis=1)  # the dropped read the zero slot
  w_bn = jnp.swapaxes(w_btk, 1, 2).reshape(b, k * t, 1).astype(jnp.float32)
  return jnp.sum((y_bnd.astype(jnp.float32) * w_bn).reshape(b, k, t, d), axis=1)


class MoeMlp(nn.Module):
  """The mixture-of-experts MLP of one layer on its normed input [b, t, d]: returns (y [b, t, d]
  in `dims.dtype`, router statistics [b, n, E + 3] fp32: each cp share's part, `router_stats`).
  With the sequence split over cp (n = context.shares(t) shares of t/n tokens each in the
  compiler's view; this rank's own t where cp is manual) each share is a capacity group."""

  dims: Dims

  @nn.compact
  def __call__(self, m_btd: jax.Array) -> tuple[jax.Array, jax.Array]:
    dm = self.dims
    b, t, d = m_btd.shape
    n_experts, f = dm.n_experts, dm.expert_ff
    init = lambda names, std: nn.with_logical_partitioning(nn.initializers.normal(std), names)
    router = self.param('router', init(('embed', 'router'), 0.02), (d, n_experts), dm.param_dtype)
    gu = self.param(
      'experts_gate_up',
      init(('experts', 'embed', 'gate_up', 'mlp'), 0.02),
      (n_experts, d, 2, f),
      dm.param_dtype,
    )
    down_std = 0.02 / math.sqrt(2 * dm.n_layers)
    down = self.param(
      'experts_down', init(('experts', 'mlp', 'embed'), down_std), (n_experts, f, d), dm.param_dtype
    )
    n = context.shares(t)
    # [b, t, ...] -> the shares [n*b, t/n, ...], cp-major as context.rows (rows over cp, dp, ep)
    group = lambda a: (
      a.reshape(b, n, t // n, *a.shape[2:]).swapaxes(0, 1).reshape(n * b, t // n, *a.shape[2:])
    )
    logits = jnp.einsum('btd,dE->btE', m_btd.astype(jnp.float32), router.astype(jnp.float32))
    probs, w_gtk, e_gtk = route(group(logits), dm.top_k, dm.norm_topk_prob)
    cap = capacity(dm, t // n)
    slot_gn, counts_gE, dropped_g = slots(e_gtk, n_experts, cap)
    y_gtd = dispatch_combine(group(m_btd), w_gtk, slot_gn, gu, down, cap, dm.dtype)
    y_btd = y_gtd.reshape(n, b, t // n, d).swapaxes(0, 1).reshape(b, t, d)
    if dm.d_shared:
      y_btd = y_btd + self._shared(m_btd)
    row_counts = jnp.tile(context.row_sum(counts_gE.reshape(n, b, n_experts).swapaxes(0, 1)), (n, 1))
    stats = router_stats(
      group(logits), probs, counts_gE, row_counts, dropped_g, dm.top_k, context.row_tokens(t)
    )
    return y_btd.astype(dm.dtype), stats.reshape(n, b, -1).swapaxes(0, 1)

  def _shared(self, m_btd: jax.Array) -> jax.Array:
    """The shared expert every token goes through: a SwiGLU of d_shared (tp splits its hidden)."""
    dm = self.dims
    d, f = m_btd.shape[-1], dm.d_shared
    init = lambda names, std: nn.with_logical_partitioning(nn.initializers.normal(std), names)
    gu = self.param('shared_gate_up', init(('embed', 'gate_up', 'mlp'), 0.02), (d, 2, f), dm.param_dtype)
    down_std = 0.02 / math.sqrt(2 * dm.n_layers)
    down = self.param('shared_down', init(('mlp', 'embed'), down_std), (f, d), dm.param_dtype)
    g = jnp.einsum('btd,dgf->btgf', m_btd.astype(dm.dtype), gu.astype(dm.dtype))
    h = (nn.silu(g[..., 0, :].astype(jnp.float32)) * g[..., 1, :].astype(jnp.float32)).astype(dm.dtype)
    return jnp.einsum('btf,fd->btd', h, down.astype(dm.dtype)).astype(jnp.float32)
