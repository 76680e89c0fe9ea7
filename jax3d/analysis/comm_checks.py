"""The collectives of a compiled train step against the formulas, per device per step: what the
communication formulas expect of each mesh axis (`expected_comm`), the measured collectives grouped
by the axes they run over (`summarize`), and the two compared like for like (`checks`). Used by
jax3d/analysis/inspection.py's `analyze`.

Bytes, as in jax3d/analysis/hlo.py: buffer bytes are the HLO shape one device holds; wire bytes what
a device sends with a ring algorithm (the formulas are wire bytes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from jax3d.analysis import ep_comm
from jax3d.analysis.cp_comm import KV_KINDS, KV_WHAT, cp_attention_bytes
from jax3d.analysis.dp_comm import dp_comm
from jax3d.analysis.ep_comm import ep_dispatch_bytes
from jax3d.model import formulas

if TYPE_CHECKING:
  from jax3d.setup import Setup


def expected_comm(s: Setup) -> dict:
  """Wire bytes per device per step from the formulas, two ways where they differ:
  'formula'  the papers' count of useful work (m micro-batches through L/p layers per stage);
  'spmd'     what this SPMD pipeline executes: every stage runs and sends in all v*m+p-1
             iterations, bubble included, so tp and pp traffic scale by (v*m+p-1)/(v*m) (1F1B
             too: it sends forward in v*m+p-1 ticks and back in v*m+p-1); and
             the tp all-reduces the remat policy recomputes (formulas.TP_ALL_REDUCES_RECOMPUTED).
             dp is the same either way: the pipeline loop is manual over dp, so the weight
             gradients are summed over dp once per step, after the loop.
  dp: 2(d-1)/d * P_local * bytes, P_local = parameters this device holds after tp/pp sharding;
      with train.grad_reduce_dtype bfloat16/int8 the reduce half moves 2/1 bytes per element (int8
      scales not counted), and under ZeRO-1 the all-gather half moves the parameters' bytes.
  cp: per layer per micro-batch, K and V all-gathered forward and backward and dK, dV
      reduce-scattered, 3 (c-1)/c * 2*b*s*(k/t)*d_head * bytes (jax3d/analysis/cp_comm.py).
  ep: per layer per micro-batch, 5 all-to-alls of the dispatched slots, 5 (e-1)/e * b*E*C*d * bytes
      (jax3d/analysis/ep_comm.py)."""
  plan, dims, a = s.plan, s.dims, s.plan.grad_accum
  p, v, m, t, d = plan.pp, plan.repeats, plan.microbatches, plan.tp, plan.dp
  act = np.dtype(dims.dtype).itemsize
  bsh = plan.micro_batch // d * (plan.seq_len // plan.cp) * dims.d_model * act  # one micro-batch, one device
  iters, layers_per_chunk = v * m + p - 1, dims.n_layers // (p * v)
  one_f = s.cfg.pipeline.schedule == '1f1b' and p > 1
  per_layer_mb = 4 * 2 * (t - 1) / t * bsh
  dp = dp_comm(s)
  scatter = plan.pp_batch_split is not None  # the loop's inputs gathered, outputs scattered over pp
  rows = m * (plan.micro_batch // d)  # the loop's rows on one device: whole rows, also with cp (measured)
  sp_split = t if plan.sequence_parallel else 1
  edge = formulas.pipeline_edge_bytes(p, rows, plan.seq_len, dims.d_model, sp_split, scatter) * a
  if one_f:  # no outputs leave the loop (the loss does): only the input's gather (or its gradient's sum)
    edge = edge / 2 if scatter else edge / (sp_split + 1)
  edge += dp['shared_wire'] if d == 1 else 0.0
  tp_spmd = per_layer_mb * layers_per_chunk * iters * a  # no recomputation
  halves = formulas.tp_halves_per_layer(s.cfg.train.remat, plan.sequence_parallel)  # 8 = 4 all-reduces
  sp = t if plan.sequence_parallel else 1  # the ring's micro-batches are split over tp with SP
  # SP: one all-gather over tp of the loop's fp32 outputs, and one of its inputs' gradient.
  sp_edges = 0.0
  if sp > 1:
    sp_edges = 2 * (t - 1) / t * rows * plan.seq_len * dims.d_model * 4 * a
  return {
    'tp': {
      'formula': per_layer_mb * dims.n_layers // p * m * a,
      'spmd': tp_spmd * halves / 8,
      'spmd_forward': tp_spmd / 2,  # the recomputed ones count as backward
    },
    'tp_edges': {'formula': sp_edges, 'spmd': sp_edges},
    'pp': {
      'formula': 2 * v * m * bsh * a / sp if p > 1 else 0.0,
      'spmd': 2 * iters * bsh * a / sp if p > 1 else 0.0,
    },
    'pp_edges': {'formula': edge, 'spmd': edge},
    'cp': cp_attention_bytes(plan, dims.n_layers, dims.n_kv_heads, dims.head_dim, act, dims.cp_strategy),
    'ep': ep_dispatch_bytes(
      plan, dims.n_layers, dims.n_experts, _capacity(s), dims.d_model, act, s.cfg.train.remat
    ),
    'dp': {'formula': dp['wire'], 'spmd': dp['wire']},
    'p_local_bytes': dp['p_local'],
    'dp_grad_bytes': dp['grads'],
    'layer_bytes_local': dp['layers_local'],
    'bsh_bytes': bsh,
  }


def _capacity(s: Setup) -> int:
  dims = s.dims
  if not dims.n_experts:
    return 0
  return ep_comm.group_capacity(s.plan, dims.capacity_factor, dims.top_k, dims.n_experts)


def summarize(colls: list[dict]) -> dict:
  """Collectives grouped by the mesh axes they run over, with totals and a per-kind split."""
  by_axis = {}
  for c in colls:
    g = by_axis.setdefault(c['axes'], {'wire_bytes': 0.0, 'buffer_bytes': 0.0, 'ops': 0, 'kinds': {}})
    g['wire_bytes'] += c['wire_bytes']
    g['buffer_bytes'] += c['buffer_bytes']
    g['ops'] += c['count']
    k = g['kinds'].setdefault(f'{c["kind"]} ({c["pass"]})', {'wire_bytes': 0.0, 'ops': 0})
    k['wire_bytes'] += c['wire_bytes']
    k['ops'] += c['count']
  return by_axis


def checks(colls: list[dict], e: dict) -> list[dict]:
  """Measured against expected, like for like (wire bytes per device per step):
  tp   the tp collectives of the layers (flax `Block`; embedding, head and loss are outside);
  pp   the pipeline ring's collective-permutes (entering and leaving the pipeline is extra);
  dp   gradient bytes all-reduced over any group that includes dp, against P_local;
  cp   the attention's K/V all-gathers and dK/dV reduce-scatters over cp in the layers."""
  total = lambda pred, key='wire_bytes': sum(c[key] for c in colls if pred(c))
  tp_layers = lambda c: c['axes'] == 'tp' and c['in_layers']
  kv = lambda c: c['axes'] == 'cp' and c['in_layers'] and c['kind'] in KV_KINDS[e['cp']['strategy']]
  dp_grads = lambda c: (
    'dp' in c['axes'].split('+') and c['kind'] in ('all-reduce', 'reduce-scatter', 'all-to-all')
  )  # all-to-all: jax3d/parallel/compression.py
  out = [
    {
      'axis': 'tp',
      'what': 'tp collectives in the layers (fwd+bwd)',
      'measured': total(tp_layers),
      'formula': e['tp']['formula'],
      'spmd': e['tp']['spmd'],
    },
    {
      'axis': 'tp',
      'what': 'tp collectives in the layers (forward)',
      'measured': total(lambda c: tp_layers(c) and c['pass'] == 'forward'),
      'formula': e['tp']['formula'] / 2,
      'spmd': e['tp']['spmd_forward'],
    },
    {
      'axis': 'tp',
      'what': 'tp all-gathers outside the layers (SP: pipeline entry/exit)',
      'measured': total(lambda c: c['axes'] == 'tp' and not c['in_layers'] and c['kind'] == 'all-gather'),
      'formula': e['tp_edges']['formula'],
      'spmd': e['tp_edges']['spmd'],
    },
    {
      'axis': 'pp',
      'what': 'pipeline ring (collective-permute, fwd+bwd)',
      'measured': total(lambda c: c['axes'] == 'pp' and c['kind'] == 'collective-permute'),
      'formula': e['pp']['formula'],
      'spmd': e['pp']['spmd'],
    },
    {
      'axis': 'pp',
      'what': 'pp collectives besides the ring (pipeline entry/exit; dp=1: shared weights)',
      'measured': total(lambda c: c['axes'] == 'pp' and c['kind'] != 'collective-permute'),
      'formula': e['pp_edges']['formula'],
      'spmd': e['pp_edges']['spmd'],
    },
    {
      'axis': 'dp',
      'what': 'gradient bytes reduced over dp (buffer vs P_local)',
      'measured': total(dp_grads, 'buffer_bytes'),
      'formula': e['dp_grad_bytes'],
      'spmd': e['dp_grad_bytes'],
    },
    {
      'axis': 'dp',
      'what': 'wire bytes over groups with dp (2(d-1)/d P_local)',
      'measured': total(lambda c: 'dp' in c['axes'].split('+')),
      'formula': e['dp']['formula'],
      'spmd': e['dp']['spmd'],
    },
  ]
  if e['ep']['formula']:
    out.append(
      {
        'axis': 'ep',
        'what': "experts' all-to-alls over ep (in the layers, fwd+bwd)",
        'measured': total(lambda c: c['axes'] == 'ep' and c['kind'] == 'all-to-all'),
        'formula': e['ep']['formula'],
        'spmd': e['ep']['spmd'],
      }
    )
  if e['cp']['formula']:
    out.append(
      {
        'axis': 'cp',
        'what': KV_WHAT[e['cp']['strategy']],
        'measured': total(kv),
        'formula': e['cp']['formula'],
        'spmd': e['cp']['spmd'],
      }
    )
  for c in out:
    c['ratio'] = c['measured'] / c['formula'] if c['formula'] else None
  return out
