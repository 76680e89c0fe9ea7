"""The loss of a batch and its gradients over the run's layout: `loss_sum` (sum(w * CE) of one
accumulation chunk), `loss_and_grads` (the weighted mean over the global batch, its gradient summed
over dp), and the model's forward as training runs it (`hidden`, `logits`). The step that applies
the gradients: jax3d/step.py.

Data flow (`loss_sum`):
  tokens [B, T] (batch over dp*pp) -> embed (vocab-parallel) -> pipeline.apply: micro-batches
  through the stages over pp (tp inside each stage) -> head (batch over dp*pp, vocab over tp)
  -> vocab-parallel cross-entropy. The gradients are summed over dp by the compiler, or by hand
  (jax3d/parallel/data_parallel.py) for ZeRO-1 and 16-/8-bit reductions. `train.grad_accum`
  chunks run sequentially in a scan, their gradients summed.

Every function takes the run's `Setup` (jax3d/assemble.py), which holds the config, plan, mesh,
model dims, optimizer, logical rules and the shardings, computed once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from jax3d.model import llama, lora, moe
from jax3d.parallel import context, data_parallel, microbatch, pipeline, sharding

if TYPE_CHECKING:
  from jax3d.setup import Setup

Batch = dict[str, jax.Array]
# Per-row arrays the layers read: documents' segment ids and positions, LoRA dropout's words.
DOC_KEYS = ('segment_ids', 'positions', lora.NOISE)


def loss_sum(
  params: Any, batch: Batch, s: Setup, manual: bool = False, norm: jax.Array | None = None
) -> jax.Array:
  """sum(w * CE) of one accumulation chunk: `batch` holds inputs and targets [b, t], and optionally
  weights (None: 1) and DOC_KEYS (without: one causal sequence per row). `manual`: traced inside
  data_parallel's shard_map (manual over dp and pp): the rows are this device's, the layers this
  stage's, and the sum is this device's share (summed over dp and pp by the caller). With `norm`
  (training: the global batch's weight sum) and a mixture of experts, plus norm times the router
  losses' share of these rows (`router_loss`)."""
  if manual:
    batch = {k: microbatch.local_rows(v, s.plan) for k, v in batch.items()}
  elif s.zero3:  # ZeRO-3: the weights outside the loop (embedding, head, norm) gathered before use
    params = gathered_outside_loop(params, s)
  if not manual:  # mesh.cp > 1: each row in the cp layout (the explicit path's arrive laid out)
    batch = context.lay_out(batch, s.plan.cp)
  if pipeline.in_loop_loss(s.cfg.pipeline.schedule, s.plan):  # 1F1B: the head and loss in the loop
    return _pipelined_loss_sum(params, batch, s, manual, norm)
  doc = {k: batch[k] for k in DOC_KEYS if k in batch}
  y_btd = _layers(params, llama.embed_apply(s.dims, params, batch['inputs']), s, manual, doc)
  return _head_loss_sum(params, y_btd, batch, s, norm)


def gathered_outside_loop(params: Any, s: Setup) -> Any:
  """ZeRO-3: every parameter but the stacked layers (which the loop gathers, zero3.Gather) in the
  layers' own layout: one all-gather over dp each, whose transpose reduce-scatters the gradient.
  Left to propagation, the embedding's dp-sharded d_model reaches its output and XLA replicates
  the activations to reshard them."""
  gather = lambda k, v: v if k == 'layers' else jax.lax.with_sharding_constraint(v, s.compute_shardings[k])
  return {k: gather(k, v) for k, v in params.items()}


def _head_loss_sum(
  head: Any, y_btd: jax.Array, side: Batch, s: Setup, norm: jax.Array | None = None
) -> jax.Array:
  """sum(w * CE) of the head over the last layer's output, in train.loss_chunks pieces (or fewer
  that divide 1F1B's 1/pp of the positions): the one head and loss of both schedules; with a
  mixture of experts the output's last position is the router statistics' row (taken off here),
  and with `norm` the router losses join (`router_loss`)."""
  y_btd, acc_bs = _split_stats_row(s, y_btd)
  chunks = math.gcd(s.cfg.train.loss_chunks, y_btd.shape[1])
  ce = llama.head_loss_sum(s.dims, head, y_btd, side['targets'], side.get('weights'), chunks)
  return ce if acc_bs is None or norm is None else ce + norm * router_loss(head, acc_bs, s)


def router_loss(head: Any, acc_bs: jax.Array, s: Setup) -> jax.Array:
  """The router losses' share of these rows: (aux_loss_coef * sum of the rows' load-balancing
  losses + z_loss_coef * sum of their z-losses) / (global batch * layers), so the whole batch's is
  the mean over sequences and layers on every layout; plus the statistics' sum times the zero
  probe (llama.STATS_PROBE), which adds nothing but whose gradient is that sum over every row
  (summed over dp, micro-batches and accumulation chunks as every gradient is: `router_metrics`)."""
  e, m = s.dims.n_experts, s.cfg.moe
  tot_s = jnp.sum(acc_bs, axis=0)
  per = s.plan.global_batch * s.dims.n_layers
  losses = (m.aux_loss_coef * tot_s[e + 1] + m.z_loss_coef * tot_s[e + 2]) / per
  return losses + jnp.dot(tot_s, head['head'][llama.STATS_PROBE])


def router_metrics(grads: Any, s: Setup) -> tuple[Any, dict[str, jax.Array]]:
  """(grads with the probe's zeroed, the router statistics of the step): each expert's share of the
  token assignments (`moe_load`, mean over layers), the dropped share (`moe_dropped`), the
  load-balancing and z losses (mean over sequences and layers, before their coefficients). None
  without a mixture of experts, or with LoRA (the head, and its probe, frozen)."""
  head = grads.get('head', {}) if isinstance(grads, dict) else {}
  if not s.dims.n_experts or llama.STATS_PROBE not in head:
    return grads, {}
  e, per = s.dims.n_experts, s.plan.global_batch * s.dims.n_layers
  mean = head[llama.STATS_PROBE] / per
  grads = {**grads, 'head': {**head, llama.STATS_PROBE: jnp.zeros_like(head[llama.STATS_PROBE])}}
  return grads, {
    'moe_load': mean[:e],
    'moe_dropped': mean[e],
    'moe_aux_loss': mean[e + 1],
    'moe_z_loss': mean[e + 2],
  }


def _with_stats_row(s: Setup, x_btd: jax.Array) -> jax.Array:
  """x with more positions, zero, for the router statistics the layers add (mixture of experts):
  one per cp rank (moe.join_stats)."""
  if not s.dims.n_experts:
    return x_btd
  return moe.join_stats(x_btd, jnp.zeros_like(x_btd[:, : moe.stats_rows()]))


def _split_stats_row(s: Setup, y_btd: jax.Array) -> tuple[jax.Array, jax.Array | None]:
  """(the layers' output, the router statistics [b, S] fp32 (the cp ranks' rows summed) or None)."""
  if not s.dims.n_experts:
    return y_btd, None
  y_btd, acc_bnd = moe.split_stats(y_btd)
  return y_btd, jnp.sum(acc_bnd[..., : moe.n_stats(s.dims)].astype(jnp.float32), axis=1)


def _pipelined_loss_sum(
  params: Any, batch: Batch, s: Setup, manual: bool, norm: jax.Array | None
) -> jax.Array:
  """embed -> the 1F1B pipeline, with the head and loss of each micro-batch inside (split over pp),
  from its per-row side inputs (every [B, T] array but the inputs; the layers read DOC_KEYS)."""
  head = {k: params[k] for k in ('head', 'embed') if k == 'head' or s.dims.tie_embeddings}  # what it reads

  x_btd = _with_stats_row(s, llama.embed_apply(s.dims, params, batch['inputs']))
  return pipeline.loss(
    _block_fn(s, batch['inputs'].shape[1]),
    params['layers'],
    head,
    x_btd,
    {k: v for k, v in batch.items() if k != 'inputs'},
    lambda head, y_btd, side: _head_loss_sum(head, y_btd, side, s, norm),
    mesh=s.mesh,
    plan=s.plan,
    rules=s.rules,
    policy=s.cfg.train.remat,
    manual=manual,
    gather=None if manual else s.gather,
  )


def _block_fn(s: Setup, seq_len: int) -> Callable:
  """One layer as the pipeline runs it: (layer params, x, side) -> x (rows [b*t, d] under SP), with
  its micro-batch's segment ids and positions from `side` when it has them."""
  sp_len = seq_len // s.plan.cp if s.plan.sequence_parallel else None  # a cp rank's own tokens (cp manual)

  def layer(p, h, side):
    noise = (side[lora.NOISE], lora.layer_salt(p)) if lora.NOISE in side else None  # training only
    ids, pos = side.get('segment_ids'), side.get('positions')
    stats = bool(s.dims.n_experts)  # the router statistics' row rides at the end of x
    return llama.block_apply(s.dims, p, h, pos, seq_len=sp_len, segment_ids=ids, noise=noise, stats_row=stats)

  return layer


def logits(
  params: Any, tokens_bt: jax.Array, s: Setup, manual: bool = False, doc: Batch | None = None
) -> jax.Array:
  """fp32 logits [b, t, v_padded] (vocab over tp), as training computes them (the loss is their
  cross-entropy). `doc`: DOC_KEYS arrays [b, t] of rows of documents, or none."""
  head = lambda toks, d: llama.head_apply(s.dims, params, hidden(params, toks, s, manual, d))
  return context.in_layout(head, tokens_bt, doc, s.plan.cp)  # cp > 1: in the cp layout and back


def hidden(
  params: Any, tokens_bt: jax.Array, s: Setup, manual: bool = False, doc: Batch | None = None
) -> jax.Array:
  """The last layer's output [b, t, d] (embed -> the pipeline), what the head reads."""
  x_btd = llama.embed_apply(s.dims, params, tokens_bt)
  return _split_stats_row(s, _layers(params, x_btd, s, manual, doc))[0]


def _layers(params: Any, x_btd: jax.Array, s: Setup, manual: bool, doc: Batch | None) -> jax.Array:
  """The embedded batch through the pipeline (with the router statistics' row of a mixture of
  experts, `_with_stats_row`: [b, t + 1, d] out)."""
  seq_len = x_btd.shape[1]
  x_btd = _with_stats_row(s, x_btd)
  return pipeline.apply(
    _block_fn(s, seq_len),
    params['layers'],
    x_btd,
    doc or None,
    mesh=s.mesh,
    plan=s.plan,
    rules=s.rules,
    policy=s.cfg.train.remat,
    manual=manual,
    gather=None if manual else s.gather,  # the explicit path gathers at its own entry
  )


def accumulate(
  grad_fn: Callable, params: Any, batch: Batch, a: int, first_outside: bool = False
) -> tuple[jax.Array, Any]:
  """(loss, grads) of `grad_fn(params, chunk)` summed over `a` accumulation chunks of the batch (every
  key's rows), in a scan (chunk i = rows i, i+a, ...: local to each dp shard). The sum starts from
  zeros, or with `first_outside` from chunk 0 computed before the scan: inside a shard_map the
  accumulator must vary over the same manual axes as the loss, which depends on the layout (the
  same sum: 0 + x = x)."""
  if a == 1:
    return grad_fn(params, batch)

  def body(acc, chunk):
    return jax.tree.map(jnp.add, acc, grad_fn(params, chunk)), None

  xs = {k: microbatch.microbatches(v, a) for k, v in batch.items()}
  if first_outside:
    first = {k: v[0] for k, v in xs.items()}
    rest = {k: v[1:] for k, v in xs.items()}
    return jax.lax.scan(body, grad_fn(params, first), rest)[0]
  zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
  return jax.lax.scan(body, zeros, xs)[0]


def weight_sum(batch: Batch) -> jax.Array:
  """The loss's normaliser: the batch's weight sum (token count without weights), kept from 0."""
  if 'weights' not in batch:
    return jnp.float32(batch['inputs'].size)
  return jnp.maximum(jnp.sum(batch['weights'], dtype=jnp.float32), jnp.finfo(jnp.float32).tiny)


def loss_and_grads(params: Any, batch: Batch, residual: Any, s: Setup) -> tuple[jax.Array, Any, Any]:
  """The weighted mean token loss of the global batch, sum(w * CE) / sum(w), its gradient summed
  over dp, and the new int8 residual. sum(w) is the global batch's, computed once here: every
  micro-batch, accumulation chunk and dp shard divides by the same number, so the loss and its
  gradient are the same on every layout."""
  norm = weight_sum(batch)  # global
  params, frozen = lora.trainable(s.dims, params)  # LoRA: only the adapters are differentiated
  if not s.explicit_dp:
    grad_fn = jax.value_and_grad(lambda p, b: loss_sum(lora.merge(p, frozen), b, s, norm=norm) / norm)
    return (*accumulate(grad_fn, params, batch, s.plan.grad_accum), residual)

  def local_grads(params, frozen, batch, norm):  # one device's rows: dp and pp are manual here
    grad_fn = jax.value_and_grad(
      lambda p, b: loss_sum(lora.merge(p, frozen), b, s, manual=True, norm=norm) / norm
    )
    with sharding.use_rules(sharding.without_dp_pp(s.rules)):
      return accumulate(grad_fn, params, batch, s.plan.grad_accum, first_outside=True)

  compute = lora.trainable(s.dims, s.compute_shardings)
  zero = lora.trainable(s.dims, s.zero_shardings)
  return data_parallel.value_and_grad(
    local_grads,
    params,
    context.lay_out(batch, s.plan.cp),  # each device its rows' own tokens there (manual over cp)
    residual,
    norm,
    mesh=s.mesh,
    params_sh=compute[0],
    grads_sh=zero[0] if s.zero1 else compute[0],
    dtype=s.cfg.train.grad_reduce_dtype,
    shard=s.zero1,
    gather=s.zero3,
    frozen=(frozen, compute[1], zero[1]),
  )
