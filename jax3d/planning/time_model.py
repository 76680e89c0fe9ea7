"""Step time of one layout: compute at `efficiency` of peak (a mixture's experts: the slots they
compute), the tp/cp/ep/pp/dp traffic over the links each axis is placed on (jax3d/parallel/mesh.py:
tp inside a node, then cp or ep, pp, dp outermost; ep's the experts' all-to-alls), the dp
all-reduce partly hidden behind the backward pass, and the bubble as wasted compute:
executed/useful = (v*m+p-1)/(v*m). Under 1F1B (jax3d/parallel/pipeline/timetable.py) the loop
computes forwards in v*m+p-1 of its ticks and backwards in v*m+p-1, each chunk once (its VJP
residuals kept): GPipe's compute and ring traffic, plus the head's two pp collectives per
micro-batch.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from jax3d.config import RunPlan
from jax3d.model import formulas
from jax3d.planning import memory_model
from jax3d.planning.hardware import BYTES, Hardware

if TYPE_CHECKING:
  from jax3d.config import Config


def compute_seconds(cfg: Config, plan: RunPlan, hw: Hardware) -> float:
  """The step's FLOPs per device (recomputation and bubble iterations included) at
  `hw.efficiency` of the peak (half the peak for float32 compute)."""
  m, t, s = cfg.model, cfg.train, plan.seq_len
  dims = memory_model.model_dims(cfg, plan)
  dims_p = formulas.param_count(dims)
  p_layers = m.n_layers * executed_layer_params(cfg, plan)
  attn = formulas.attention_flops_per_token(dims, s)
  # Recomputed forward work per token: 'full' reruns each layer once; 'stage' each iteration and,
  # inside it, each layer (both are checkpointed: 2 extra forwards); 'dots' the attention core;
  # 'attn' the matmuls.
  fwd = 2 * p_layers + attn / 3
  extra = {'none': 0, 'dots': attn / 3, 'attn': 2 * p_layers, 'full': fwd, 'stage': 2 * fwd}
  # LoRA: the frozen base gets no weight gradients (forward and input gradients: 4, not 6, per
  # weight), the adapters their 6 each
  wg = 4 if cfg.lora.rank else 6
  adapters = 6 * m.n_layers * formulas.lora_layer_params(dims)
  layer_flops = wg * p_layers + attn + extra[t.remat] + adapters
  waste = plan.iterations / (plan.repeats * plan.microbatches)  # bubble iterations compute too
  peak = hw.peak_tflops * 1e12 * (1.0 if t.compute_dtype == 'bfloat16' else 0.5)
  tokens = plan.tokens_per_step
  head = dims_p - m.n_layers * formulas.layer_params(dims)
  return tokens * (layer_flops * waste + wg * head) / plan.n_devices / (peak * hw.efficiency)


def executed_layer_params(cfg: Config, plan: RunPlan) -> float:
  """The weights one token's pass through a layer multiplies by, as the step computes: a dense
  layer's all; of a mixture of experts (jax3d/model/moe.py) the attention, router and shared
  expert, and of the routed experts E*C/t per token (each sequence's t tokens fill E experts' C
  slots each, empty slots computed too: top_k times the capacity factor, about), not all E."""
  dims = memory_model.model_dims(cfg, plan)
  if not dims.n_experts:
    return float(formulas.layer_params(dims))
  slots = dims.n_experts * _capacity(cfg, plan) / (plan.seq_len // plan.cp)  # per capacity group
  return float(formulas.layer_params(dataclasses.replace(dims, top_k=slots), active=True))


def _capacity(cfg: Config, plan: RunPlan) -> int:
  """Slots per expert and capacity group (ep_comm.group_capacity, the model's)."""
  from jax3d.analysis import ep_comm

  moe = cfg.moe
  return ep_comm.group_capacity(plan, moe.capacity_factor, moe.top_k, moe.num_experts)


def traffic_bytes(cfg: Config, plan: RunPlan) -> dict:
  """Bytes each device sends per step over each mesh axis: {'tp', 'pp', 'dp', 'cp', 'ep'}."""
  t, pp, tp = cfg.train, plan.pp, plan.tp
  act_mb = memory_model.micro_activation_bytes(cfg, plan)
  sp = tp if plan.sequence_parallel else 1  # the loop's micro-batches are split over tp with SP
  lc = cfg.model.n_layers // (pp * plan.repeats)  # layers per chunk: what one iteration runs
  one_f = memory_model.one_f_one_b(cfg, plan)
  layer_calls = plan.iterations * lc * plan.grad_accum
  all_reduces = 4 + formulas.TP_ALL_REDUCES_RECOMPUTED[t.remat]  # per layer: 2 forward, 2 backward
  tp_bytes = layer_calls * all_reduces * 2 * (tp - 1) / tp * act_mb
  # The ring's ppermute is outside every checkpoint: one send forward, one backward.
  # 1F1B: as many, and the head's reduce-scatter (fp32) and all-gather of each micro-batch.
  pp_bytes = plan.iterations * plan.grad_accum * 2 * act_mb / sp if pp > 1 else 0
  pp_bytes += plan.microbatches * plan.grad_accum * 2 * (pp - 1) / pp * act_mb if one_f else 0
  rows = plan.chunk_batch // plan.dp  # the loop's input: a dp shard's rows (replicated over ep)
  edge = formulas.pipeline_edge_bytes(
    pp, rows, plan.seq_len, cfg.model.d_model, sp, plan.pp_batch_split is not None
  )
  pp_bytes += edge * plan.grad_accum
  dp_bytes, exposed = dp_traffic(cfg, plan)
  return {
    'tp': tp_bytes,
    'pp': pp_bytes,
    'dp': dp_bytes,
    'dp_exposed': exposed,
    'cp': cp_traffic(cfg, plan),
    'ep': ep_traffic(cfg, plan),
  }


def cp_traffic(cfg: Config, plan: RunPlan) -> float:
  """Bytes each device sends over cp per step (jax3d/analysis/cp_comm.py, docs/formulas.md): the
  K/V collectives of every layer the SPMD loop runs (train.cp_strategy's), and the weight
  gradients' all-reduce over cp (the parameters are replicated over cp)."""
  from jax3d.analysis import cp_comm

  if plan.cp == 1:
    return 0.0
  m, t = cfg.model, cfg.train
  hd = m.head_dim or m.d_model // m.n_heads
  attention = cp_comm.cp_attention_bytes(
    plan, m.n_layers, m.n_kv_heads, hd, BYTES[t.compute_dtype], t.cp_strategy
  )
  local = memory_model.local_params(cfg, plan)
  n_grads = memory_model.lora_local_params(cfg, plan) if cfg.lora.rank else sum(local.values())
  return attention['spmd'] + cp_comm.cp_grad_bytes(n_grads, plan.cp, BYTES[t.grad_reduce_dtype])


def ep_traffic(cfg: Config, plan: RunPlan) -> float:
  """Bytes each device sends over ep per step (jax3d/analysis/ep_comm.py, docs/formulas.md): the
  experts' all-to-alls of every layer the SPMD loop runs (`ep_dispatch_bytes`' 'spmd': 5 per layer
  and micro-batch, 6 under a recomputing remat policy), and the all-reduce over ep of the gradients
  of the weights replicated over it (all but the routed experts), 2(e-1)/e of them."""
  from jax3d.analysis import ep_comm

  if plan.ep == 1:
    return 0.0
  m, t = cfg.model, cfg.train
  a2a = ep_comm.ep_dispatch_bytes(
    plan, m.n_layers, cfg.moe.num_experts, _capacity(cfg, plan), m.d_model, BYTES[t.compute_dtype], t.remat
  )
  dims = memory_model.model_dims(cfg, plan)
  # the layer's parameters less the routed experts: `active` with none of them (top_k 0)
  replicated = formulas.layer_params(dataclasses.replace(dims, top_k=0), plan.tp, active=True)
  n_grads = m.n_layers // plan.pp * replicated + memory_model.local_params(cfg, plan)['embed_head']
  if cfg.lora.rank:  # the adapters' gradients only
    n_grads = memory_model.lora_local_params(cfg, plan)
  return a2a['spmd'] + 2 * (plan.ep - 1) / plan.ep * n_grads * BYTES[t.grad_reduce_dtype]


def dp_traffic(cfg: Config, plan: RunPlan) -> tuple[float, float]:
  """Bytes each device sends over dp per step, and the share no compute can hide: the gradient
  all-reduce, 2(d-1)/d * P_local in the reduction's dtype (hidden in part behind the backward
  pass); under ZeRO-3 on the compiler's path the gathers and reduce-scatters of
  jax3d/analysis/dp_comm.py ('step': the same bytes, its gather before the loop exposed; 'layer':
  per use of each layer, inside the loop), and on the explicit path a gather of the parameters at
  its entry (exposed) and a reduce-scatter of the gradients."""
  from jax3d.analysis import dp_comm  # imported when needed: jax is heavy
  from jax3d.parallel import data_parallel

  t, dp = cfg.train, plan.dp
  local = memory_model.local_params(cfg, plan)
  n_local = sum(local.values())
  ring = 2 * (dp - 1) / dp
  mode = memory_model.gather_mode(cfg, plan)
  if mode is None:  # LoRA: the adapters' gradients only
    n_grads = memory_model.lora_local_params(cfg, plan) if cfg.lora.rank else n_local
    return ring * n_grads * BYTES[t.grad_reduce_dtype], 0.0
  pb = BYTES[t.param_dtype]
  if data_parallel.explicit(cfg, plan):
    return ring / 2 * n_local * (BYTES[t.grad_reduce_dtype] + pb), ring / 2 * n_local * pb
  # the layers gathered in the compute dtype where narrower (their matmul weights; the norms are
  # a rounding error here) and reduced on the bf16 wire where data_parallel.layer_reduces_bf16
  gathered_b = min(pb, BYTES[t.compute_dtype])
  reduced_b = BYTES['bfloat16'] if data_parallel.layer_reduces_bf16(cfg, plan) else pb
  z = dp_comm.zero3_bytes(
    mode,
    plan,
    cfg.model.n_layers,
    t.remat,
    cfg.pipeline.schedule,
    local['layers'] * gathered_b,
    local['embed_head'] * pb,
    dp,
    local['layers'] * reduced_b,
  )
  return z['wire'], z['gathered'] if mode == 'step' else ring / 2 * local['embed_head'] * pb


def step_times(cfg: Config, plan: RunPlan, hw: Hardware) -> dict:
  """Seconds per step: compute, tp, pp, dp, cp, ep, the dp share hidden behind the backward pass
  (dp_hidden), the step itself, and the peak FLOP/s per device it was priced at."""
  compute = compute_seconds(cfg, plan, hw)
  traffic = traffic_bytes(cfg, plan)
  per_host = hw.gpus_per_node
  tp_in = plan.tp <= per_host
  cp_in = plan.tp * plan.cp <= per_host  # cp next inside a node (jax3d/parallel/mesh.py)
  ep_in = plan.tp * plan.ep <= per_host  # ep as cp: ep*tp neighbouring devices of a node
  pp_in = plan.tp * plan.cp * plan.pp <= per_host
  dp_in = plan.n_devices <= per_host
  bw = lambda inside: (hw.intra_gbps if inside else hw.inter_gbps) * 1e9
  t_dp = traffic['dp'] / bw(dp_in)
  t_exposed = traffic['dp_exposed'] / bw(dp_in)  # ZeRO-3's gathers before the loop
  times = {
    'compute': compute,
    'tp': traffic['tp'] / bw(tp_in),
    'pp': traffic['pp'] / bw(pp_in),
    'dp': t_dp,
    'cp': traffic['cp'] / bw(cp_in),  # exposed: the layer waits for its K and V
    'ep': traffic['ep'] / bw(ep_in),  # exposed: the experts wait for their slots
    'dp_hidden': min(t_dp - t_exposed, hw.overlap * compute * 2 / 3),
    'peak': hw.peak_tflops * 1e12,
  }
  exposed = times['tp'] + times['pp'] + times['cp'] + times['ep']
  times['step'] = compute + exposed + t_dp - times['dp_hidden']
  return times
