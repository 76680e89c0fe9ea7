"""What a compiled train step costs, per device per step, against the formulas: memory (XLA's
`memory_analysis`), FLOPs (the HLO's matmuls times their loops' trip counts) and the collectives of
each mesh axis (jax3d/analysis/hlo.py), compared with the communication formulas of `expected_comm`
(`checks`).

Bytes, as in jax3d/analysis/hlo.py: buffer bytes are the HLO shape one device holds; wire bytes what a
device sends with a ring algorithm (the formulas are wire bytes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import numpy as np

from jax3d.analysis.cp_comm import KV_KINDS, KV_WHAT, cp_attention_bytes
from jax3d.analysis.dp_comm import dp_comm
from jax3d.analysis.hlo import attention_kernel, collectives, matmul_flops, multiplicities, parse_hlo
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
      reduce-scattered, 3 (c-1)/c * 2*b*s*(k/t)*d_head * bytes (jax3d/analysis/cp_comm.py)."""
  plan, dims, a = s.plan, s.dims, s.plan.grad_accum
  p, v, m, t, d = plan.pp, plan.repeats, plan.microbatches, plan.tp, plan.dp
  act = np.dtype(dims.dtype).itemsize
  bsh = plan.micro_batch // d * (plan.seq_len // plan.cp) * dims.d_model * act  # one micro-batch, one device
  iters, layers_per_chunk = v * m + p - 1, dims.n_layers // (p * v)
  one_f = s.cfg.pipeline.schedule == '1f1b' and p > 1
  per_layer_mb = 4 * 2 * (t - 1) / t * bsh
  dp = dp_comm(s)
  scatter = plan.pp_batch_split is not None  # the loop's inputs gathered, outputs scattered over pp
  edge_args = (
    p,
    m * (plan.micro_batch // d),
    plan.seq_len,
    dims.d_model,
  )  # whole rows, also with cp (measured)
  edge = formulas.pipeline_edge_bytes(*edge_args, t if plan.sequence_parallel else 1, scatter) * a
  if one_f:  # no outputs leave the loop (the loss does): only the input's gather (or its gradient's sum)
    edge = edge / 2 if scatter else edge / ((t if plan.sequence_parallel else 1) + 1)
  edge += dp['shared_wire'] if d == 1 else 0.0
  tp_spmd = per_layer_mb * layers_per_chunk * iters * a  # no recomputation
  halves = formulas.tp_halves_per_layer(s.cfg.train.remat, plan.sequence_parallel)  # 8 = 4 all-reduces
  sp = t if plan.sequence_parallel else 1  # the ring's micro-batches are split over tp with SP
  # SP: one all-gather over tp of the loop's fp32 outputs, and one of its inputs' gradient.
  sp_edges = (
    2 * (t - 1) / t * m * (plan.micro_batch // d) * plan.seq_len * dims.d_model * 4 * a if sp > 1 else 0.0
  )
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
    'dp': {'formula': dp['wire'], 'spmd': dp['wire']},
    'p_local_bytes': dp['p_local'],
    'dp_grad_bytes': dp['grads'],
    'layer_bytes_local': dp['layers_local'],
    'bsh_bytes': bsh,
  }


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
  kv_cp = dict(axis='cp', what=KV_WHAT[e['cp']['strategy']], measured=total(kv))
  out += [kv_cp | {k: e['cp'][k] for k in ('formula', 'spmd')}] if e['cp']['formula'] else []
  for c in out:
    c['ratio'] = c['measured'] / c['formula'] if c['formula'] else None
  return out


# Memory and the whole analysis -----------------------------------------------------------------
def memory(compiled: jax.stages.Compiled) -> dict:
  """Bytes per device of a compiled step (XLA's memory_analysis): argument, temp, output, alias,
  and total = argument + temp + output - alias, the device's peak for the step."""
  ma = compiled.memory_analysis()
  out = {k: int(getattr(ma, f'{k}_size_in_bytes', 0) or 0) for k in ('argument', 'temp', 'output', 'alias')}
  out['total'] = out['argument'] + out['temp'] + out['output'] - out['alias']
  return out


def analyze(compiled: jax.stages.Compiled, s: Setup) -> dict:
  """Memory, FLOPs and collectives per device per step of the compiled train step of Setup `s`
  (see the module docstring for what 'bytes' means; run.CompiledStep.analysis calls this)."""
  cfg, plan, mesh = s.cfg, s.plan, s.mesh
  mem = memory(compiled)
  mem['peak_estimate'] = mem.pop('total')
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else (cost or {})
  text = compiled.as_text()
  hlo = parse_hlo(text)
  _, unknown_loops = multiplicities(hlo)
  colls = collectives(hlo, tuple(mesh.devices.shape), tuple(mesh.axis_names))
  by_axis = summarize(colls)
  expected = expected_comm(s)
  model_flops = formulas.flops_per_token(s.dims, plan.seq_len) * plan.tokens_per_step / plan.n_devices
  return {
    'layout': {
      'dp': plan.dp,
      'pp': plan.pp,
      'tp': plan.tp,
      'microbatches': plan.microbatches,
      'repeats': plan.repeats,
      'schedule': cfg.pipeline.schedule if plan.pp > 1 else 'none',
      'grad_accum': plan.grad_accum,
      'iterations': plan.iterations,
      'micro_batch_per_dp_shard': plan.micro_batch // plan.dp,
      'seq_len': plan.seq_len,
      'remat': cfg.train.remat,
      'compute_dtype': cfg.train.compute_dtype,
    },
    'device_kind': mesh.devices.flat[0].device_kind,
    'n_devices': int(mesh.devices.size),
    'attention_kernel': attention_kernel(text),
    'memory_bytes': mem,
    'flops': matmul_flops(hlo),
    'flops_xla_cost_analysis': float(cost.get('flops', 0.0)),
    'model_flops': model_flops,
    'comm_bytes': {axis: by_axis.get(axis, {}).get('wire_bytes', 0.0) for axis in ('dp', 'pp', 'tp')}
    | {k: v['wire_bytes'] for k, v in by_axis.items() if k not in ('dp', 'pp', 'tp')},
    'comm_by_axis': by_axis,
    'expected': expected,
    'checks': checks(colls, expected),
    'collectives': colls,
    'unknown_trip_counts': unknown_loops,
  }


KERNEL_NAMES = {
  'cudnn': "cuDNN's fused attention",
  'triton': 'a Triton kernel',
  'blockwise': 'blockwise (jax3d, no [t, t] scores)',
  'xla': "XLA's (unfused)",
}


def with_device_memory(r: dict, device_memory_bytes: int) -> dict:
  """`r` (an `analyze` result) with the device's memory and whether the step's peak fits in it."""
  peak = r['memory_bytes']['peak_estimate']
  return r | {'device_memory_bytes': int(device_memory_bytes), 'fits': bool(peak <= device_memory_bytes)}


def _mb(x: float) -> str:
  return f'{x / 2**20:.2f} MiB'


def summary_lines(r: dict) -> list[str]:
  """A few lines for the trainer's start-up banner (Trainer.compile in jax3d/trainer/trainer.py)."""
  m, c = r['memory_bytes'], r['comm_bytes']
  kv = {ch['axis']: f' (K/V {_mb(ch["measured"])})' for ch in r['checks'] if ch['what'].startswith('K/V')}
  lines = [
    f'per device: args {_mb(m["argument"])}, temp {_mb(m["temp"])}, out {_mb(m["output"])} '
    f'(aliased {_mb(m["alias"])}), peak ~{_mb(m["peak_estimate"])}',
    f'per device per step: {r["flops"] / 1e9:.2f} GFLOP executed (matmuls), {r["model_flops"] / 1e9:.2f} GFLOP model; '
    f'attention: {KERNEL_NAMES[r["attention_kernel"]]}',
    'comm per device per step (ring wire bytes): '
    + ', '.join(f'{axis} {_mb(v)}{kv.get(axis, "")}' for axis, v in c.items() if v),
  ]
  for ch in r['checks']:
    if ch['formula'] and ch['spmd'] and abs(ch['measured'] / ch['spmd'] - 1) > 0.05:
      lines.append(
        f'  note: {ch["what"]}: {ch["measured"] / ch["spmd"]:.2f}x the SPMD-executed formula '
        '(python -m jax3d.inspect for the breakdown)'
      )
  return lines


def render(r: dict) -> str:
  """The human-readable report of `python -m jax3d.inspect`."""
  lay, m = r['layout'], r['memory_bytes']
  out = [
    f'layout dp={lay["dp"]} pp={lay["pp"]} tp={lay["tp"]}  m={lay["microbatches"]} v={lay["repeats"]} '
    f'accum={lay["grad_accum"]}  b={lay["micro_batch_per_dp_shard"]} s={lay["seq_len"]}  '
    f'remat={lay["remat"]} {lay["compute_dtype"]}  on {r["device_kind"]}',
    '',
    'memory per device (compiled.memory_analysis):',
  ]
  for k in ('argument', 'output', 'alias', 'temp', 'peak_estimate'):
    out.append(f'  {k:14s}{_mb(m[k]):>14s}')
  if 'device_memory_bytes' in r:
    cap, share = r['device_memory_bytes'], m['peak_estimate'] / r['device_memory_bytes']
    verdict = f'fits ({share:.0%} of it)' if r['fits'] else f'DOES NOT FIT ({share:.0%} of it)'
    out.append(f'  {r["device_kind"]}: {cap / 2**30:.1f} GiB per device: {verdict}')
  out += ['', f'attention kernel in the program: {KERNEL_NAMES[r["attention_kernel"]]}']
  out += [
    '',
    'FLOPs per device per step:',
    f'  executed matmuls (HLO dots x loop trips) {r["flops"] / 1e9:10.3f} G',
    f'  model 6P+12Lhs (useful work)            {r["model_flops"] / 1e9:10.3f} G',
    f'  XLA cost_analysis (loop bodies once)     {r["flops_xla_cost_analysis"] / 1e9:10.3f} G',
    '',
    'collectives per device per step (wire = ring bytes sent; buffer = HLO shape bytes):',
  ]
  for axis, g in sorted(r['comm_by_axis'].items(), key=lambda kv: -kv[1]['wire_bytes']):
    out.append(
      f'  {axis:6s} wire {_mb(g["wire_bytes"]):>12s}  buffer {_mb(g["buffer_bytes"]):>12s}  {g["ops"]} ops'
    )
    for kind, k in sorted(g['kinds'].items(), key=lambda kv: -kv[1]['wire_bytes']):
      out.append(f'           {kind:34s}{_mb(k["wire_bytes"]):>12s}  x{k["ops"]}')
  out += [
    '',
    'measured vs docs/formulas.md (formula = useful work; spmd = as this SPMD pipeline executes it):',
    f'  {"":56s}{"measured":>12s}{"formula":>12s}{"spmd":>12s}  ratio to formula / spmd',
  ]
  for ch in r['checks']:
    ratios = ' / '.join(f'{ch["measured"] / v:.2f}' if v else '-' for v in (ch['formula'], ch['spmd']))
    out.append(
      f'  {ch["axis"]} {ch["what"]:53s}{_mb(ch["measured"]):>12s}{_mb(ch["formula"]):>12s}'
      f'{_mb(ch["spmd"]):>12s}  {ratios}'
    )
  if r['unknown_trip_counts']:
    out.append(f'  warning: loops with unknown trip count counted once: {r["unknown_trip_counts"]}')
  return '\n'.join(out)
