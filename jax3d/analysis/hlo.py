"""Reading XLA's optimised HLO text (pure text, no jax): computations, while-loop trip counts, the
collectives with their bytes, and the matmul FLOPs, all per device per call of the ENTRY computation.

XLA's own `cost_analysis()` counts a while loop's body once, whatever its trip count, so it
under-counts a scanned model; here every op (matmul or collective) is multiplied by the trip counts
of the loops around it.

Bytes, defined once (all per device, per optimizer step):
  buffer bytes  the size of the HLO shape one device holds: the operand of an all-reduce or
                collective-permute, the gathered result of an all-gather, the scattered operand
                of a reduce-scatter.
  wire bytes    what a device sends with a ring algorithm on a group of n devices:
                all-reduce 2(n-1)/n * buffer, all-gather / reduce-scatter / all-to-all
                (n-1)/n * buffer, collective-permute 1 * buffer. The communication formulas
                (`expected_comm` in jax3d/analysis/comm_checks.py) are wire bytes, so comparisons use those.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

COLLECTIVES = ('all-reduce', 'all-gather', 'reduce-scatter', 'collective-permute', 'all-to-all')
_DTYPE_BYTES = {
  'pred': 1,
  's8': 1,
  'u8': 1,
  's16': 2,
  'u16': 2,
  'f16': 2,
  'bf16': 2,
  's32': 4,
  'u32': 4,
  'f32': 4,
  's64': 8,
  'u64': 8,
  'f64': 8,
  'c64': 8,
  'c128': 16,
}
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


def arrays(shape: str) -> list[tuple[str, list[int]]]:
  """(dtype, dimensions) of each array in an HLO shape string: 'bf16[2,3]{1,0}' -> [('bf16', [2, 3])]."""
  return [(dtype, [int(d) for d in dims.split(',') if d]) for dtype, dims in _ARRAY.findall(shape)]


def _split_shape(rest: str) -> tuple[str, str]:
  """'(f32[], f32[2]{0}) op(...)' -> ('(f32[], f32[2]{0})', 'op(...)')."""
  if rest.startswith('('):
    depth = 0
    for i, ch in enumerate(rest):
      depth += ch == '('
      depth -= ch == ')'
      if depth == 0:
        return rest[: i + 1], rest[i + 1 :].strip()
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
      return text[start + 1 : i]
  return text[start + 1 :]


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
    current.append(
      {
        'name': m.group(2),
        'shape': shape,
        'op': op,
        'args': args,
        'attrs': tail[len(op) + len(args) + 2 :],
        'operands': re.findall(r'%([\w.\-]+)', args),
      }
    )
  return {'computations': comps, 'entry': entry}


def _trip_count(instr: dict, comps: dict) -> int | None:
  """A while loop's trip count: XLA's known_trip_count, else the constant its condition compares
  the induction variable against (`i < N`)."""
  m = re.search(r'"known_trip_count":\{"n":"(\d+)"', instr['attrs'])
  if m:
    return int(m.group(1))
  cond = re.search(r'condition=%?([\w.\-]+)', instr['attrs'])
  body = comps.get(cond.group(1) if cond else '', [])
  consts = {
    i['name']: int(i['args']) for i in body if i['op'] == 'constant' and re.fullmatch(r'-?\d+', i['args'])
  }
  for ins in body:
    if ins['op'] == 'compare' and 'direction=LT' in ins['attrs']:
      for o in ins['operands'][1:]:
        if o in consts:
          return consts[o]
  return None


def multiplicities(hlo: dict) -> tuple[dict[str, int], list[str]]:
  """How many times each computation runs per call of ENTRY: the product of the trip counts of
  the while loops around it (summed over call sites). Also returns loops without a known count."""
  comps, mult, unknown = hlo['computations'], defaultdict(int), []

  def visit(name: str, times: int) -> None:
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
    inner = _balanced(attrs, start)
    groups = [[int(x) for x in g.split(',') if x] for g in re.findall(r'\{([\d,]*)\}', inner)]
    return [g for g in groups if g] or [list(range(n_devices))]
  if attrs[start] == '[':
    m = re.match(r'\[(\d+),(\d+)\]<=(\[[\d,]+\](?:T\([\d,]+\))?)', attrs[start:])
    return _iota(m.group(3)).reshape(int(m.group(1)), int(m.group(2))).tolist()
  # mesh['axis_0'=2,'axis_1'=4], device_ids=([..]T(..)) {'axis_0'}  (XLA MeshAxesReplicaGroupList)
  body = _balanced(attrs, start + 4)
  names = re.findall(r"'([^']+)'=(\d+)", body)
  sizes = [int(s) for _, s in names]
  rest = attrs[start + 4 + len(body) + 2 :]
  ids = np.arange(n_devices)
  dm = re.match(r',\s*device_ids=\((.*?)\)\s', rest + ' ')
  if dm:
    inner = dm.group(1)
    ids = _iota(inner) if inner.startswith('[') else np.array([int(x) for x in inner.split(',')])
    rest = rest[dm.end() :]
  axes_txt = re.match(r'\s*\{([^}]*)\}', rest).group(1)
  grouped = [[n for n, _ in names].index(a) for a in re.findall(r"'([^']+)'", axes_txt) if ':' not in a]
  if re.search(r':\(\d+\)', axes_txt):
    raise ValueError(f'sub-axis replica groups are not handled: {axes_txt}')
  arr = ids.reshape(sizes)
  keep = [i for i in range(len(sizes)) if i not in grouped]
  per = int(np.prod([sizes[i] for i in grouped])) if grouped else 1
  return arr.transpose(keep + grouped).reshape(-1, per).tolist()


def group_axes(
  groups: list[list[int]], mesh_shape: tuple[int, ...], axes: Sequence[str] = ('dp', 'pp', 'tp')
) -> str:
  """Which mesh axes vary inside the groups: 'tp', 'dp+pp', ... ('-' when none do)."""
  varying = set()
  for g in groups:
    coords = np.array([np.unravel_index(d, mesh_shape) for d in g])
    varying |= {axes[i] for i in range(len(axes)) if len(set(coords[:, i])) > 1}
  return '+'.join(a for a in axes if a in varying) or '-'


def collectives(
  hlo: dict, mesh_shape: tuple[int, ...], axes: Sequence[str] = ('dp', 'pp', 'tp')
) -> list[dict]:
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
      out.append(
        {
          'name': ins['name'],
          'kind': kind,
          'axes': group_axes(groups, mesh_shape, axes),
          'group_size': n,
          'count': times,
          'buffer_bytes': buffer * times,
          'wire_bytes': wire * times,
          'computation': cname,
          'pass': 'backward' if 'transpose(' in op_name else 'forward',
          'in_pipeline': 'shard_map' in op_name,
          # the layer's scope as it appears in the forward pass (/Block/) and in a written-out
          # backward pass's jax.vjp of the layer (jvp(Block)/, transpose(jvp(Block))/)
          'in_layers': re.search(r'[/(]Block[/)]', op_name) is not None,
          'op_name': op_name,
        }
      )
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


ATTENTION_KERNELS = (  # (custom-call target prefix in the optimised HLO, the kernel's name)
  ('__cudnn$fmha', 'cudnn'),
  ('__gpu$xla.gpu.triton', 'triton'),
)


def attention_kernel(hlo_text: str) -> str:
  """The attention kernel in an optimised HLO module: 'cudnn' (cuDNN's fused attention custom
  calls), 'triton' (a Pallas kernel), 'blockwise' (ops from jax3d/model/blockwise.py, named in the
  metadata), else 'xla' (dots and a softmax, fused by XLA)."""
  for target, name in ATTENTION_KERNELS:
    if f'custom_call_target="{target}' in hlo_text:
      return name
  blockwise = 'model/blockwise.py' in hlo_text or _calls(hlo_text, 'jax3d/model/cp_attention.py', 'attend')
  return 'blockwise' if blockwise else 'xla'


def _calls(hlo_text: str, file: str, function: str) -> bool:
  """Whether the module's stack frames hold `function` of the file ending in `file`: context
  parallelism's attention (mesh.cp > 1) runs the blockwise kernel inside per-device regions whose
  ops keep only the caller's frames (cp_attention.attend, whose kernel is always blockwise)."""
  files, _, rest = hlo_text.partition('\nFunctionNames')
  names = rest.partition('\nFileLocations')[0]
  entry = re.compile(r'^(\d+) "([^"]*)"$', re.M)
  f_ids = {i for i, n in entry.findall(files) if n.endswith(file)}
  fn_ids = {i for i, n in entry.findall(names) if n == function}
  return any(
    re.search(rf'file_name_id={f} function_name_id={fn}\b', hlo_text) for f in f_ids for fn in fn_ids
  )
