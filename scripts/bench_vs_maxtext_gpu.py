"""jax3d's and MaxText's train step compiled side by side by XLA:GPU for 8 GPUs that are not attached:
peak memory, executed FLOPs and collective bytes per device per step, read the same way from both.

  python scripts/bench_vs_maxtext_gpu.py [--shapes=llama3_8b,llama2_7b] [--target=h100x8]
      [--maxtext-venv=~/.cache/jax3d-peer/maxtext] [--jax3d-python=PATH] [--hlo-dir=DIR]
      [--json=bench_vs_maxtext_gpu.json] [--md=PATH]

Each compile runs in a fresh process, one at a time (each takes 20-70 s and ~3 GB on 2 cores):
  jax3d    `python -m jax3d.inspect --target=KINDx8 --hlo=...` (jax3d's own build and compile path,
           jax3d/devices/gpu_target.py), with the MaxText venv's Python and jax3d on PYTHONPATH, so
           that one jax and one XLA compile both sides (--jax3d-python picks another interpreter);
  MaxText  scripts/maxtext_compile_gpu.py in MaxText's venv: MaxText's own ahead-of-time path
           (train_compile.py) on the same compile-only topology, the same GPU description
           (jax3d/devices/gpu_specs/) and the same XLA options (gpu_target.compiler_options()).

The MaxText venv: Python 3.12, MaxText's pinned packages (../shared/bench/maxtext/setup.sh builds
it at ~/.cache/jax3d-peer/maxtext) and JAX's CUDA plugin of its jax
(`pip install "jax[cuda12]==<its jax>"`; no GPU is needed). Without it: one `error:` line, exit 2.

Shapes (the same work on both sides: the script checks the tokens per optimizer step):
  llama3_8b  Llama 3 8B, seq 8192, 128 x 8192 tokens per step in 4 accumulation chunks of 4 rows per
             GPU; jax3d: docs/plan.md's 8 x H100 plan (dp 8, ZeRO-3 gathering per layer, 8 loss
             pieces); MaxText: base.yml, model_name=llama3-8b, ici_fsdp_parallelism=8.
  llama2_7b  Llama 2 7B as MaxText's GPU config (configs/gpu/models/llama2_7b.yml: seq 4096, 4 rows
             per GPU, no accumulation, fsdp 8), 32 x 4096 tokens per step; jax3d: dp 8, ZeRO-3 per
             layer, 8 loss pieces.
Both: fp32 weights and AdamW, bf16 compute, remat full; MaxText's attention is JAX's cuDNN one
(`attention=cudnn_flash_jax`: Transformer Engine, its GPU configs' choice, is not installed) and
its layers scanned (the 7B config's `scan_layers=false` would unroll 32 layers in the compile).

Read from each optimised HLO with jax3d/analysis/hlo.py (every op times the trip counts of the
loops around it; XLA's cost_analysis counts a loop's body once):
  peak       argument + output + temp - alias bytes (XLA's memory_analysis);
  FLOPs      2*M*N*K of every matmul (dots, also inside fusions, and cuBLAS GEMM calls), plus the
             fused attention kernels (cuDNN or Pallas/Triton calls, opaque to XLA) at their nominal
             causal work: forward 4*b*n*t*s*h/2, backward 2.5 times that, preprocess none;
  bytes      all-gather + reduce-scatter + all-reduce + all-to-all buffer bytes (the gathered
             result, the scattered operand, the reduced operand, the exchanged operand: a bf16
             reduction written as an all-to-all counts as its reduce-scatter would), by dtype;
             wire bytes in the JSON.
Exit status: 0 done; 1 a compile failed or the two sides' work differs; 2 bad flags or no venv.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, NoReturn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, 'scripts')]
from bench_vs_maxtext import python_info, tail  # noqa: E402  (scripts/, beside this file)

from jax3d.analysis import hlo as hlo_lib  # noqa: E402  (imports no jax)
from jax3d.devices import gpu_target  # noqa: E402
from jax3d.errors import ConfigError  # noqa: E402

DEFAULT_VENV = os.path.join(os.path.expanduser('~'), '.cache', 'jax3d-peer', 'maxtext')
SETUP = '../shared/bench/maxtext/setup.sh'
N_GPUS = 8
GIB = 2**30
COLLECTIVE_KINDS = ('all-gather', 'reduce-scatter', 'all-reduce', 'all-to-all')
TIMEOUT_S = 1800
KERNEL_TARGETS = tuple(t for t, _ in hlo_lib.ATTENTION_KERNELS)  # cuDNN's and Triton's calls

ZERO3 = {  # docs/plan.md's 8 x H100 plan for Llama 3 8B
  'mesh.dp': N_GPUS,
  'mesh.tp': 1,
  'mesh.pp': 1,
  'pipeline.microbatches': 1,
  'train.shard_params': 'true',
  'train.shard_params_gather': 'layer',
  'train.loss_chunks': 8,
  'train.remat': 'full',
  'train.compute_dtype': 'bfloat16',
  'train.param_dtype': 'float32',
}
MAXTEXT_COMMON = {
  'hardware': 'gpu',
  'dataset_type': 'synthetic',
  'enable_checkpointing': 'false',
  'skip_jax_distributed_system': 'true',
  'enable_goodput_recording': 'false',
  'monitor_goodput': 'false',
  'jax_cache_dir': '',
  'compile_topology': 'a3',
  'compile_topology_num_slices': 1,
  'ici_fsdp_parallelism': N_GPUS,
  'ici_data_parallelism': 1,
  'ici_tensor_parallelism': 1,
  'dtype': 'bfloat16',
  'weight_dtype': 'float32',
  'remat_policy': 'full',
  'attention': 'cudnn_flash_jax',
  'scan_layers': 'true',
}


@dataclasses.dataclass(frozen=True)
class Shape:
  """One comparison: the model and the work of an optimizer step, in both trainers' terms."""

  name: str
  title: str
  global_batch: int
  seq_len: int
  grad_accum: int
  jax3d_config: str  # configs/NAME.py
  jax3d_overrides: dict[str, Any]
  maxtext_yml: str  # relative to maxtext/configs/
  maxtext_overrides: dict[str, Any]

  @property
  def tokens(self) -> int:
    return self.global_batch * self.seq_len

  @property
  def rows_per_chunk(self) -> int:
    """Rows per GPU in one accumulation chunk (MaxText's per_device_batch_size)."""
    return self.global_batch // (self.grad_accum * N_GPUS)

  def jax3d_args(self, hlo_path: str, target: str, extra: Sequence[str] = ()) -> list[str]:
    """`python -m jax3d.inspect` arguments; `extra`: KEY=VALUE settings of jax3d's (--jax3d-config)."""
    over = ZERO3 | self.jax3d_overrides | dict(e.split('=', 1) for e in extra)
    over |= {
      'train.seq_len': self.seq_len,
      'train.global_batch_size': self.global_batch,
      'train.grad_accum': self.grad_accum,
    }
    config = os.path.join(REPO, 'configs', f'{self.jax3d_config}.py')
    head = ['-m', 'jax3d.inspect', f'--config={config}', f'--target={target}', '--json', f'--hlo={hlo_path}']
    return head + [f'--config.{k}={v}' for k, v in over.items()]

  def maxtext_args(self, run_name: str, out_dir: str) -> list[str]:
    """MaxText key=value overrides (after its yml)."""
    over = MAXTEXT_COMMON | self.maxtext_overrides
    over |= {
      'run_name': run_name,
      'base_output_directory': out_dir,
      'max_target_length': self.seq_len,
      'per_device_batch_size': self.rows_per_chunk,
      'gradient_accumulation_steps': self.grad_accum,
    }
    return [f'{k}={v}' for k, v in over.items()]


