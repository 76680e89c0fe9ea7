"""Memory per device of one layout, from the published formulas (Megatron-LM; Korthikanti et al.
for activations), modelling what jax3d's step really does:

  - parameters, gradients and AdamW's m and v in `train.param_dtype`; layer weights split over
    pp (the stacked layer axis) and tp; embedding and head over tp only (replicated over dp, pp);
    the vocabulary padded to `model.vocab_multiple`; Adam moments over dp too with
    `train.shard_optimizer` (ZeRO-1).
  - gradients held twice for the stage's layers (three times with `grad_accum > 1`: the
    accumulator): the pipeline loop's carry, and each iteration's fresh gradient of the
    loop-invariant stage weights (JAX's transpose of a scan's constant operand) added into it.
    `python -m jax3d.plan --verify` checks this against XLA's figure.
  - activations of the SPMD GPipe pipeline (jax3d/parallel/pipeline/__init__.py): its scan keeps the
    residuals of every one of its v*m+p-1 iterations (bubble iterations included) for the backward
    pass. What one layer keeps is read off the real layer (`jax.ad_checkpoint` residuals of
    `jax3d.model.layers.Block` at the tp-local shapes, under the remat policy), so it follows the
    code, GQA and SwiGLU included; it agrees with Korthikanti's s*b*h*(10 + 24/t + 5*a*s/(h*t))
    where the layer is Megatron's. With remat 'stage' it counts m+1 micro-batches per iteration (its
    input and, with pp > 1, a stage-0 queue of m): an upper bound, since the compiled loop saves the
    iteration's input only (the queue, where v > 1, is a carry updated in place). Under 1F1B
    (pipeline.schedule=1f1b) a stash of chunk inputs bounded by the stages instead
    (`_activations_1f1b`), whatever the number of micro-batches.
  - LoRA (lora.rank > 0): the base in lora.base_dtype, gradients and moments of the adapters only.
  - the head: fp32 logits, their exp and the one-hot targets (vocab over tp), and the embedding's
    output, for the rows outside the pipeline's loop; the logits for 1/train.loss_chunks of them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from jax3d.config import RunPlan
from jax3d.model import formulas
from jax3d.parallel.pipeline import schedule_1f1b
from jax3d.planning.hardware import BYTES

if TYPE_CHECKING:
  import ml_collections

  from jax3d.model.dims import Dims


# ---------------------------------------------------------------------------------------------
# What one layer keeps for the backward pass, read off the real layer.
# ---------------------------------------------------------------------------------------------
def layer_residual_bytes(
  d_model: int,
  n_heads: int,
  n_kv_heads: int,
  d_ff: int,
  seq: int,
  tp: int,
  policy: str,
  compute: str,
  param: str,
  flash: bool,
  batch: int,
  sequence_parallel: bool = False,
  features: tuple[int, bool, bool] = (0, False, False),
) -> float:
  """Bytes one tp shard of one layer keeps for its backward pass, its input included (`features`:
  model.head_dim, 0 = d_model / n_heads, model.qkv_bias, model.qk_norm). Its weights
  count only under remat 'none': under a checkpoint they are sliced again from the loop-invariant
  stack in the backward pass (jax3d/parallel/pipeline/chunk.py `run_layers`); without one, XLA keeps
  the per-iteration weight values the layer computes from them (reshapes, casts). Linear in the
  rows: traced at 1 and 2 rows.

  With `sequence_parallel` the residual stream (what is [rows, d_model]: the input, the RMSNorm
  outputs, the residual adds, the row-parallel outputs) is split over tp. Read off the same layer:
  of the bytes per row, the stream's are the ones that grow with d_model (the tp shard's heads,
  head size and d_ff held fixed), so a trace at twice d_model measures them."""
  head_dim, qkv_bias, qk_norm = features
  trace = lambda b, d: _traced_residuals(
    d,
    n_heads,
    n_kv_heads,
    d_ff,
    seq,
    tp,
    policy,
    compute,
    param,
    flash,
    b,
    (head_dim or d_model // n_heads, qkv_bias, qk_norm),
  )
  one, two = trace(1, d_model), trace(2, d_model)
  total = one + (batch - 1) * (two - one)
  if not sequence_parallel or tp == 1:
    return total
  stream_per_row = (trace(2, 2 * d_model) - trace(1, 2 * d_model)) - (two - one)
  return total - batch * stream_per_row * (1 - 1 / tp)


@functools.cache
def _traced_residuals(
  d_model, n_heads, n_kv_heads, d_ff, seq, tp, policy, compute, param, flash, batch, features
) -> float:
  """The residuals of the real layer at abstract shapes (nothing is computed or allocated).
  XLA's attention keeps the s x s scores; a fused (flash) kernel keeps a logsumexp instead."""
  import flax.linen as nn
  import jax

  from jax3d.model import dims as dims_lib, layers
  from jax3d.parallel import remat

  head_dim, qkv_bias, qk_norm = features
  dims = dims_lib.Dims(  # one tp shard: n/tp heads of the full head size
    n_layers=1,
    d_model=d_model,
    n_heads=n_heads // tp,
    n_kv_heads=n_kv_heads // tp,
    d_ff=d_ff // tp,
    vocab_size=1,
    vocab_padded=1,
    dtype=np.dtype(compute),
    param_dtype=np.dtype(param),
    head_size=head_dim,
    qkv_bias=qkv_bias,
    qk_norm=qk_norm,
  )
  x = jax.ShapeDtypeStruct((batch, seq, d_model), dims.dtype)
  block = layers.Block(dims)
  params = jax.eval_shape(lambda x: nn.unbox(block.init(jax.random.key(0), x)['params']), x)
  fn = remat.wrap_layer(lambda h, p: (block.apply({'params': p}, h), None), policy)
  res = _saved_residuals(lambda p, h: fn(h, p)[0].astype(np.float32).sum(), params, x, policy != 'none')
  # XLA's scores and masks are [b, heads or 1, (g,) s, s]; a [b, s, d] activation is not one, also
  # where d_model = seq (Llama 3 70B at 8K: 8192 both; counting it as a score dropped the layer's input)
  scores = lambda a: len(a.shape) >= 4 and a.shape[-2:] == (seq, seq)
  kept = [a for a in res if not (flash and scores(a))]
  lse = batch * (n_heads // tp) * seq * 4 if flash else 0
  # where the policy keeps attention's internals, cuDNN's custom VJP keeps its inputs, the documents'
  # bias [b, 1, s, s] in the compute dtype among them (jax3d/model/attention.py)
  bias = batch * seq * seq * np.dtype(compute).itemsize if flash and any(scores(a) for a in res) else 0
  return float(sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in kept) + lse + bias)


