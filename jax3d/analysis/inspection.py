"""What a compiled train step costs, per device per step, against the formulas: memory (XLA's
`memory_analysis`), FLOPs (the HLO's matmuls times their loops' trip counts) and the collectives of
each mesh axis (jax3d/analysis/hlo.py), compared with the communication formulas
(jax3d/analysis/comm_checks.py).

Bytes, as in jax3d/analysis/hlo.py: buffer bytes are the HLO shape one device holds; wire bytes what a
device sends with a ring algorithm (the formulas are wire bytes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax

from jax3d.analysis.comm_checks import checks, expected_comm, summarize
from jax3d.analysis.hlo import attention_kernel, collectives, matmul_flops, multiplicities, parse_hlo
from jax3d.model import formulas

if TYPE_CHECKING:
  from jax3d.setup import Setup


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
      'ep': plan.ep,
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
  ep = f' ep={lay["ep"]}' if lay.get('ep', 1) > 1 else ''
  out = [
    f'layout dp={lay["dp"]} pp={lay["pp"]} tp={lay["tp"]}{ep}  m={lay["microbatches"]} v={lay["repeats"]} '
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