SHAPES = {
  s.name: s
  for s in (
    Shape(
      'llama3_8b',
      'Llama 3 8B, seq 8192, 128 x 8192 tokens per step (4 chunks of 4 rows per GPU)',
      global_batch=128,
      seq_len=8192,
      grad_accum=4,
      jax3d_config='llama3_8b',
      jax3d_overrides={},
      maxtext_yml='base.yml',
      maxtext_overrides={'model_name': 'llama3-8b'},
    ),
    Shape(
      'llama2_7b',
      "Llama 2 7B, seq 4096, 32 x 4096 tokens per step (4 rows per GPU, no accumulation; MaxText's GPU config)",
      global_batch=32,
      seq_len=4096,
      grad_accum=1,
      jax3d_config='llama3_8b',
      jax3d_overrides={
        'model.n_kv_heads': 32,
        'model.d_ff': 11008,
        'model.vocab_size': 32000,
        'model.rope_theta': 10000.0,
        'model.norm_eps': 1e-5,
        'model.max_seq_len': 4096,
      },
      maxtext_yml='gpu/models/llama2_7b.yml',
      maxtext_overrides={},
    ),
  )
}


# ---------------------------------------------------------------------------------------------
# Reading an optimised HLO (both trainers the same way)
# ---------------------------------------------------------------------------------------------
def _dims(shape: str) -> list[int]:
  """The dimensions of the first array in an HLO shape string."""
  found = hlo_lib.arrays(shape)
  return found[0][1] if found else []


