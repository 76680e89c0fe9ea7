"""Memory per device of one layout, from the published formulas (Megatron-LM; Korthikanti et al.
for activations), modelling what jax3d's step really does:

  - parameters, gradients and AdamW's m and v in `train.param_dtype`; layer weights split over
    pp (the stacked layer axis) and tp; embedding and head over tp only (replicated over dp, pp);
    the vocabulary padded to `model.vocab_multiple`; Adam moments over dp (x cp) too with
    `train.shard_optimizer` (ZeRO-1).
  - gradients held twice for the stage's layers (three times with `grad_accum > 1`: the
    accumulator): the pipeline loop's carry, and each iteration's fresh gradient of the
    loop-invariant stage weights (JAX's transpose of a scan's constant operand) added into it.
    `python -m jax3d.plan --verify` checks this against XLA's figure.
  - activations of the SPMD GPipe pipeline (jax3d/parallel/pipeline/__init__.py): its scan keeps the
    residuals of every one of its v*m+p-1 iterations (bubble iterations included) for the backward
    pass, and with v > 1 five stacks of its m micro-batches (`_gpipe_edges`). One layer's is read
    off the real layer (`jax.ad_checkpoint` residuals of `layers.Block` at the tp-local shapes,
    under the remat policy, with the attention kernel's; a mixture's MoE block as it is, its rows
    over dp*ep), so it follows the code; with XLA's attention, Korthikanti's
    s*b*h*(10 + 24/t + 5*a*s/(h*t)). With remat 'stage' it counts m+1
    micro-batches per iteration (its input and, with pp > 1, a stage-0 queue of m): an upper bound,
    since the compiled loop saves the iteration's input only (the queue, where v > 1, is a carry
    updated in place). Under 1F1B (pipeline.schedule=1f1b) a stash of chunk inputs bounded by the
    stages instead (`_activations_1f1b`), whatever the number of micro-batches.
  - LoRA (lora.rank > 0): the base in lora.base_dtype, the adapters' gradients and moments only.
  - the head: fp32 logits, their exp and the one-hot targets (vocab over tp), and the embedding's
    output, for the rows outside the pipeline's loop; the logits for 1/train.loss_chunks of them.
  - on a GPU, the optimizer update's own peak where it is the step's (`_update_peak`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from jax3d.config import RunPlan
from jax3d.model import formulas
from jax3d.parallel.pipeline import timetable
from jax3d.planning.hardware import BYTES
from jax3d.planning.residuals import layer_residual_bytes

if TYPE_CHECKING:
  from jax3d.config import Config
  from jax3d.model.dims import Dims

__all__ = ['layer_residual_bytes']  # re-exported: the cost model reads it here


# ---------------------------------------------------------------------------------------------
# Bytes per device
# ---------------------------------------------------------------------------------------------
def model_dims(cfg: Config, plan: RunPlan | None = None) -> Dims:
  from jax3d.model import dims as dims_lib  # imported when needed: jax is heavy

  return dims_lib.Dims.from_config(cfg, plan)


def local_params(cfg: Config, plan: RunPlan) -> dict:
  """Parameters held by one device: layer matrices over pp*tp (a mixture's experts over pp*tp*ep),
  norms over pp, embed/head over tp."""
  dims = model_dims(cfg, plan)
  return {
    'layers': dims.n_layers // plan.pp * formulas.layer_params(dims, plan.tp, ep=plan.ep),
    'embed_head': formulas.embed_head_params(dims, plan.tp, padded=True),
  }


def lora_local_params(cfg: Config, plan: RunPlan) -> float:
  """LoRA adapter parameters held by one device (0 without LoRA): the layers' over pp, part over tp."""
  dims = model_dims(cfg, plan)
  return dims.n_layers // plan.pp * formulas.lora_layer_params(dims, plan.tp)


def micro_rows(plan: RunPlan) -> int:
  """Rows of one micro-batch on one device: split over dp and ep (ep's devices are data parallel
  outside the experts)."""
  return plan.micro_batch // (plan.dp * plan.ep)


def micro_activation_bytes(cfg: Config, plan: RunPlan) -> float:
  """One micro-batch's activation [b, s, h] on one device (its 1/cp of the sequence), in the
  compute dtype."""
  return micro_rows(plan) * plan.seq_len // plan.cp * cfg.model.d_model * BYTES[cfg.train.compute_dtype]


def cp_gather_bytes(cfg: Config, plan: RunPlan) -> float:
  """mesh.cp > 1: one layer's K and V all-gathered over cp (the whole sequence, this device's KV
  heads), held while its attention runs, forward or backward (jax3d/model/cp_attention.py;
  cp_comm.kv_gather_bytes, docs/formulas.md)."""
  from jax3d.analysis import cp_comm

  m = cfg.model
  hd = m.head_dim or m.d_model // m.n_heads
  return cp_comm.cp_attention_bytes(plan, m.n_layers, m.n_kv_heads, hd, BYTES[cfg.train.compute_dtype])[
    'gathered'
  ]


def activation_bytes(cfg: Config, plan: RunPlan, flash: bool | str) -> float:
  """What the pipeline's loop keeps for the backward pass, plus one layer recomputed in it."""
  m, t = cfg.model, cfg.train
  lc = m.n_layers // (plan.pp * plan.repeats)  # layers per chunk: what one pipeline iteration runs
  res = functools.partial(
    layer_residual_bytes,
    m.d_model,
    m.n_heads,
    m.n_kv_heads,
    m.d_ff,
    plan.seq_len // plan.cp,  # a layer's own tokens (the K/V gathered over cp: cp_gather_bytes)
    plan.tp,
    compute=t.compute_dtype,
    param=t.param_dtype,
    flash=flash,
    batch=micro_rows(plan),
    sequence_parallel=plan.sequence_parallel,
    features=(m.head_dim, m.qkv_bias, m.qk_norm),
    moe=moe_features(cfg),
  )
  if one_f_one_b(cfg, plan):
    return _activations_1f1b(cfg, plan, lc, res)
  edges = _gpipe_edges(cfg, plan)
  if t.remat != 'stage':
    # under ZeRO-3's layer gather, 'none' keeps what 'dots' keeps (jax3d/parallel/zero3.py)
    kept = 'dots' if t.remat == 'none' and gather_mode(cfg, plan) == 'layer' else t.remat
    return plan.iterations * lc * res(policy=kept) + res(policy='none') + edges + cp_gather_bytes(cfg, plan)
  # 'stage': per iteration its carry (input and, with pp > 1, the stage-0 queue of m micro-batches),
  # plus one iteration recomputed in the backward pass
  sp = plan.tp if plan.sequence_parallel else 1  # the loop's micro-batches are split over tp with SP
  carry = plan.microbatches + 1 if plan.pp > 1 else 1
  act_mb = micro_activation_bytes(cfg, plan)
  return plan.iterations * carry * act_mb / sp + lc * res(policy='full') + res(policy='none') + edges


def moe_features(cfg: Config) -> tuple[int, int, int, int, float]:
  """What `layer_residual_bytes` reads of a mixture of experts (num_experts 0: dense)."""
  dims = model_dims(cfg)
  return (dims.n_experts, dims.top_k, dims.expert_ff, dims.d_shared, dims.capacity_factor)


def _gpipe_edges(cfg: Config, plan: RunPlan) -> float:
  """The circular loop's own stacks of m micro-batches (jax3d/parallel/pipeline/gpipe.py `circulate`, pp > 1,
  v > 1): its input, the stage-0 queue and the queue's gradient (fp32), and the finished outputs
  with their gradient (compute dtype). Read off the GPU compile (`plan --verify --target`): Llama 3
  70B at dp 2, pp 8, tp 4, m 16, v 5, remat full on 64 x H100 holds 3 fp32 and 2 bf16 such stacks
  (estimate 101.7 GB, XLA:GPU 99.95). With one chunk (v = 1) the scan's inputs and outputs are its
  xs and ys, which XLA:GPU places among what the estimate already counts (Llama 3 8B at pp 4, tp 2,
  m 8 on 8 x H100: 52.1 GB estimated without this term, 49.5 compiled): nothing more."""
  if plan.pp == 1 or plan.repeats == 1:
    return 0.0
  sp = plan.tp if plan.sequence_parallel else 1
  act = micro_activation_bytes(cfg, plan) / sp
  return plan.microbatches * act * (3 * 4 / BYTES[cfg.train.compute_dtype] + 2)


def one_f_one_b(cfg: Config, plan: RunPlan) -> bool:
  """pipeline.schedule=1f1b with stages: the loss inside the loop (timetable.in_loop_loss)."""
  return timetable.in_loop_loss(cfg.pipeline.schedule, plan)


def _activations_1f1b(cfg: Config, plan: RunPlan, lc: int, res: Callable) -> float:
  """1F1B (jax3d/parallel/pipeline/timetable.py, one_f_one_b.py): the VJP residuals of the units in
  flight, min((v+1)p-1, v*m) slots (bounded by the stages, not the micro-batches), each a chunk's
  residuals under the policy on one micro-batch ('stage': its input only), one stash and one
  gradient slot, the loop's input and its gradient (fp32, the m micro-batches), and one layer's
  intermediates while a unit runs."""
  sp = plan.tp if plan.sequence_parallel else 1
  act_mb = micro_activation_bytes(cfg, plan) / sp
  slots = timetable.residual_slots(plan.pp, plan.repeats, plan.microbatches)
  edges = 2 * plan.microbatches * act_mb * 4 / BYTES[cfg.train.compute_dtype]
  per_slot = act_mb if cfg.train.remat == 'stage' else lc * res(policy=cfg.train.remat)
  return slots * per_slot + 2 * act_mb + edges + res(policy='none')


def head_bytes(cfg: Config, plan: RunPlan) -> float:
  """fp32 logits of the head, their exp and the one-hot targets (vocab on tp), and the embedding out.
  Under 1F1B the head runs inside the loop on 1/pp of one micro-batch at a time. With
  train.loss_chunks the logits terms are for one piece of the sequence (a scan recomputes each
  piece's in the backward pass)."""
  rows_all = plan.chunk_batch // head_ranks(plan)
  h, cb = cfg.model.d_model, BYTES[cfg.train.compute_dtype]
  head_rows = max(1, micro_rows(plan) // plan.pp) if one_f_one_b(cfg, plan) else rows_all
  logits = head_rows * 3 * 4 * plan.vocab_padded // plan.tp / cfg.train.loss_chunks
  return plan.seq_len // plan.cp * (logits + rows_all * 2 * h * cb)


def head_ranks(plan: RunPlan) -> int:
  """Devices the batch outside the pipeline's loop (embedding, head, loss) is split over:
  microbatch.batch_axes' (dp*pp, dp, or with ep and no pipeline dp*ep)."""
  from jax3d.parallel import microbatch  # imported when needed: jax is heavy

  axes = microbatch.batch_axes(plan)
  size = {'dp': plan.dp, 'pp': plan.pp, 'ep': plan.ep}
  return math.prod(size[a] for a in ((axes,) if isinstance(axes, str) else axes))


def gather_mode(cfg: Config, plan: RunPlan) -> str | None:
  """ZeRO-3's gather, 'layer' or 'step' (None without ZeRO-3): data_parallel.gather_mode."""
  from jax3d.parallel import data_parallel  # imported when needed: jax is heavy

  return data_parallel.gather_mode(cfg, plan)


def breakdown(cfg: Config, plan: RunPlan, flash: bool | str, gpu: bool = True) -> dict:
  """Bytes per device: params, grads, optimizer, activations, head; and under ZeRO-3
  (train.shard_params) what is gathered whole during the step ('gathered'); on a GPU (`gpu`) what
  the optimizer's update holds beyond the backward pass's peak ('update', `_update_peak`)."""
  t = cfg.train
  pb = BYTES[t.param_dtype]
  flash = 'blockwise' if plan.cp > 1 else flash  # cp's attention is blockwise's (assemble.py)
  local = local_params(cfg, plan)
  n_local = sum(local.values())
  out = {
    'params': n_local * pb,
    # + the accumulator of gradient accumulation, and the pipeline loop's own: each iteration's
    # gradient of the stage's weights (JAX's transpose of the loop-invariant operand) is a fresh
    # buffer added into the loop's carry, so the stage's weight gradients are held twice. A loop
    # of one iteration (pp = 1, one micro-batch) is no loop to XLA: held once (Llama 3 8B at
    # dp 32, tp 2 on 64 x H100: XLA:GPU 67.7 GB, 84.6 estimated with the second copy, 70.6 without).
    'grads': n_local * pb * (2 if plan.grad_accum > 1 else 1) + _loop_copy(plan) * local['layers'] * pb,
    'optimizer': 2 * n_local * pb / (plan.zero_ranks if t.shard_optimizer else 1),
    'activations': activation_bytes(cfg, plan, flash),
    'head': head_bytes(cfg, plan),
  }
  mode = gather_mode(cfg, plan)
  if cfg.lora.rank:
    return out | _lora(cfg, plan, local, mode)
  out = out if mode is None else out | _zero3(local, pb, plan, mode, cfg.model.n_layers)
  return out | _update_peak(out) if gpu else out


def _update_peak(b: dict) -> dict:
  """XLA:GPU's optimizer update (not XLA:CPU's): the new parameters and Adam moments are made in
  temporaries beside one gradient (the reduced one; the accumulator and the loop's copies are
  gone), then copied into the donated outputs, so the step's other peak holds temporaries of
  parameters + gradient + parameters + moments. Where that exceeds the backward pass's
  (gradients, activations, head, gathered weights), the difference ('update'). Read off XLA:GPU's
  buffer assignment, temporaries exactly that at the peak: the 1B-shaped model at 64K tokens, cp 8
  on 8 x H100 (28.80 GiB compiled, 28.79 estimated with it, 23.70 without) and Llama 3 8B at
  dp 16, tp 4, ga 8, dots on 64 x H100 (56.22 GB compiled, 56.2 with it, 53.6 without)."""
  extra = (
    2 * b['params'] + b['optimizer'] - b['grads'] - b['activations'] - b['head'] - b.get('gathered', 0.0)
  )
  return {'update': extra} if extra > 0 else {}


def _loop_copy(plan: RunPlan) -> int:
  """1 where the pipeline's loop holds a second gradient of the stage's weights (more than one
  iteration), else 0."""
  return int(plan.iterations > 1)


def _lora(cfg: Config, plan: RunPlan, local: dict, mode: str | None) -> dict:
  """LoRA (jax3d/model/lora.py): the base in lora.base_dtype with no gradient or moments; the
  adapters' parameters, gradients (the loop's carry and each iteration's, as above, and the
  accumulator) and moments in train.param_dtype. Under ZeRO-3 everything stored is 1/(dp*cp) and the
  base gathered as `_zero3` gathers it."""
  t = cfg.train
  dims = model_dims(cfg, plan)
  pb, bb = BYTES[t.param_dtype], BYTES[np.dtype(dims.param_dtype).name]  # (an int8 base's rest: bf16)
  layers_b = local['layers'] * bb
  if dims.base_int8:  # int8 matrices and their scales (jax3d/model/quant.py)
    layers_b = dims.n_layers // plan.pp * formulas.int8_layer_bytes(dims, plan.tp)
  adapters = lora_local_params(cfg, plan) * pb
  stored = (layers_b + local['embed_head'] * bb + adapters) / (plan.zero_ranks if mode else 1)
  out = {
    'params': stored,
    'grads': adapters * ((2 if plan.grad_accum > 1 else 1) + _loop_copy(plan)),
    'optimizer': 2 * adapters / (plan.zero_ranks if t.shard_optimizer or mode else 1),
  }
  if mode:
    layers = layers_b / (dims.n_layers // plan.pp if mode == 'layer' else 1)
    out['gathered'] = layers + local['embed_head'] * bb
  return out


def _zero3(local: dict, pb: int, plan: RunPlan, mode: str, n_layers: int) -> dict:
  """ZeRO-3 (jax3d/parallel/zero3.py): parameters, their reduced gradients (and the accumulator)
  and Adam's moments stored 1/(dp*cp) (`plan.zero_ranks`); what exists whole during the step by gather mode:
    'step'   the stage's layers and the embedding/head gathered ('gathered'); the gradients whole
             as without ZeRO-3 (the loop's carry and each iteration's fresh one), reduce-scattered
             to the slices after the loop.
    'layer'  one layer's weights and the embedding/head gathered; in the loop the gradient carry
             and each iteration's fresh one are slices, plus one layer's whole gradient before its
             reduce-scatter, and the embedding/head's whole gradient.
  (Under remat 'none' the layer gather keeps what 'dots' keeps, zero3.Gather.layer; the
  activations count 'none''s residuals: an upper bound there.)"""
  stored = sum(local.values()) * pb / plan.zero_ranks
  layers, shared = local['layers'] * pb, local['embed_head'] * pb
  slices = stored * (2 if plan.grad_accum > 1 else 1)
  if mode == 'step':
    grads, gathered = slices + layers + shared + _loop_copy(plan) * layers, layers + shared
  else:
    one = layers / (n_layers // plan.pp)
    grads, gathered = slices + layers / plan.zero_ranks + shared + one, one + shared
  return {'params': stored, 'grads': grads, 'optimizer': 2 * stored, 'gathered': gathered}