def _saved_residuals(f, p, h, drop_weights: bool) -> list:
  """The abstract values (shape, dtype) that reverse-mode differentiation of `f(p, h)` keeps
  (less the weights `p` themselves when `drop_weights`).

  jax's public API only prints this list (`jax.ad_checkpoint.print_saved_residuals`, as text);
  the function that returns it lives in jax's private modules, so this is the one place that
  imports it.
  """
  from jax._src.ad_checkpoint import saved_residuals

  res = saved_residuals(f, p, h)
  return [aval for aval, src in res if not (drop_weights and src.startswith('from the argument p['))]


# ---------------------------------------------------------------------------------------------
# Bytes per device
# ---------------------------------------------------------------------------------------------
def model_dims(cfg: ml_collections.ConfigDict, plan: RunPlan | None = None) -> Dims:
  from jax3d.model import dims as dims_lib  # imported when needed: jax is heavy

  return dims_lib.Dims.from_config(cfg, plan)


def local_params(cfg: ml_collections.ConfigDict, plan: RunPlan) -> dict:
  """Parameters held by one device: layer matrices over pp*tp, norms over pp, embed/head over tp."""
  dims = model_dims(cfg, plan)
  return {
    'layers': dims.n_layers // plan.pp * formulas.layer_params(dims, plan.tp),
    'embed_head': formulas.embed_head_params(dims, plan.tp, padded=True),
  }


def lora_local_params(cfg: ml_collections.ConfigDict, plan: RunPlan) -> float:
  """LoRA adapter parameters held by one device (0 without LoRA): the layers' over pp, part over tp."""
  dims = model_dims(cfg, plan)
  return dims.n_layers // plan.pp * formulas.lora_layer_params(dims, plan.tp)


def micro_rows(plan: RunPlan) -> int:
  """Rows of one micro-batch on one device."""
  return plan.micro_batch // plan.dp