def _operand_dims(ins: dict, shapes: dict[str, str], i: int) -> list[int]:
  """Operand i's dimensions: its instruction's shape, else the call's operand_layout_constraints."""
  if i < len(ins['operands']) and ins['operands'][i] in shapes:
    return _dims(shapes[ins['operands'][i]])
  m = re.search(r'operand_layout_constraints=\{(.*?)\}, \w', ins['attrs'])
  found = hlo_lib.arrays(m.group(1)) if m else []
  return found[i][1] if i < len(found) else []


def cublas_flops(hlo: dict, mult: dict[str, int]) -> float:
  """2*M*N*K of XLA:GPU's cuBLAS GEMM calls (`__cublas$gemm`, `__cublas$lt$matmul...`: dots that
  left the HLO, read from their dot_dimension_numbers), times their loops' trip counts."""
  total = 0.0
  for cname, instrs in hlo['computations'].items():
    shapes = {i['name']: i['shape'] for i in instrs}
    for ins in instrs:
      if ins['op'] != 'custom-call' or '__cublas$' not in ins['attrs'] or not mult.get(cname):
        continue
      out = _dims(ins['shape'])
      lhs = _operand_dims(ins, shapes, 0)
      cd = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins['attrs'])
      cdims = [int(c.strip('" ')) for c in cd.group(1).split(',') if c.strip()] if cd else []
      k = 1
      for c in cdims:
        k *= lhs[c] if c < len(lhs) else 1
      n = 1
      for d in out:
        n *= d
      total += 2.0 * n * k * mult[cname]
  return total


def attention_calls(hlo: dict, mult: dict[str, int]) -> dict[str, dict]:
  """The fused attention kernels (cuDNN custom calls, Pallas/Triton calls) by kind: 'forward',
  'backward', 'preprocess'; calls per step and nominal FLOPs (module docstring), the operands'
  shapes (q, k: K/V heads as the kernel receives them)."""
  out: dict[str, dict] = defaultdict(lambda: {'calls': 0, 'flops': 0.0, 'q': [], 'k': []})
  for cname, instrs in hlo['computations'].items():
    times = mult.get(cname, 0)
    shapes = {i['name']: i['shape'] for i in instrs}
    for ins in instrs:
      target = (re.search(r'custom_call_target="([^"]*)"', ins['attrs']) or [None, ''])[1]
      if not times or ins['op'] != 'custom-call' or not target.startswith(KERNEL_TARGETS):
        continue
      op_name = (re.search(r'op_name="([^"]*)"', ins['attrs']) or [None, ''])[1]
      if 'preprocess' in op_name:
        kind = 'preprocess'
      elif 'Backward' in target or 'backward' in op_name:
        kind = 'backward'
      else:
        kind = 'forward'
      q, k = _operand_dims(ins, shapes, 0), _operand_dims(ins, shapes, 1)
      forward = 0.0
      if kind != 'preprocess' and len(q) == 4 and len(k) == 4:  # [b, t, n, h], [b, s, n_kv, h]
        b, t, n, h = q
        forward = 4.0 * b * n * t * k[1] * h / 2
      rec = out[kind]
      rec['calls'] += times
      rec['flops'] += forward * (2.5 if kind == 'backward' else 1.0) * times
      rec['q'], rec['k'] = q, k
  return dict(out)


