"""What one train step costs before it runs: memory, FLOPs and every collective, per device.

  python -m jax3d.inspect --config=configs/tiny.py [--config.mesh.tp=4 ...] [--json]

The real train step is compiled ahead of time with abstract inputs (nothing is allocated), then
read three ways: `memory_analysis()` (argument / temp / output / alias bytes), the optimised HLO
text for the collectives, and the HLO's matmuls for FLOPs. XLA's own `cost_analysis()` counts a
while loop's body once, whatever its trip count, so it under-counts a scanned model; we report it
but multiply every op (matmul or collective) by the trip counts of the loops around it.

Bytes, defined once (all per device, per optimizer step):
  buffer bytes  the size of the HLO shape one device holds: the operand of an all-reduce or
                collective-permute, the gathered result of an all-gather, the scattered operand
                of a reduce-scatter.
  wire bytes    what a device sends with a ring algorithm on a group of n devices:
                all-reduce 2(n-1)/n * buffer, all-gather / reduce-scatter / all-to-all
                (n-1)/n * buffer, collective-permute 1 * buffer. The formulas in
                shared/docs/formulas.md are wire bytes, so the comparison uses those.
"""
from __future__ import annotations

import os
import re
import sys
from collections import defaultdict

import numpy as np

# HLO parsing (pure text; no jax needed) ------------------------------------------------------
COLLECTIVES = ('all-reduce', 'all-gather', 'reduce-scatter', 'collective-permute', 'all-to-all')
_DTYPE_BYTES = {'pred': 1, 's8': 1, 'u8': 1, 's16': 2, 'u16': 2, 'f16': 2, 'bf16': 2, 's32': 4,
                'u32': 4, 'f32': 4, 's64': 8, 'u64': 8, 'f64': 8, 'c64': 8, 'c128': 16}
_ARRAY = re.compile(r'\b(pred|[suf]\d+|bf16|f8\w*|c64|c128|token)\[([\d,]*)\]')
_COMP = re.compile(r'^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\{\s*$')
_INSTR = re.compile(r'^\s*(ROOT\s+)?%?([\w.\-]+)\s+=\s+(.*)$')
_CALLS = re.compile(r'\b(body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)')