def micro_activation_bytes(cfg: ml_collections.ConfigDict, plan: RunPlan) -> float:
  """One micro-batch's activation [b, s, h] on one device, in the compute dtype."""
  return micro_rows(plan) * plan.seq_len * cfg.model.d_model * BYTES[cfg.train.compute_dtype]


def activation_bytes(cfg: ml_collections.ConfigDict, plan: RunPlan, flash: bool) -> float:
  """What the pipeline's loop keeps for the backward pass, plus one layer recomputed in it."""
  m, t = cfg.model, cfg.train
  lc = m.n_layers // (plan.pp * plan.repeats)  # layers per chunk: what one pipeline iteration runs
  res = functools.partial(
    layer_residual_bytes,
    m.d_model,
    m.n_heads,
    m.n_kv_heads,
    m.d_ff,
    plan.seq_len,
    plan.tp,
    compute=t.compute_dtype,
    param=t.param_dtype,
    flash=flash,
    batch=micro_rows(plan),
    sequence_parallel=plan.sequence_parallel,
    features=(m.head_dim, m.qkv_bias, m.qk_norm),
  )
  if one_f_one_b(cfg, plan):
    return _activations_1f1b(cfg, plan, lc, res)
  if t.remat != 'stage':
    # under ZeRO-3's layer gather, 'none' keeps what 'dots' keeps (jax3d/parallel/zero3.py)
    kept = 'dots' if t.remat == 'none' and gather_mode(cfg, plan) == 'layer' else t.remat
    return plan.iterations * lc * res(policy=kept) + res(policy='none')
  # 'stage': per iteration its carry (input and, with pp > 1, the stage-0 queue of m micro-batches),
  # plus one iteration recomputed in the backward pass
  sp = plan.tp if plan.sequence_parallel else 1  # the loop's micro-batches are split over tp with SP
  carry = plan.microbatches + 1 if plan.pp > 1 else 1
  act_mb = micro_activation_bytes(cfg, plan)
  return plan.iterations * carry * act_mb / sp + lc * res(policy='full') + res(policy='none')


def one_f_one_b(cfg: ml_collections.ConfigDict, plan: RunPlan) -> bool:
  """pipeline.schedule=1f1b with stages (jax3d/parallel/pipeline/__init__.py `in_loop_loss`)."""
  return cfg.pipeline.schedule == '1f1b' and plan.pp > 1


def _activations_1f1b(cfg: ml_collections.ConfigDict, plan: RunPlan, lc: int, res: Callable) -> float:
  """1F1B (jax3d/parallel/pipeline/schedule_1f1b.py, one_f_one_b.py): the VJP residuals of the units in
  flight, min((v+1)p-1, v*m) slots (bounded by the stages, not the micro-batches), each a chunk's
  residuals under the policy on one micro-batch ('stage': its input only), one stash and one
  gradient slot, the loop's input and its gradient (fp32, the m micro-batches), and one layer's
  intermediates while a unit runs."""
  sp = plan.tp if plan.sequence_parallel else 1
  act_mb = micro_activation_bytes(cfg, plan) / sp
  slots = schedule_1f1b.residual_slots(plan.pp, plan.repeats, plan.microbatches)
  edges = 2 * plan.microbatches * act_mb * 4 / BYTES[cfg.train.compute_dtype]
  per_slot = act_mb if cfg.train.remat == 'stage' else lc * res(policy=cfg.train.remat)
  return slots * per_slot + 2 * act_mb + edges + res(policy='none')