def read_hlo(text: str) -> dict:
  """FLOPs, attention kernels and collectives per device per step of an optimised HLO module."""
  hlo = hlo_lib.parse_hlo(text)
  mult, unknown = hlo_lib.multiplicities(hlo)
  parts = re.search(r'num_partitions=(\d+)', text)
  n = int(parts.group(1)) if parts else N_GPUS
  attention = attention_calls(hlo, mult)
  matmul = hlo_lib.matmul_flops(hlo) + cublas_flops(hlo, mult)
  attn_flops = sum(v['flops'] for v in attention.values())
  by_kind: dict[str, dict] = {}
  for c in hlo_lib.collectives(hlo, (n,), ('all',)):
    d = by_kind.setdefault(c['kind'], {'count': 0, 'buffer_bytes': 0.0, 'wire_bytes': 0.0, 'dtypes': {}})
    d['count'] += c['count']
    d['buffer_bytes'] += c['buffer_bytes']
    d['wire_bytes'] += c['wire_bytes']
    shape = next(i['shape'] for i in hlo['computations'][c['computation']] if i['name'] == c['name'])
    per = defaultdict(float)  # the op's bytes over the dtypes of its (tuple) shape, by size
    for dtype, dims in hlo_lib.arrays(shape):
      per[dtype] += hlo_lib.shape_bytes(f'{dtype}[{",".join(map(str, dims))}]')
    whole = sum(per.values()) or 1.0
    for dtype, b in per.items():
      d['dtypes'][dtype] = d['dtypes'].get(dtype, 0.0) + c['buffer_bytes'] * b / whole
  return {
    'matmul_flops': matmul,
    'attention_flops': attn_flops,
    'executed_flops': matmul + attn_flops,
    'attention': attention,
    'collectives': by_kind,
    'collective_bytes': sum(by_kind.get(k, {}).get('buffer_bytes', 0.0) for k in COLLECTIVE_KINDS),
    'unknown_trip_counts': unknown,
  }


def peak_bytes(memory: dict[str, int]) -> int:
  """A compiled step's peak per device: argument + output + temp - alias (XLA's memory_analysis)."""
  return memory['argument'] + memory['output'] + memory['temp'] - memory['alias']


# ---------------------------------------------------------------------------------------------
# The two compiles
# ---------------------------------------------------------------------------------------------
def error(msg: str, code: int = 2, log: str = '') -> NoReturn:
  """`error: msg` on one line (and a failed run's log tail after it), then exit `code`."""
  print(f'error: {msg}', file=sys.stderr)
  if log:
    print('---- last lines of its output ----\n' + log.rstrip(), file=sys.stderr)
  sys.exit(code)