def _elems(dims: str) -> int:
  return int(np.prod([int(d) for d in dims.split(',') if d])) if dims else 1


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape string, tuples summed: 'f32[2,128]{1,0}' -> 1024."""
  total = 0
  for dtype, dims in _ARRAY.findall(shape):
    total += _elems(dims) * (1 if dtype.startswith('f8') else _DTYPE_BYTES.get(dtype, 0))
  return total


def _split_shape(rest: str) -> tuple[str, str]:
  """'(f32[], f32[2]{0}) op(...)' -> ('(f32[], f32[2]{0})', 'op(...)')."""
  if rest.startswith('('):
    depth = 0
    for i, ch in enumerate(rest):
      depth += ch == '('
      depth -= ch == ')'
      if depth == 0:
        return rest[:i + 1], rest[i + 1:].strip()
  shape, _, tail = rest.partition(' ')
  return shape, tail.strip()


def _balanced(text: str, start: int) -> str:
  """The text inside the bracket that opens at text[start] (handles nesting)."""
  pairs = {'(': ')', '{': '}', '[': ']'}
  open_, close, depth = text[start], pairs[text[start]], 0
  for i in range(start, len(text)):
    depth += text[i] == open_
    depth -= text[i] == close
    if depth == 0:
      return text[start + 1:i]
  return text[start + 1:]


def parse_hlo(text: str) -> dict:
  """Computations of an HLO module: {name: [instr, ...]} with each instr a dict of name, shape,
  op, operands, attrs (the rest of the line), plus 'entry' (the ENTRY computation's name)."""
  comps, entry, current = {}, None, None
  for line in text.splitlines():
    m = _COMP.match(line)
    if m and not line.startswith(' '):
      current = comps.setdefault(m.group(2), [])
      entry = m.group(2) if m.group(1) else entry
      continue
    m = _INSTR.match(line)
    if current is None or not m:
      continue
    shape, tail = _split_shape(m.group(3))
    op = tail.split('(', 1)[0]
    args = _balanced(tail, len(op)) if '(' in tail else ''
    current.append({'name': m.group(2), 'shape': shape, 'op': op, 'args': args,
                    'attrs': tail[len(op) + len(args) + 2:], 'operands': re.findall(r'%([\w.\-]+)', args)})
  return {'computations': comps, 'entry': entry}


def _trip_count(instr: dict, comps: dict) -> int | None:
  """A while loop's trip count: XLA's known_trip_count, else the constant its condition compares
  the induction variable against (`i < N`)."""
  m = re.search(r'"known_trip_count":\{"n":"(\d+)"', instr['attrs'])
  if m:
    return int(m.group(1))
  cond = re.search(r'condition=%?([\w.\-]+)', instr['attrs'])
  body = comps.get(cond.group(1) if cond else '', [])
  consts = {i['name']: int(i['args']) for i in body if i['op'] == 'constant' and re.fullmatch(r'-?\d+', i['args'])}
  for ins in body:
    if ins['op'] == 'compare' and 'direction=LT' in ins['attrs']:
      for o in ins['operands'][1:]:
        if o in consts:
          return consts[o]
  return None


def multiplicities(hlo: dict) -> tuple[dict, list]:
  """How many times each computation runs per call of ENTRY: the product of the trip counts of
  the while loops around it (summed over call sites). Also returns loops without a known count."""
  comps, mult, unknown = hlo['computations'], defaultdict(int), []

  def visit(name, times):
    mult[name] += times
    for ins in comps.get(name, []):
      for kind, callee in _CALLS.findall(ins['attrs']):
        n = 1
        if ins['op'] == 'while' and kind in ('body', 'condition'):
          trips = _trip_count(ins, comps)
          if trips is None:
            unknown.append(ins['name'])
            trips = 1
          n = trips + (kind == 'condition')
        visit(callee, times * n)
      for callee in re.findall(r'branch_computations=\{([^}]*)\}', ins['attrs']):
        for c in re.findall(r'%?([\w.\-]+)', callee):
          visit(c, times)  # a conditional branch counted as if taken (an upper bound)

  visit(hlo['entry'], 1)
  return dict(mult), sorted(set(unknown))


def _iota(spec: str) -> np.ndarray:
  """'[2,2,2]T(1,0,2)' or '[8]' -> the device-id array of an XLA iota tile assignment."""
  m = re.match(r'\[([\d,]+)\](?:T\(([\d,]+)\))?', spec.strip())
  dims = [int(d) for d in m.group(1).split(',')]
  ids = np.arange(int(np.prod(dims))).reshape(dims)
  return ids.transpose([int(p) for p in m.group(2).split(',')]) if m.group(2) else ids


def replica_groups(attrs: str, n_devices: int) -> list[list[int]]:
  """Device groups of a collective, from any of XLA's three printed forms: explicit
  {{0,1},{2,3}}, iota [4,2]<=[2,2,2]T(0,2,1), and mesh['a'=2,'b'=4], device_ids=(...) {'a'}."""
  m = re.search(r'source_target_pairs=\{(.*?)\}\}', attrs)
  if m:
    return [[int(a), int(b)] for a, b in re.findall(r'\{(\d+),(\d+)', m.group(1) + '}')]
  m = re.search(r'replica_groups=(\S)', attrs)
  if not m:
    return [list(range(n_devices))]
  start = m.start(1)
  if attrs[start] == '{':
    groups = [[int(x) for x in g.split(',') if x] for g in re.findall(r'\{([\d,]*)\}', _balanced(attrs, start))]
    return [g for g in groups if g] or [list(range(n_devices))]
  if attrs[start] == '[':
    m = re.match(r'\[(\d+),(\d+)\]<=(\[[\d,]+\](?:T\([\d,]+\))?)', attrs[start:])
    return _iota(m.group(3)).reshape(int(m.group(1)), int(m.group(2))).tolist()
  # mesh['axis_0'=2,'axis_1'=4], device_ids=([..]T(..)) {'axis_0'}  (XLA MeshAxesReplicaGroupList)
  body = _balanced(attrs, start + 4)
  names = re.findall(r"'([^']+)'=(\d+)", body)
  sizes = [int(s) for _, s in names]
  rest = attrs[start + 4 + len(body) + 2:]
  ids = np.arange(n_devices)
  dm = re.match(r',\s*device_ids=\((.*?)\)\s', rest + ' ')
  if dm:
    inner = dm.group(1)
    ids = _iota(inner) if inner.startswith('[') else np.array([int(x) for x in inner.split(',')])
    rest = rest[dm.end():]
  axes_txt = re.match(r'\s*\{([^}]*)\}', rest).group(1)
  grouped = [[n for n, _ in names].index(a) for a in re.findall(r"'([^']+)'", axes_txt)
             if ':' not in a]
  if re.search(r":\(\d+\)", axes_txt):
    raise ValueError(f'sub-axis replica groups are not handled: {axes_txt}')
  arr = ids.reshape(sizes)
  keep = [i for i in range(len(sizes)) if i not in grouped]
  per = int(np.prod([sizes[i] for i in grouped])) if grouped else 1
  return arr.transpose(keep + grouped).reshape(-1, per).tolist()


def group_axes(groups: list[list[int]], mesh_shape: tuple, axes=('dp', 'pp', 'tp')) -> str:
  """Which mesh axes vary inside the groups: 'tp', 'dp+pp', ... ('-' when none do)."""
  varying = set()
  for g in groups:
    coords = np.array([np.unravel_index(d, mesh_shape) for d in g])
    varying |= {axes[i] for i in range(len(axes)) if len(set(coords[:, i])) > 1}
  return '+'.join(a for a in axes if a in varying) or '-'


def collectives(hlo: dict, mesh_shape: tuple, axes=('dp', 'pp', 'tp')) -> list[dict]:
  """Every collective (async -start counted, -done skipped), with buffer and wire bytes per device
  per call of ENTRY (times the trip counts of the loops it sits in)."""
  mult, _ = multiplicities(hlo)
  n_dev = int(np.prod(mesh_shape))
  out = []
  for cname, instrs in hlo['computations'].items():
    shapes = {i['name']: i['shape'] for i in instrs}
    for ins in instrs:
      kind = ins['op'].removesuffix('-start')
      if kind not in COLLECTIVES or mult.get(cname, 0) == 0:
        continue
      groups = replica_groups(ins['attrs'], n_dev)
      operand = sum(shape_bytes(shapes.get(o, '')) for o in ins['operands'])
      if not operand:  # operands defined elsewhere (should not happen): fall back on the result
        operand = shape_bytes(ins['shape'])
      n = len(groups[0]) if kind != 'collective-permute' else 2
      if kind == 'all-gather':
        buffer, wire = operand * n, operand * (n - 1)
      elif kind == 'reduce-scatter' or kind == 'all-to-all':
        buffer, wire = operand, operand * (n - 1) / n
      elif kind == 'all-reduce':
        buffer, wire = operand, operand * 2 * (n - 1) / n
      else:  # collective-permute: sources send their buffer once
        buffer, wire = operand, operand * len({s for s, _ in groups}) / n_dev
      op_name = (re.search(r'op_name="([^"]*)"', ins['attrs']) or [None, ''])[1]
      times = mult[cname]
      out.append({'name': ins['name'], 'kind': kind, 'axes': group_axes(groups, mesh_shape, axes),
                  'group_size': n, 'count': times, 'buffer_bytes': buffer * times,
                  'wire_bytes': wire * times, 'computation': cname,
                  'pass': 'backward' if 'transpose(' in op_name else 'forward',
                  'in_pipeline': 'shard_map' in op_name, 'in_layers': '/Block/' in op_name,
                  'op_name': op_name})
  return out


def matmul_flops(hlo: dict) -> float:
  """2 * M * N * K of every dot (also inside fusions), times the trip counts of its loops."""
  mult, _ = multiplicities(hlo)
  total = 0.0
  for cname, instrs in hlo['computations'].items():
    shapes = {i['name']: i['shape'] for i in instrs}
    for ins in instrs:
      if ins['op'] != 'dot' or not mult.get(cname):
        continue
      out_elems = _elems(_ARRAY.search(ins['shape']).group(2))
      lhs = _ARRAY.search(shapes.get(ins['operands'][0], ''))
      dims = [int(d) for d in lhs.group(2).split(',') if d] if lhs else []
      cdims = re.search(r'lhs_contracting_dims=\{([\d,]*)\}', ins['attrs'])
      k = int(np.prod([dims[int(c)] for c in cdims.group(1).split(',') if c])) if cdims and dims else 1
      total += 2.0 * out_elems * k * mult[cname]
  return total


# What the formulas (shared/docs/formulas.md) predict, per device per optimizer step -------------
def expected_comm(s, abstract_state) -> dict:
  """Wire bytes per device per step from the formulas, two ways where they differ:
  'formula'  the papers' count of useful work (m micro-batches through L/p layers per stage);
  'spmd'     what this SPMD pipeline executes: every stage runs and sends in all v*m+p-1
             iterations, bubble included, so tp and pp traffic scale by (v*m+p-1)/(v*m).
             dp is the same either way: the pipeline loop is manual over dp, so the weight
             gradients are summed over dp once per step, after the loop.
  dp: 2(d-1)/d * P_local * bytes, P_local = parameters this device holds after tp/pp sharding;
      with train.grad_reduce_dtype bfloat16/int8 the reduce half moves 2/1 bytes per element (int8
      scales not counted), and under ZeRO-1 the all-gather half moves the parameters' bytes."""
  import jax
  from jax3d import step as step_lib
  plan, dims, a = s.plan, s.dims, s.plan.grad_accum
  p, v, m, t, d = plan.pp, plan.repeats, plan.microbatches, plan.tp, plan.dp
  act = np.dtype(dims.dtype).itemsize
  bsh = plan.micro_batch // d * plan.seq_len * dims.d_model * act  # one micro-batch on one dp shard
  iters, layers_per_chunk = v * m + p - 1, dims.n_layers // (p * v)
  per_layer_mb = 4 * 2 * (t - 1) / t * bsh
  local = lambda leaf: int(np.prod(leaf.sharding.shard_shape(leaf.shape))) * leaf.dtype.itemsize
  params = abstract_state['params']
  p_local = sum(local(x) for x in jax.tree.leaves(params))
  layers_local = sum(local(x) for x in jax.tree.leaves(params['layers']))
  ring = 2 * (d - 1) / d
  n_local = sum(int(np.prod(x.sharding.shard_shape(x.shape))) for x in jax.tree.leaves(params))
  pb = p_local // n_local  # one param_dtype for every parameter
  explicit = step_lib.explicit_reduction(s)
  reduce_b = {'float32': 4, 'bfloat16': 2, 'int8': 1}[s.cfg.train.grad_reduce_dtype] if explicit else pb
  gather_b = pb if step_lib.zero1(s) else reduce_b
  grads = n_local * reduce_b  # the gradient bytes that enter the dp reduction
  dp_wire = ring / 2 * n_local * (reduce_b + gather_b)
  return {
      'tp': {'formula': per_layer_mb * dims.n_layers // p * m * a,
             'spmd': per_layer_mb * layers_per_chunk * iters * a},
      'pp': {'formula': 2 * v * m * bsh * a if p > 1 else 0.0,
             'spmd': 2 * iters * bsh * a if p > 1 else 0.0},
      'dp': {'formula': dp_wire, 'spmd': dp_wire},
      'p_local_bytes': p_local, 'dp_grad_bytes': grads, 'layer_bytes_local': layers_local, 'bsh_bytes': bsh,
  }


def summarize(colls: list[dict]) -> dict:
  """Collectives grouped by the mesh axes they run over, with totals and a per-kind split."""
  by_axis = {}
  for c in colls:
    g = by_axis.setdefault(c['axes'], {'wire_bytes': 0.0, 'buffer_bytes': 0.0, 'ops': 0, 'kinds': {}})
    g['wire_bytes'] += c['wire_bytes']
    g['buffer_bytes'] += c['buffer_bytes']
    g['ops'] += c['count']
    k = g['kinds'].setdefault(f"{c['kind']} ({c['pass']})", {'wire_bytes': 0.0, 'ops': 0})
    k['wire_bytes'] += c['wire_bytes']
    k['ops'] += c['count']
  return by_axis


def checks(colls: list[dict], e: dict) -> list[dict]:
  """Measured against expected, like for like (wire bytes per device per step):
  tp   the tp collectives of the layers (flax `Block`; embedding, head and loss are outside);
  pp   the pipeline ring's collective-permutes (entering and leaving the pipeline is extra);
  dp   gradient bytes all-reduced over any group that includes dp, against P_local."""
  total = lambda pred, key='wire_bytes': sum(c[key] for c in colls if pred(c))
  tp_layers = lambda c: c['axes'] == 'tp' and c['in_layers']
  dp_grads = lambda c: 'dp' in c['axes'].split('+') and c['kind'] in (  # (all-to-all: gradcomm.py)
      'all-reduce', 'reduce-scatter', 'all-to-all')
  out = [
      {'axis': 'tp', 'what': 'tp all-reduces in the layers (fwd+bwd)', 'measured': total(tp_layers),
       'formula': e['tp']['formula'], 'spmd': e['tp']['spmd']},
      {'axis': 'tp', 'what': 'tp all-reduces in the layers (forward)',
       'measured': total(lambda c: tp_layers(c) and c['pass'] == 'forward'),
       'formula': e['tp']['formula'] / 2, 'spmd': e['tp']['spmd'] / 2},
      {'axis': 'pp', 'what': 'pipeline ring (collective-permute, fwd+bwd)',
       'measured': total(lambda c: c['axes'] == 'pp' and c['kind'] == 'collective-permute'),
       'formula': e['pp']['formula'], 'spmd': e['pp']['spmd']},
      {'axis': 'pp', 'what': 'pp collectives besides the ring (pipeline entry/exit)',
       'measured': total(lambda c: c['axes'] == 'pp' and c['kind'] != 'collective-permute'),
       'formula': 0.0, 'spmd': 0.0},
      {'axis': 'dp', 'what': 'gradient bytes reduced over dp (buffer vs P_local)',
       'measured': total(dp_grads, 'buffer_bytes'), 'formula': e['dp_grad_bytes'],
       'spmd': e['dp_grad_bytes']},
      {'axis': 'dp', 'what': 'wire bytes over groups with dp (2(d-1)/d P_local)',
       'measured': total(lambda c: 'dp' in c['axes'].split('+')), 'formula': e['dp']['formula'],
       'spmd': e['dp']['spmd']},
  ]
  for c in out:
    c['ratio'] = c['measured'] / c['formula'] if c['formula'] else None
  return out


# Compile and inspect --------------------------------------------------------------------------
def inspect_step(cfg, plan=None, mesh=None) -> dict:
  """Compiles the real train step for abstract inputs and returns memory, FLOPs and collectives
  per device per step (see the module docstring for what 'bytes' means)."""
  import jax
  from jax3d import config as config_lib, mesh as mesh_lib, step
  plan = plan or config_lib.validate(cfg, jax.device_count())
  mesh = mesh if mesh is not None else mesh_lib.build_mesh(plan, allow_tp_across_hosts=cfg.mesh.allow_tp_across_hosts)
  s = step.Setup.create(cfg, plan, mesh)
  state, batch = step.abstract_inputs(s)
  return inspect_compiled(step.make_train_step(s).lower(state, batch).compile(), s, state)


def inspect_compiled(compiled, s, state) -> dict:
  """The same figures for an already compiled train step (the trainer passes its own)."""
  from jax3d import flops as flops_lib
  cfg, plan, mesh = s.cfg, s.plan, s.mesh
  mem = compiled.memory_analysis()
  memory = {k: int(getattr(mem, f'{k}_size_in_bytes', 0) or 0) for k in ('argument', 'temp', 'output', 'alias')}
  memory['peak_estimate'] = memory['argument'] + memory['output'] - memory['alias'] + memory['temp']
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else (cost or {})
  hlo = parse_hlo(compiled.as_text())
  _, unknown_loops = multiplicities(hlo)
  colls = collectives(hlo, tuple(mesh.devices.shape), tuple(mesh.axis_names))
  by_axis = summarize(colls)
  expected = expected_comm(s, state)
  model_flops = flops_lib.flops_per_token(s.dims, plan.seq_len) * plan.tokens_per_step / plan.n_devices
  return {
      'layout': {'dp': plan.dp, 'pp': plan.pp, 'tp': plan.tp, 'microbatches': plan.microbatches,
                 'repeats': plan.repeats, 'grad_accum': plan.grad_accum, 'iterations': plan.iterations,
                 'micro_batch_per_dp_shard': plan.micro_batch // plan.dp, 'seq_len': plan.seq_len,
                 'remat': cfg.train.remat, 'compute_dtype': cfg.train.compute_dtype},
      'device_kind': mesh.devices.flat[0].device_kind,
      'memory_bytes': memory,
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


def _mb(x: float) -> str:
  return f'{x / 2**20:.2f} MiB'


def summary_lines(r: dict) -> list[str]:
  """A few lines for train.py's start-up banner."""
  m, c = r['memory_bytes'], r['comm_bytes']
  lines = [f"per device: args {_mb(m['argument'])}, temp {_mb(m['temp'])}, out {_mb(m['output'])} "
           f"(aliased {_mb(m['alias'])}), peak ~{_mb(m['peak_estimate'])}",
           f"per device per step: {r['flops'] / 1e9:.2f} GFLOP executed (matmuls), "
           f"{r['model_flops'] / 1e9:.2f} GFLOP model",
           'comm per device per step (ring wire bytes): ' + ', '.join(
               f'{axis} {_mb(v)}' for axis, v in c.items() if v)]
  for ch in r['checks']:
    if ch['formula'] and ch['spmd'] and abs(ch['measured'] / ch['spmd'] - 1) > 0.05:
      lines.append(f"  note: {ch['what']}: {ch['measured'] / ch['spmd']:.2f}x the SPMD-executed formula "
                   '(python -m jax3d.inspect for the breakdown)')
  return lines


def render(r: dict) -> str:
  """The human-readable report of `python -m jax3d.inspect`."""
  lay, m = r['layout'], r['memory_bytes']
  out = [f"layout dp={lay['dp']} pp={lay['pp']} tp={lay['tp']}  m={lay['microbatches']} v={lay['repeats']} "
         f"accum={lay['grad_accum']}  b={lay['micro_batch_per_dp_shard']} s={lay['seq_len']}  "
         f"remat={lay['remat']} {lay['compute_dtype']}  on {r['device_kind']}",
         '', 'memory per device (compiled.memory_analysis):']
  for k in ('argument', 'output', 'alias', 'temp', 'peak_estimate'):
    out.append(f'  {k:14s}{_mb(m[k]):>14s}')
  out += ['', 'FLOPs per device per step:',
          f"  executed matmuls (HLO dots x loop trips) {r['flops'] / 1e9:10.3f} G",
          f"  model 6P+12Lhs (useful work)            {r['model_flops'] / 1e9:10.3f} G",
          f"  XLA cost_analysis (loop bodies once)     {r['flops_xla_cost_analysis'] / 1e9:10.3f} G",
          '', 'collectives per device per step (wire = ring bytes sent; buffer = HLO shape bytes):']
  for axis, g in sorted(r['comm_by_axis'].items(), key=lambda kv: -kv[1]['wire_bytes']):
    out.append(f"  {axis:6s} wire {_mb(g['wire_bytes']):>12s}  buffer {_mb(g['buffer_bytes']):>12s}  "
               f"{g['ops']} ops")
    for kind, k in sorted(g['kinds'].items(), key=lambda kv: -kv[1]['wire_bytes']):
      out.append(f"           {kind:34s}{_mb(k['wire_bytes']):>12s}  x{k['ops']}")
  out += ['', 'measured vs formulas.md (formula = useful work; spmd = as this SPMD pipeline executes it):',
          f"  {'':56s}{'measured':>12s}{'formula':>12s}{'spmd':>12s}  ratio to formula / spmd"]
  for ch in r['checks']:
    ratios = ' / '.join(f'{ch["measured"] / v:.2f}' if v else '-' for v in (ch['formula'], ch['spmd']))
    out.append(f"  {ch['axis']} {ch['what']:53s}{_mb(ch['measured']):>12s}{_mb(ch['formula']):>12s}"
               f"{_mb(ch['spmd']):>12s}  {ratios}")
  if r['unknown_trip_counts']:
    out.append(f"  warning: loops with unknown trip count counted once: {r['unknown_trip_counts']}")
  return '\n'.join(out)


def main(argv=None) -> int:
  import json
  argv = list(sys.argv[1:] if argv is None else argv)
  if os.environ.get('JAX_PLATFORMS', 'cpu') in ('cpu', ''):
    from jax3d import mesh as mesh_lib
    mesh_lib.use_fake_cpu_devices(8)
  from jax3d import config as config_lib
  path, overrides, as_json = None, {}, False
  try:
    for arg in argv:
      if arg == '--json':
        as_json = True
      elif arg.startswith('--config='):
        path = arg.split('=', 1)[1]
      elif arg.startswith('--config.') and '=' in arg:
        key, value = arg[len('--config.'):].split('=', 1)
        overrides[key] = value
      else:
        raise config_lib.ConfigError(f'unknown argument {arg!r} (use --config=PATH, --config.KEY=VALUE, --json)')
    cfg = config_lib.load_config(path, overrides)
    import jax
    plan = config_lib.validate(cfg, jax.device_count())
    result = inspect_step(cfg, plan)
  except config_lib.ConfigError as err:
    print(f'error: {err}', file=sys.stderr)
    return 2
  if as_json:
    print(json.dumps({k: v for k, v in result.items() if k != 'collectives'} |
                     {'collectives': [{k: v for k, v in c.items() if k != 'op_name'} for c in result['collectives']]}))
  else:
    print(render(result))
  return 0


if __name__ == '__main__':
  sys.exit(main())