def head_bytes(cfg: ml_collections.ConfigDict, plan: RunPlan) -> float:
  """fp32 logits of the head, their exp and the one-hot targets (vocab on tp), and the embedding out.
  Under 1F1B the head runs inside the loop on 1/pp of one micro-batch at a time. With
  train.loss_chunks the logits terms are for one piece of the sequence (a scan recomputes each
  piece's in the backward pass)."""
  dp_pp = plan.dp * plan.pp
  rows_all = plan.chunk_batch // (dp_pp if plan.chunk_batch % dp_pp == 0 else plan.dp)
  h, cb = cfg.model.d_model, BYTES[cfg.train.compute_dtype]
  head_rows = max(1, micro_rows(plan) // plan.pp) if one_f_one_b(cfg, plan) else rows_all
  logits = head_rows * 3 * 4 * plan.vocab_padded // plan.tp / cfg.train.loss_chunks
  return plan.seq_len * (logits + rows_all * 2 * h * cb)


def gather_mode(cfg: ml_collections.ConfigDict, plan: RunPlan) -> str | None:
  """ZeRO-3's gather, 'layer' or 'step' (None without ZeRO-3): data_parallel.gather_mode."""
  from jax3d.parallel import data_parallel  # imported when needed: jax is heavy

  return data_parallel.gather_mode(cfg, plan)


def breakdown(cfg: ml_collections.ConfigDict, plan: RunPlan, flash: bool) -> dict:
  """Bytes per device: params, grads, optimizer, activations, head; and under ZeRO-3
  (train.shard_params) what is gathered whole during the step ('gathered')."""
  t = cfg.train
  pb = BYTES[t.param_dtype]
  local = local_params(cfg, plan)
  n_local = sum(local.values())
  out = {
    'params': n_local * pb,
    # + the accumulator of gradient accumulation, and the pipeline loop's own: each iteration's
    # gradient of the stage's weights (JAX's transpose of the loop-invariant operand) is a fresh
    # buffer added into the loop's carry, so the stage's weight gradients are held twice.
    'grads': n_local * pb * (2 if plan.grad_accum > 1 else 1) + local['layers'] * pb,
    'optimizer': 2 * n_local * pb / (plan.dp if t.shard_optimizer else 1),
    'activations': activation_bytes(cfg, plan, flash),
    'head': head_bytes(cfg, plan),
  }
  mode = gather_mode(cfg, plan)
  if cfg.lora.rank:
    return out | _lora(cfg, plan, local, mode)
  return out if mode is None else out | _zero3(local, pb, plan, mode, cfg.model.n_layers)


def _lora(cfg: ml_collections.ConfigDict, plan: RunPlan, local: dict, mode: str | None) -> dict:
  """LoRA (jax3d/model/lora.py): the base in lora.base_dtype with no gradient or moments; the
  adapters' parameters, gradients (the loop's carry and each iteration's, as above, and the
  accumulator) and moments in train.param_dtype. Under ZeRO-3 everything stored is 1/dp and the
  base gathered as `_zero3` gathers it."""
  t = cfg.train
  pb, bb = BYTES[t.param_dtype], BYTES[cfg.lora.base_dtype or t.param_dtype]
  dims = model_dims(cfg, plan)
  adapters = lora_local_params(cfg, plan) * pb
  stored = (sum(local.values()) * bb + adapters) / (plan.dp if mode else 1)
  out = {
    'params': stored,
    'grads': adapters * (3 if plan.grad_accum > 1 else 2),
    'optimizer': 2 * adapters / (plan.dp if t.shard_optimizer or mode else 1),
  }
  if mode:
    layers = local['layers'] * bb / (dims.n_layers // plan.pp if mode == 'layer' else 1)
    out['gathered'] = layers + local['embed_head'] * bb
  return out


def _zero3(local: dict, pb: int, plan: RunPlan, mode: str, n_layers: int) -> dict:
  """ZeRO-3 (jax3d/parallel/zero3.py): parameters, their reduced gradients (and the accumulator)
  and Adam's moments stored 1/dp; what exists whole during the step by gather mode:
    'step'   the stage's layers and the embedding/head gathered ('gathered'); the gradients whole
             as without ZeRO-3 (the loop's carry and each iteration's fresh one), reduce-scattered
             to the slices after the loop.
    'layer'  one layer's weights and the embedding/head gathered; in the loop the gradient carry
             and each iteration's fresh one are slices, plus one layer's whole gradient before its
             reduce-scatter, and the embedding/head's whole gradient.
  (Under remat 'none' the layer gather keeps what 'dots' keeps, zero3.Gather.layer; the
  activations count 'none''s residuals: an upper bound there.)"""
  stored = sum(local.values()) * pb / plan.dp
  layers, shared = local['layers'] * pb, local['embed_head'] * pb
  slices = stored * (2 if plan.grad_accum > 1 else 1)
  if mode == 'step':
    grads, gathered = slices + layers + shared + layers, layers + shared
  else:
    one = layers / (n_layers // plan.pp)
    grads, gathered = slices + layers / plan.dp + shared + one, one + shared
  return {'params': stored, 'grads': grads, 'optimizer': 2 * stored, 'gathered': gathered}