def check_venv(venv: str) -> str:
  """MaxText's venv's python; one `error:` line (exit 2) when the venv lacks it, MaxText or JAX's
  CUDA plugin, saying how to build it."""
  python = os.path.join(venv, 'bin', 'python')
  site = glob.glob(os.path.join(venv, 'lib', 'python3*', 'site-packages'))
  missing = [
    what
    for what, there in (
      ('bin/python', os.path.exists(python)),
      ('maxtext', any(os.path.isdir(os.path.join(s, 'maxtext')) for s in site)),
      ("JAX's CUDA plugin", any(glob.glob(os.path.join(s, 'jax_cuda1*_plugin')) for s in site)),
    )
    if not there
  ]
  if missing:
    error(
      f'--maxtext-venv={venv}: no MaxText venv with a CUDA plugin there (missing: {", ".join(missing)}); '
      f'build it with {SETUP} (MAXTEXT_VENV={venv}) and then {venv}/bin/pip install "jax[cuda12]==<its jax>"'
    )
  return python


def _run(cmd: list[str], env: dict[str, str], log_path: str) -> tuple[str, float]:
  """Runs cmd (cwd REPO), its stdout returned and both streams written to log_path; exit 1 on failure."""
  t0 = time.perf_counter()
  r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
  with open(log_path, 'w') as f:
    f.write(r.stdout + r.stderr)
  if r.returncode:
    error(
      f'{" ".join(cmd[:4])} ... failed (exit {r.returncode}; log {log_path})', 1, tail(r.stderr or r.stdout)
    )
  return r.stdout, time.perf_counter() - t0


def _env(**extra: str) -> dict[str, str]:
  env = {k: v for k, v in os.environ.items() if k not in ('XLA_FLAGS', 'PYTHONPATH')}
  return env | {'JAX_PLATFORMS': 'cpu'} | extra


def compile_jax3d(
  python: str, shape: Shape, target: gpu_target.Target, out: str, extra: Sequence[str] = ()
) -> dict:
  """jax3d's step through `python -m jax3d.inspect --target`: its JSON, the HLO read, the peak."""
  stdout, wall = _run(
    [python, *shape.jax3d_args(out + '.hlo', target.name, extra)], _env(PYTHONPATH=REPO), out + '.log'
  )
  r = json.loads(next(line for line in reversed(stdout.splitlines()) if line.startswith('{')))
  lay = r['layout']
  with open(out + '.hlo') as f:
    read = read_hlo(f.read())
  mem = r['memory_bytes']
  return read | {
    'peak_bytes': mem['peak_estimate'],
    'memory': {k: mem[k] for k in ('argument', 'output', 'alias', 'temp')},
    'tokens_per_step': lay['micro_batch_per_dp_shard'] * lay['dp'] * lay['grad_accum'] * lay['seq_len'],
    'attention_choice': r['attention_kernel'],
    'wall_s': wall,
  }


def compile_maxtext(python: str, shape: Shape, target: gpu_target.Target, out: str) -> dict:
  """MaxText's step through scripts/maxtext_compile_gpu.py: its JSON, the HLO read, the peak."""
  site = glob.glob(os.path.join(os.path.dirname(os.path.dirname(python)), 'lib', 'python3*', 'site-packages'))
  yml = os.path.join(site[0], 'maxtext', 'configs', shape.maxtext_yml)
  spec = os.path.join(REPO, 'jax3d', 'devices', 'gpu_specs', gpu_target.SPECS[target.kind])
  cmd = [
    python,
    os.path.join(REPO, 'scripts', 'maxtext_compile_gpu.py'),
    out,
    spec,
    f'1x{target.nodes}x{target.per_node}',
    json.dumps(gpu_target.compiler_options()),
    yml,
    *shape.maxtext_args(os.path.basename(out), out + '.mt'),
  ]
  _, wall = _run(cmd, _env(DECOUPLE_GCLOUD='TRUE'), out + '.log')
  with open(out + '.json') as f:
    r = json.load(f)
  with open(out + '.hlo') as f:
    read = read_hlo(f.read())
  return read | {
    'peak_bytes': peak_bytes(r['memory']),
    'memory': r['memory'],
    'tokens_per_step': r['global_batch'] * r['seq_len'],
    'config': r['config'],
    'wall_s': wall,
  }


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------
def _dtypes(c: dict) -> str:
  """'f32 80.0, bf16 65.9': a collective kind's GiB by dtype, largest first (under 0.05 GiB left out)."""
  parts = sorted(c.get('dtypes', {}).items(), key=lambda kv: -kv[1])
  return ', '.join(f'{d} {b / GIB:.1f}' for d, b in parts if b >= GIB / 20) or 'none'


def rows(j: dict, m: dict) -> list[tuple[str, str, str, str]]:
  """(what, jax3d, MaxText, jax3d / MaxText) of one shape."""

  def ratio(a: float, b: float) -> str:  # '-' when MaxText's figure is (about) nothing
    return f'{a / b:.2f}' if abs(b) > 1e-3 * abs(a) and b else '-'

  figures = (  # (what, its value in each result, the unit's scale, decimals)
    ('peak GiB', lambda r: r['peak_bytes'], GIB, 2),
    ('executed FLOPs (matmuls + attention), PF', lambda r: r['executed_flops'], 1e15, 3),
    ('  matmuls, PF', lambda r: r['matmul_flops'], 1e15, 3),
    ('  attention kernels (nominal), PF', lambda r: r['attention_flops'], 1e15, 3),
    (
      'collective bytes (all-gather + reduce-scatter + all-reduce + all-to-all), GiB',
      lambda r: r['collective_bytes'],
      GIB,
      1,
    ),
  )
  table = [
    (what, f'{get(j) / scale:.{dec}f}', f'{get(m) / scale:.{dec}f}', ratio(get(j), get(m)))
    for what, get, scale, dec in figures
  ]
  for kind in COLLECTIVE_KINDS:
    cj, cm = j['collectives'].get(kind, {}), m['collectives'].get(kind, {})
    bj, bm = cj.get('buffer_bytes', 0.0), cm.get('buffer_bytes', 0.0)
    table.append(
      (
        f'  {kind}, GiB (by dtype)',
        f'{bj / GIB:.1f} ({_dtypes(cj)})',
        f'{bm / GIB:.1f} ({_dtypes(cm)})',
        ratio(bj, bm),
      )
    )
  calls = {
    who: ' / '.join(str(r['attention'].get(k, {}).get('calls', 0)) for k in ('forward', 'backward'))
    for who, r in (('j', j), ('m', m))
  }
  table.append(('attention kernel calls per step (forward / backward)', calls['j'], calls['m'], ''))
  table.append(('compile process, s', f'{j["wall_s"]:.0f}', f'{m["wall_s"]:.0f}', ''))
  return table


def format_table(title: str, table: Sequence[tuple[str, str, str, str]]) -> list[str]:
  """A Markdown table under its title."""
  lines = [
    title + ', per device per step:',
    '',
    '| | jax3d | MaxText | jax3d / MaxText |',
    '|---|---:|---:|---:|',
  ]
  return lines + [f'| {w} | {a} | {b} | {r} |' for w, a, b, r in table]


# ---------------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
  def error(self, message: str) -> NoReturn:  # one line, exit 2
    self.exit(2, f'error: {message}\n')


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  """The flags; a bad one exits 2 with one `error:` line."""
  ap = _Parser(prog='bench_vs_maxtext_gpu.py', description=__doc__.split('\n')[0])
  ap.add_argument('--shapes', default=','.join(SHAPES), help=f'comma-separated: {", ".join(SHAPES)}')
  ap.add_argument(
    '--target', default='h100x8', help=f'KINDx{N_GPUS} (KIND one of {", ".join(gpu_target.SPECS)})'
  )
  ap.add_argument(
    '--maxtext-venv', default=DEFAULT_VENV, help=f"MaxText's venv with JAX's CUDA plugin ({SETUP})"
  )
  ap.add_argument('--jax3d-python', default=None, help="jax3d's interpreter (default: the MaxText venv's)")
  ap.add_argument(
    '--jax3d-config',
    action='append',
    default=[],
    metavar='KEY=VALUE',
    help="a jax3d setting over the shape's (repeatable), e.g. train.grad_reduce_dtype=bfloat16",
  )
  ap.add_argument(
    '--hlo-dir', default=None, help='keep the HLOs, JSONs and logs here (default: a temporary folder)'
  )
  ap.add_argument('--json', default='bench_vs_maxtext_gpu.json', help='results (JSON)')
  ap.add_argument('--md', default=None, help='also write the printed tables here')
  a = ap.parse_args(argv)
  a.shape_list = [s.strip() for s in a.shapes.split(',') if s.strip()]
  bad = [s for s in a.shape_list if s not in SHAPES]
  if bad or not a.shape_list:
    ap.error(f'--shapes={a.shapes!r}: {", ".join(bad) or "none"} is not one of {", ".join(SHAPES)}')
  for e in a.jax3d_config:
    if '=' not in e:
      ap.error(f'--jax3d-config={e!r} is invalid: KEY=VALUE, e.g. train.grad_reduce_dtype=bfloat16')
  try:
    target = gpu_target.parse(a.target)
  except ConfigError as e:
    ap.error(str(e))
  if target.n != N_GPUS:
    ap.error(f'--target={a.target!r}: {N_GPUS} GPUs (one node, as MaxText compiles them), e.g. h100x{N_GPUS}')
  a.target_gpus = target
  return a


def _commit() -> str:
  r = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=REPO, capture_output=True, text=True)
  return r.stdout.strip() or 'unknown'


def main(argv: Sequence[str] | None = None) -> int:
  """Compiles each shape with both trainers, prints the tables, writes the JSON; the exit status."""
  a = parse_args(argv)
  mt_python = check_venv(a.maxtext_venv)
  j_python = a.jax3d_python or mt_python
  infos = {'jax3d': python_info(j_python), 'maxtext': python_info(mt_python)}
  for who, info in infos.items():
    print(f'{who}: {info["executable"]} (Python {info["python"]}, jax {info["jax"]})')
  out_dir = a.hlo_dir or tempfile.mkdtemp(prefix='bench_vs_maxtext_gpu-')
  os.makedirs(out_dir, exist_ok=True)
  print(f'HLOs and logs: {out_dir}', flush=True)
  results, text = [], []
  for name in a.shape_list:
    shape = SHAPES[name]
    got = {}
    for who, compile_fn, python in (
      ('jax3d', functools.partial(compile_jax3d, extra=a.jax3d_config), j_python),
      ('maxtext', compile_maxtext, mt_python),
    ):
      print(f"{name}: compiling {who}'s step for {a.target_gpus.name} ...", flush=True)
      got[who] = compile_fn(python, shape, a.target_gpus, os.path.join(out_dir, f'{name}.{who}'))
    tokens = {who: r['tokens_per_step'] for who, r in got.items()}
    if len(set(tokens.values()) | {shape.tokens}) != 1:
      error(f'{name}: the two steps do different work: tokens per step {tokens}, meant {shape.tokens}', 1)
    table = rows(got['jax3d'], got['maxtext'])
    text += [*format_table(f'{shape.title}, {a.target_gpus.name}', table), '']
    results.append({'shape': name, 'title': shape.title, 'tokens_per_step': shape.tokens} | got)
  print('\n' + '\n'.join(text))
  record = {
    'command': ' '.join(['scripts/bench_vs_maxtext_gpu.py', *(sys.argv[1:] if argv is None else argv)]),
    'date': datetime.date.today().isoformat(),
    'commit': _commit(),
    'target': a.target_gpus.name,
    'python': infos,
    'hlo_dir': out_dir,
    'results': results,
  }
  with open(a.json, 'w') as f:
    json.dump(record, f, indent=1)
  if a.md:
    with open(a.md, 'w') as f:
      f.write('\n'.join(text))
  print(f'wrote {a.json}' + (f' and {a.md}' if a.md else ''))
  return 0


if __name__ == '__main__':
  sys.exit(main())
