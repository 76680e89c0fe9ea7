"""jax3d against MaxText, side by side: the same shape and layouts, interleaved, one table.

  python scripts/bench_vs_maxtext.py [--layouts=8x1x1,4x1x2,1x2x4,2x2x2m4,2x4x1m4,4x1x2kv2]
      [--dtypes=float32,bfloat16] [--rounds=2] [--steps=20] [--json=bench_vs_maxtext.json]
      [--maxtext-venv=PATH|none] [--jax3d-python=PATH] [--jax3d-venv=PATH] [--md=PATH]
      [--cpu-profile]

Both trainers run the shape of scripts/bench_step.py on 8 fake CPU devices (4 layers, d_model 256,
4 heads of 64, d_ff 1024, vocab 1024, seq 128, global batch 8, full remat, AdamW), 20 steps, each
run a fresh process in a fresh temporary workdir. Layout DPxPPxTP (jax3d's order); pipelined
layouts use 4 micro-batches (GPipe) unless given as DPxPPxTPmM; a `kvK` suffix sets K key/value
heads (grouped-query attention), e.g. 4x1x2kv2 = 4 query heads over 2 KV heads at dp4 tp2.
Dtypes: float32, and bfloat16 = MaxText's `dtype=bfloat16` (float32 weights, bf16 compute) =
jax3d's `train.compute_dtype=bfloat16 train.param_dtype=float32`.

Interleaved: for each round, every (layout, dtype) runs jax3d and then MaxText, then the next
round, so that both see the same minutes of a shared machine.

What is measured
  s/step      median of steps 5-19 counted from 0 (MaxText's numbering; jax3d's step records 6-20),
              wall time between consecutive steps, including each trainer's per-step host work
              (jax3d: `log.every=1` records from WORKDIR/metrics.jsonl, field `step_time_s`;
              MaxText: the timestamps of its `completed step` log lines, `log_period=1`, as
              ../shared/bench/maxtext/run.sh computes them).
  first step  process start to step 0 done (imports, data, init, compile, the first step): jax3d
              from the subprocess's start to the arrival of its `first step (compile + run)` line;
              MaxText as run.sh prints it. jax3d's split (to its summary, init, compile) goes to
              the JSON and the start-up lines under the table.
  FLOP/s      model FLOPs per step / s/step, with the model FLOPs from jax3d/model/formulas.py
              (6N per token without the input embedding, + 12*L*h*s attention). The step executes
              more under full remat: one forward of the layers recomputed
              (formulas.stage_forward_flops + a third of the attention term); that figure is in
              the header and the JSON (`executed_flops`).
  GEMM roof   `jnp.dot` throughput at the step's matmul sizes, in the same dtype, measured in a
              subprocess before the first round and after each round (same Python and jax as
              jax3d's runs), so that each run has a roof from its own minutes:
              [T,d]x[d,f] (gate, up), [T,f]x[f,d] (down), [T,d]x[d,hd*(n+2k)] (fused QKV),
              [T,d]x[d,d] (attention output), [T,d]x[d,V] (vocabulary head), T = global batch x
              seq = 1024 rows; each the median of timed repetitions after warm-up; the roof is the
              FLOP-weighted one (total FLOPs / the sum of each matmul's FLOPs over its rate: the
              rate the step's matmuls would reach, each at its own size).

The honest roof on this machine: the 8 fake devices are threads of one process sharing the
machine's cores (2 here), so the step's achievable rate is what the cores reach together, not 8x a
device. One device's `jnp.dot` already uses XLA:CPU's intra-op thread pool over all cores; to see
whether two devices running at once get more out of the cores, the same dot is also timed on 2
devices concurrently (aggregate rate). The roof is the higher of the two (FLOP-weighted). A run's
roof is the mean of the measurements just before and just after its round (other jobs' load moves
the roof by 20-50% within minutes on a shared machine); the fraction in the table is the median
over a row's rounds of each run's model FLOP/s over its own roof. The
roof uses the full (one-device) matmul sizes: a layout that splits them into smaller per-device
matmuls pays for that, as it should.

Same Python and jax for both: jax3d runs in a second venv built from the MaxText venv's own Python
with `pip install -e REPO jax==V jaxlib==V` (V = MaxText's jax) and MaxText's pinned versions as
constraints, at --jax3d-venv (default ~/.cache/jax3d-peer/jax3d), created on first use;
--jax3d-python overrides it. Without MaxText (--maxtext-venv=none, or no ../shared/bench/maxtext),
jax3d runs alone with this Python (or --jax3d-python).

--cpu-profile: each run under Linux `perf record` (sampling at 499 Hz), and a second table of the
CPU milliseconds per step that the device threads (XLA's `tf_XLAEigen` pool) spent by kind:
YNNPACK matmul kernels, Eigen matmuls, other YNNPACK kernels (transposes, reductions), XLA's own
compiled loop fusions (JIT code), collectives, libc (memmove, malloc), the kernel, the rest of the
runtime. All samples of the run divided by its steps (so compile-free, but init and the warm-up
steps are in). This is where the cores go, unlike a trace's per-op durations, which count the
time a thread waits for a core as time in its op. Needs `perf` and perf_event_paranoid <= 2.

Exit status: 0 done; 1 a run failed (the tail of its log is printed); 2 bad flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from jax3d.model import formulas  # noqa: E402  (imports no jax)

MAXTEXT_DIR = os.path.join(os.path.dirname(REPO), 'shared', 'bench', 'maxtext')
DEFAULT_JAX3D_VENV = os.path.join(os.path.expanduser('~'), '.cache', 'jax3d-peer', 'jax3d')
DEFAULT_LAYOUTS = '8x1x1,4x1x2,1x2x4,2x2x2m4,2x4x1m4,4x1x2kv2'
N_DEVICES = 8
SKIP = 5  # steps 0..4 (compile, warm-up) are not timed, as in run.sh
RUN_TIMEOUT_S = 900


@dataclasses.dataclass(frozen=True)
class Shape:
  """The benchmark's model and batch; has the fields jax3d/model/formulas.py reads from a Dims."""

  n_layers: int = 4
  d_model: int = 256
  n_heads: int = 4
  n_kv_heads: int = 4
  d_ff: int = 1024
  vocab_size: int = 1024
  seq_len: int = 128
  global_batch: int = 8
  qkv_bias: bool = False  # MaxText's Llama has none of these
  qk_norm: bool = False
  tie_embeddings: bool = False
  n_experts: int = 0  # dense: a feed-forward of d_ff, no mixture of experts
  top_k: int = 0
  d_expert: int = 0
  d_shared: int = 0

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads

  @property
  def vocab_padded(self) -> int:
    return self.vocab_size

  @property
  def tokens(self) -> int:
    return self.global_batch * self.seq_len


@dataclasses.dataclass(frozen=True)
class Layout:
  """One layout: DPxPPxTP, micro-batches, KV heads."""

  spec: str
  dp: int
  pp: int
  tp: int
  microbatches: int
  n_kv_heads: int

  @property
  def label(self) -> str:
    s = f'{self.dp}x{self.pp}x{self.tp}'
    if self.pp > 1:
      s += f' m{self.microbatches}'
    if self.n_kv_heads != Shape.n_kv_heads:
      s += f' kv{self.n_kv_heads}'
    return s

  def shape(self) -> Shape:
    return dataclasses.replace(Shape(), n_kv_heads=self.n_kv_heads)


def parse_layout(spec: str) -> Layout:
  """'4x1x2', '2x2x2m4', '4x1x2kv2' -> Layout; ValueError saying what is valid."""
  m = re.fullmatch(r'(\d+)x(\d+)x(\d+)(?:m(\d+))?(?:kv(\d+))?', spec.strip())
  if not m:
    raise ValueError(f'--layouts: {spec!r} is not DPxPPxTP[mM][kvK] (e.g. 4x1x2, 2x2x2m4, 4x1x2kv2)')
  dp, pp, tp = int(m[1]), int(m[2]), int(m[3])
  mb = int(m[4]) if m[4] else (4 if pp > 1 else 1)
  kv = int(m[5]) if m[5] else Shape.n_kv_heads
  s = Shape()
  problems = []
  if dp * pp * tp != N_DEVICES:
    problems.append(f'dp*pp*tp = {dp * pp * tp}, not the {N_DEVICES} devices both trainers use')
  if min(dp, pp, tp, mb, kv) < 1:
    problems.append('every number must be >= 1')
  elif s.global_batch % (dp * mb):
    problems.append(f'global batch {s.global_batch} is not divisible by dp*microbatches = {dp * mb}')
  if min(tp, kv) >= 1 and (s.n_heads % kv or kv % tp or s.n_heads % tp):
    problems.append(f'{s.n_heads} heads over {kv} KV heads, both divisible by tp={tp}, is needed')
  if pp >= 1 and s.n_layers % pp:
    problems.append(f'{s.n_layers} layers are not divisible by pp={pp}')
  if problems:
    raise ValueError(f'--layouts: {spec!r}: ' + '; '.join(problems))
  return Layout(spec.strip(), dp, pp, tp, mb, kv)


def jax3d_args(layout: Layout, dtype: str, steps: int, workdir: str) -> list[str]:
  """`python -m jax3d.train` arguments: the shape, the layout, and a run that only trains."""
  s = layout.shape()
  overrides = {
    'mesh.dp': layout.dp,
    'mesh.pp': layout.pp,
    'mesh.tp': layout.tp,
    'pipeline.microbatches': layout.microbatches,
    'model.n_layers': s.n_layers,
    'model.d_model': s.d_model,
    'model.n_heads': s.n_heads,
    'model.n_kv_heads': s.n_kv_heads,
    'model.d_ff': s.d_ff,
    'model.vocab_size': s.vocab_size,
    'train.seq_len': s.seq_len,
    'train.global_batch_size': s.global_batch,
    'train.remat': 'full',
    'train.compute_dtype': dtype,
    'train.param_dtype': 'float32',
    'train.steps': steps,
    'log.every': 1,  # one record per step (MaxText: log_period=1)
    'log.progress': 'false',
    'eval.every': 0,  # no evaluation between steps (one after the last, which is not waited for)
    'eval.batches': 1,
    'checkpoint.every': 0,  # no checkpoint between steps
    'sample.tokens': 1,
  }
  return ['-m', 'jax3d.train', f'--workdir={workdir}'] + [f'--config.{k}={v}' for k, v in overrides.items()]


def maxtext_args(layout: Layout, dtype: str, steps: int) -> list[str]:
  """run.sh's arguments: DP TP PP DTYPE (its order) and the overrides of this layout."""
  s = layout.shape()
  extra = []
  if layout.pp > 1:  # GPipe: L/pp layers per stage per pass
    extra += [
      f'num_pipeline_microbatches={layout.microbatches}',
      f'num_layers_per_pipeline_stage={s.n_layers // layout.pp}',
    ]
  if s.n_kv_heads != Shape.n_kv_heads:
    extra.append(f'base_num_kv_heads={s.n_kv_heads}')
  if steps != 20:
    extra.append(f'steps={steps}')
  return [str(layout.dp), str(layout.tp), str(layout.pp), dtype] + extra


# ---------------------------------------------------------------------------------------------
# FLOPs (jax3d's formulas) and the GEMM roof
# ---------------------------------------------------------------------------------------------
def step_flops(shape: Shape) -> dict[str, float]:
  """Model FLOPs per step (6N + attention, formulas.flops_per_token) and executed FLOPs under full
  remat (+ one forward of the layers: formulas.stage_forward_flops + the attention term's forward
  third)."""
  model = formulas.flops_per_token(shape, shape.seq_len) * shape.tokens
  recompute = formulas.stage_forward_flops(shape, shape.n_layers, shape.tokens)
  recompute += formulas.attention_flops_per_token(shape, shape.seq_len) / 3 * shape.tokens
  return {'model': model, 'executed': model + recompute}


def gemm_shapes(shape: Shape) -> list[tuple[str, tuple[int, int, int], int]]:
  """(name, (rows, inner, cols), count per forward) of the step's matmuls, all tokens as rows."""
  t, d, f, v = shape.tokens, shape.d_model, shape.d_ff, shape.vocab_size
  qkv = shape.head_dim * (shape.n_heads + 2 * shape.n_kv_heads)
  L = shape.n_layers
  return [
    ('gate/up', (t, d, f), 2 * L),
    ('down', (t, f, d), L),
    ('qkv', (t, d, qkv), L),
    ('attn out', (t, d, d), L),
    ('vocab head', (t, d, v), 1),
  ]


def weighted_roof(rates: dict[str, float], shape: Shape) -> float:
  """FLOP-weighted GEMM rate (FLOP/s) of the step's matmuls: total FLOPs / sum(FLOPs_i / rate_i).
  `rates` maps 'RxKxC' to FLOP/s."""
  total = spent = 0.0
  for _, (m, k, n), count in gemm_shapes(shape):
    flops = 2.0 * m * k * n * count
    total += flops
    spent += flops / rates[f'{m}x{k}x{n}']
  return total / spent


ROOF_CHILD = r"""
import json, statistics, sys, time
import jax, jax.numpy as jnp
spec = json.loads(sys.argv[1])
devs = jax.devices()[:2]
dot = jax.jit(jnp.dot)
def timed(fn, reps, inner):
  for _ in range(2):
    fn(inner)
  ts = []
  for _ in range(reps):
    t = time.perf_counter(); fn(inner); ts.append((time.perf_counter() - t) / inner)
  return statistics.median(ts)
out = {}
for dtype in spec['dtypes']:
  for m, k, n in spec['shapes']:
    a0 = jax.random.normal(jax.random.key(0), (m, k), jnp.float32).astype(dtype)
    b0 = jax.random.normal(jax.random.key(1), (k, n), jnp.float32).astype(dtype)
    a = [jax.device_put(a0, d) for d in devs]
    b = [jax.device_put(b0, d) for d in devs]
    def run(inner, ndev):
      rs = [dot(a[i], b[i]) for _ in range(inner) for i in range(ndev)]
      for r in rs:
        r.block_until_ready()
    flops = 2.0 * m * k * n
    one = timed(lambda inner: run(inner, 1), spec['reps'], spec['inner'])
    two = timed(lambda inner: run(inner, len(devs)), spec['reps'], spec['inner'])
    out[f'{dtype} {m}x{k}x{n}'] = {'1dev': flops / one, '2dev': len(devs) * flops / two}
print('ROOF ' + json.dumps(out))
"""


def measure_roof(python: str, dtypes: Sequence[str], shapes: Sequence[Shape], reps: int = 11) -> dict:
  """jnp.dot FLOP/s per dtype and matmul size on 1 device and on 2 devices at once (a subprocess
  with 2 fake CPU devices), and the FLOP-weighted roof per (dtype, shape)."""
  sizes = sorted({dims for s in shapes for _, dims, _ in gemm_shapes(s)})
  spec = {'dtypes': list(dtypes), 'shapes': sizes, 'reps': reps, 'inner': 3}
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=2', JAX_PLATFORMS='cpu')
  r = subprocess.run(
    [python, '-c', ROOF_CHILD, json.dumps(spec)], env=env, capture_output=True, text=True, timeout=900
  )
  line = next((l for l in r.stdout.splitlines() if l.startswith('ROOF ')), None)
  if r.returncode or line is None:
    fail('the GEMM roof measurement failed', (r.stdout + r.stderr)[-3000:])
  per = json.loads(line[5:])
  roofs = {}
  for dtype in dtypes:
    for s in shapes:
      w = {
        mode: weighted_roof({k.split()[1]: v[mode] for k, v in per.items() if k.startswith(dtype + ' ')}, s)
        for mode in ('1dev', '2dev')
      }
      roofs[f'{dtype} kv{s.n_kv_heads}'] = dict(w, roof=max(w.values()))
  return {'per_gemm': per, 'weighted': roofs}


# ---------------------------------------------------------------------------------------------
# One run of each trainer
# ---------------------------------------------------------------------------------------------
class RunFailed(RuntimeError):
  """A run that did not give its figures; the message names it, `log` is its output's tail."""

  def __init__(self, msg: str, log: str) -> None:
    super().__init__(msg)
    self.log = log


def fail(msg: str, log: str = '') -> None:
  """Prints `error: msg` and the log's tail, exits 1."""
  print(f'error: {msg}', file=sys.stderr)
  if log:
    print('---- last lines of its output ----\n' + log.rstrip(), file=sys.stderr)
  sys.exit(1)


def tail(text: str, n: int = 25) -> str:
  return '\n'.join(text.rstrip().splitlines()[-n:])


def median_step(records: Sequence[dict], skip: int = SKIP) -> tuple[float, int]:
  """(median step_time_s, how many) of jax3d's per-step records after the first `skip` steps
  (step numbers start at 1: steps skip+1.. are MaxText's `skip`.. counted from 0)."""
  times = [r['step_time_s'] for r in records if 'step_time_s' in r and r['step'] > skip]
  if not times:
    raise ValueError('no step records after the warm-up steps')
  return statistics.median(times), len(times)


def startup_split(lines: Sequence[tuple[float, str]]) -> dict[str, float | None]:
  """Seconds from process start to jax3d's landmarks: its summary (imports, data, setup), the
  initialised state, the compiled step, the first step done."""
  marks = {
    'summary': r'^jax3d: ',
    'init': r'^(initialised|resumed)',
    'compiled': r'compiled the train step',
    'first_step': r'first step \(compile \+ run\)',
  }
  out: dict[str, float | None] = dict.fromkeys(marks)
  for t, line in lines:
    for k, pat in marks.items():
      if out[k] is None and re.search(pat, line.strip()):
        out[k] = t
  return out


def run_jax3d(
  python: str, layout: Layout, dtype: str, steps: int, logdir: str, tag: str, profile: bool = False
) -> dict:
  """One `python -m jax3d.train` in a fresh workdir; stopped (SIGKILL to its process group) once
  the last step's record is written, so its final evaluation, checkpoint and sample are skipped.
  With `profile`, `perf record` attached to it (result key 'cpu_ms')."""
  workdir = tempfile.mkdtemp(prefix='jax3d-', dir=logdir)
  log_path = os.path.join(logdir, f'{tag}.log')
  env = dict(
    os.environ,
    XLA_FLAGS=f'--xla_force_host_platform_device_count={N_DEVICES}',
    JAX_PLATFORMS='cpu',
    PYTHONUNBUFFERED='1',
  )
  lines: list[tuple[float, str]] = []
  done = threading.Event()
  last = re.compile(rf'^step\s+{steps}/{steps}\b')
  t0 = time.monotonic()
  proc = subprocess.Popen(
    [python, *jax3d_args(layout, dtype, steps, workdir)],
    cwd=workdir,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    start_new_session=True,
  )
  perf_data = os.path.join(logdir, f'{tag}.perf.data')
  perf = perf_attach(proc.pid, perf_data) if profile else None

  def read() -> None:
    with open(log_path, 'w') as log:
      for line in proc.stdout:
        t = time.monotonic() - t0
        lines.append((t, line.rstrip('\n')))
        log.write(f'{t:8.3f} {line}')
        log.flush()
        if last.match(line):
          done.set()
    done.set()

  reader = threading.Thread(target=read, daemon=True)
  reader.start()
  try:
    finished = done.wait(RUN_TIMEOUT_S)
  finally:  # also on Ctrl-C: the run is in its own session, so it would go on
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
    rc = proc.wait()
    reader.join(10)
    if perf is not None:
      perf_finish(perf)
  text = '\n'.join(line for _, line in lines)
  try:
    if not finished:
      raise RunFailed(f'jax3d {tag}: no step {steps} within {RUN_TIMEOUT_S} s', tail(text))
    if not any(last.match(line) for _, line in lines):
      raise RunFailed(
        f'jax3d {tag}: exited with status {rc} before step {steps} (log {log_path})', tail(text)
      )
    with open(os.path.join(workdir, 'metrics.jsonl')) as f:
      records = [json.loads(line) for line in f if line.strip()]
    step_s, n = median_step(records)
    split = startup_split(lines)
    if split['first_step'] is None:
      raise RunFailed(f'jax3d {tag}: no "first step (compile + run)" line (log {log_path})', tail(text))
    out = {'step_s': step_s, 'steps_timed': n, 'first_step_s': split['first_step'], 'startup': split}
    if profile:
      out['cpu_ms'] = cpu_breakdown(perf_report(perf_data), steps)
    return out
  finally:
    shutil.rmtree(workdir, ignore_errors=True)


PERF_HZ = 499
CPU_KINDS = (
  'YNNPACK matmul',
  'Eigen matmul',
  'YNNPACK other',
  'XLA loop fusions',
  'collectives',
  'libc',
  'kernel',
  'runtime other',
)
PERF_LINE = re.compile(r'\s*[\d.]+%\s+(\d+)\s+(\S+)\s+(\[JIT\] tid \d+|\S+)\s+\[.\]\s+(.*)')


def cpu_kind(dso: str, symbol: str) -> str:
  """The CPU_KINDS entry of one perf sample's shared object and symbol."""
  if 'ynn::dot' in symbol:
    return 'YNNPACK matmul'
  if 'Eigen::' in symbol:
    return 'Eigen matmul'
  if dso.startswith('[JIT]'):
    return 'XLA loop fusions'
  if 'ynn::' in symbol:
    return 'YNNPACK other'
  if re.search(r'ReduceScatter|AllReduce|AllGather|Collective|Rendezvous|Permute', symbol):
    return 'collectives'
  if dso.startswith('libc'):
    return 'libc'
  if 'kernel' in dso:
    return 'kernel'
  return 'runtime other'


def cpu_breakdown(report: str, steps: int, thread: str = 'tf_XLAEigen') -> dict[str, float]:
  """CPU ms per step by CPU_KINDS in the device threads, from `perf report -n --sort comm,dso,sym
  --stdio` text (sample counts at PERF_HZ)."""
  out = dict.fromkeys(CPU_KINDS, 0.0)
  for line in report.splitlines():
    m = PERF_LINE.match(line)
    if m and m[2] == thread:
      out[cpu_kind(m[3], m[4])] += int(m[1]) * 1e3 / PERF_HZ / steps
  return out


def perf_report(data: str) -> str:
  """`perf report` of a perf.data file, sorted by thread name, shared object and symbol."""
  cmd = ['perf', 'report', '-n', '-i', data, '--no-children', '--sort', 'comm,dso,sym', '--stdio']
  return subprocess.run(cmd, capture_output=True, text=True, timeout=600).stdout


def perf_record(data: str) -> list[str]:
  """The `perf record` command (sampling at PERF_HZ into `data`), to which a target is appended:
  `-p PID` or `-- COMMAND...`."""
  return ['perf', 'record', '-q', '-F', str(PERF_HZ), '-o', data]


def perf_attach(pid: int, data: str) -> subprocess.Popen:
  """`perf record` of the running process `pid` (its threads, also those started later) into data;
  it ends when the process does."""
  cmd = [*perf_record(data), '-p', str(pid)]
  return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def perf_finish(perf: subprocess.Popen) -> None:
  """Waits for `perf record` to write its file (SIGINT if its process outlived the wait)."""
  try:
    perf.wait(30)
  except subprocess.TimeoutExpired:
    perf.send_signal(signal.SIGINT)
    perf.wait(30)


MAXTEXT_LINE = re.compile(r'median step ([\d.]+) s .*process start to step 0 done ([\d.]+) s')


def run_maxtext(
  maxtext_dir: str,
  venv: str,
  layout: Layout,
  dtype: str,
  steps: int,
  logdir: str,
  tag: str,
  profile: bool = False,
) -> dict:
  """One ../shared/bench/maxtext/run.sh; its last stdout line holds the median and the first step.
  With `profile`, run under `perf record` (result key 'cpu_ms')."""
  perf_data = os.path.join(logdir, f'{tag}.perf.data')
  perf = [*perf_record(perf_data), '--'] if profile else []
  log_path = os.path.join(logdir, f'{tag}.log')
  env = dict(os.environ, MAXTEXT_VENV=venv)
  env.pop('XLA_FLAGS', None)
  with open(log_path, 'w') as log:
    r = subprocess.run(
      [*perf, os.path.join(maxtext_dir, 'run.sh'), *maxtext_args(layout, dtype, steps)],
      env=env,
      stdout=subprocess.PIPE,
      stderr=log,
      text=True,
      timeout=RUN_TIMEOUT_S,
    )
  m = MAXTEXT_LINE.search(r.stdout.strip().splitlines()[-1]) if r.stdout.strip() else None
  if r.returncode or not m:
    with open(log_path) as f:
      raise RunFailed(
        f'MaxText {tag}: run.sh exited with status {r.returncode} (log {log_path})', tail(f.read())
      )
  out = {'step_s': float(m[1]), 'first_step_s': float(m[2])}
  if profile:
    out['cpu_ms'] = cpu_breakdown(perf_report(perf_data), steps)
  return out


# ---------------------------------------------------------------------------------------------
# Pythons
# ---------------------------------------------------------------------------------------------
def python_info(python: str) -> dict:
  """{'python': version, 'jax': version, 'executable': path} of an interpreter."""
  code = (
    'import json, sys, jax; print(json.dumps({"python": sys.version.split()[0], "jax": jax.__version__}))'
  )
  r = subprocess.run([python, '-c', code], capture_output=True, text=True, timeout=300)
  if r.returncode:
    fail(f'{python} cannot import jax', tail(r.stderr))
  return dict(json.loads(r.stdout.strip().splitlines()[-1]), executable=python)


def maxtext_venv_path(arg: str | None, maxtext_dir: str) -> str | None:
  """The MaxText venv: --maxtext-venv, else what setup.sh prints (it builds it once); None without
  MaxText (--maxtext-venv=none, or no ../shared/bench/maxtext)."""
  if arg is not None and arg.lower() in ('', 'none', 'off'):
    return None
  if arg is None:
    if not os.path.exists(os.path.join(maxtext_dir, 'setup.sh')):
      print(f'note: no {maxtext_dir}/setup.sh: jax3d alone')
      return None
    r = subprocess.run([os.path.join(maxtext_dir, 'setup.sh')], capture_output=True, text=True)
    if r.returncode:
      fail('../shared/bench/maxtext/setup.sh failed', tail(r.stdout + r.stderr))
    return r.stdout.strip().splitlines()[-1]
  if not os.path.exists(os.path.join(arg, '.complete')):  # setup.sh would delete and rebuild it
    fail(f'--maxtext-venv={arg}: not a venv built by ../shared/bench/maxtext/setup.sh (no .complete)')
  return arg


def base_python(venv: str) -> str:
  """The interpreter a venv was made from (its pyvenv.cfg), else a Python 3.12 found on the machine."""
  try:
    with open(os.path.join(venv, 'pyvenv.cfg')) as f:
      cfg = dict(line.split(' = ', 1) for line in f.read().splitlines() if ' = ' in line)
    if os.path.exists(cfg.get('executable', '')):
      return cfg['executable']
  except OSError:
    pass
  root = os.environ.get('PYENV_ROOT', os.path.expanduser('~/.pyenv'))
  found = sorted(
    p for p in (os.path.join(root, 'versions', v, 'bin', 'python3') for v in _ls(root)) if '3.12' in p
  )
  return found[0] if found else (shutil.which('python3.12') or fail('no Python 3.12 found'))


def _ls(root: str) -> list[str]:
  try:
    return os.listdir(os.path.join(root, 'versions'))
  except OSError:
    return []


def ensure_jax3d_venv(venv: str, maxtext_venv: str, jax_version: str, maxtext_dir: str) -> str:
  """A venv with jax3d (editable) and MaxText's jax, from MaxText's Python; built once. Returns its
  python."""
  python = os.path.join(venv, 'bin', 'python')
  marker = os.path.join(venv, '.complete')
  if os.path.exists(marker):
    with open(marker) as f:
      if f.read().strip() == jax_version:
        return python
  print(f'building the jax3d venv {venv} (jax=={jax_version}, about a minute) ...', flush=True)
  shutil.rmtree(venv, ignore_errors=True)
  os.makedirs(os.path.dirname(venv), exist_ok=True)
  pins = [f'jax=={jax_version}', f'jaxlib=={jax_version}']
  freeze = os.path.join(maxtext_dir, 'freeze.txt')
  constraints = ['-c', freeze] if os.path.exists(freeze) else []
  for cmd in (
    [base_python(maxtext_venv), '-m', 'venv', venv],
    [python, '-m', 'pip', 'install', '-q', '--upgrade', 'pip'],
    [python, '-m', 'pip', 'install', '-q', '-e', REPO, *pins, *constraints],
  ):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
      fail(f'building the jax3d venv: {" ".join(cmd)} failed', tail(r.stdout + r.stderr))
  with open(marker, 'w') as f:
    f.write(jax_version)
  return python


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------
def run_roof(roofs: Sequence[dict], run: dict, n_kv_heads: int) -> float:
  """A run's roof: the mean of the measurements just before and just after its round (`roofs[0]`
  before round 1, `roofs[k]` after round k)."""
  key = f'{run["dtype"]} kv{n_kv_heads}'
  k = min(run['round'], len(roofs) - 1)
  return (roofs[k - 1]['weighted'][key]['roof'] + roofs[k]['weighted'][key]['roof']) / 2


def summarize(
  runs: Sequence[dict], layouts: Sequence[Layout], dtypes: Sequence[str], roofs: Sequence[dict] | None
) -> list[dict]:
  """One row per (layout, dtype): per-round s/step and ratios, medians, FLOP/s and roof fractions
  (each run against its own round's roof, `run_roof`; the median over the rounds)."""
  rows = []
  for lay in layouts:
    flops = step_flops(lay.shape())
    for dtype in dtypes:
      row: dict[str, Any] = {'layout': lay.label, 'spec': lay.spec, 'dtype': dtype}
      row['model_flops'], row['executed_flops'] = flops['model'], flops['executed']
      row['roof_flops'] = None
      for who in ('jax3d', 'maxtext'):
        mine = [x for x in runs if x['trainer'] == who and x['spec'] == lay.spec and x['dtype'] == dtype]
        if not mine:
          row[who] = None
          continue
        step = statistics.median(x['step_s'] for x in mine)
        own = [run_roof(roofs, x, lay.n_kv_heads) for x in mine] if roofs else None
        row[who] = {
          'step_s': [x['step_s'] for x in mine],
          'first_step_s': [x['first_step_s'] for x in mine],
          'median_step_s': step,
          'median_first_step_s': statistics.median(x['first_step_s'] for x in mine),
          'model_flops_per_s': flops['model'] / step,
          'executed_flops_per_s': flops['executed'] / step,
          'roof_flops': own,
          'roof_fractions': [flops['model'] / x['step_s'] / r for x, r in zip(mine, own, strict=True)]
          if own
          else None,
        }
        row[who]['roof_fraction'] = statistics.median(row[who]['roof_fractions']) if own else None
        if own and who == 'jax3d':
          row['roof_flops'] = statistics.median(own)
      if row['jax3d'] and row['maxtext']:
        row['ratio'] = [j / m for j, m in zip(row['jax3d']['step_s'], row['maxtext']['step_s'], strict=False)]
        row['median_ratio'] = row['jax3d']['median_step_s'] / row['maxtext']['median_step_s']
      rows.append(row)
  return rows


def format_table(rows: Sequence[dict]) -> str:
  """The rows as one markdown table (per-round values, comma-separated; FLOP/s from the medians)."""

  def steps(r: dict | None) -> str:
    return ', '.join(f'{x:.3f}' for x in r['step_s']) if r else '-'

  def rate(r: dict | None) -> str:
    if not r:
      return '-'
    frac = f' ({r["roof_fraction"]:.0%})' if r['roof_fraction'] is not None else ''
    return f'{r["model_flops_per_s"] / 1e9:.1f}{frac}'

  def first(r: dict | None) -> str:
    return f'{r["median_first_step_s"]:.1f}' if r else '-'

  head = (
    '| layout | dtype | MaxText s/step | jax3d s/step | jax3d / MaxText | MaxText GFLOP/s (roof) '
    '| jax3d GFLOP/s (roof) | MaxText start to step 0, s | jax3d start to step 0, s |'
  )
  out = [head, '|' + '---|' * 9]
  for r in rows:
    ratio = '-'
    if r.get('ratio'):  # each round's ratio, then the ratio of the two trainers' medians
      ratio = ', '.join(f'{x:.2f}' for x in r['ratio']) + f' (medians: {r["median_ratio"]:.2f})'
    mt, j = r['maxtext'], r['jax3d']
    out.append(
      f'| {r["layout"]} | {r["dtype"]} | {steps(mt)} | {steps(j)} | {ratio} | {rate(mt)} | {rate(j)} '
      f'| {first(mt)} | {first(j)} |'
    )
  return '\n'.join(out)


def format_roof(roofs: Sequence[dict], dtypes: Sequence[str]) -> list[str]:
  """Lines: each matmul's rate (lowest / highest over the measurements, 1 device and 2 at once) and
  the weighted roof of each measurement (before round 1, after each round)."""
  out = ['GEMM roof, jnp.dot GFLOP/s (lowest / highest of the measurements; 1 device | 2 devices at once):']
  for key in roofs[0]['per_gemm']:
    one = [r['per_gemm'][key]['1dev'] / 1e9 for r in roofs]
    two = [r['per_gemm'][key]['2dev'] / 1e9 for r in roofs]
    out.append(f'  {key:>24}: {min(one):6.1f} / {max(one):6.1f} | {min(two):6.1f} / {max(two):6.1f}')
  for key in roofs[0]['weighted']:
    if key.split()[0] not in dtypes:
      continue
    series = ', '.join(f'{r["weighted"][key]["roof"] / 1e9:.1f}' for r in roofs)
    med = statistics.median(r['weighted'][key]['roof'] for r in roofs) / 1e9
    out.append(f'  roof {key} (before round 1, after each round): {series}  (median {med:.1f})')
  return out


def format_startup(runs: Sequence[dict]) -> list[str]:
  """jax3d's start-up split (medians over its runs), and MaxText's first step for comparison."""
  j = [x['startup'] for x in runs if x['trainer'] == 'jax3d']
  if not j:
    return []
  med = {k: statistics.median(x[k] for x in j if x[k] is not None) for k in j[0] if any(x[k] for x in j)}
  parts = [
    ('imports, data, setup', med.get('summary')),
    ('init', med.get('init', 0) - med.get('summary', 0)),
    ('compile', med.get('compiled', 0) - med.get('init', 0)),
    ('first step', med.get('first_step', 0) - med.get('compiled', 0)),
  ]
  line = ', '.join(f'{name} {t:.1f} s' for name, t in parts if t is not None)
  out = [f'jax3d start-up (median over its {len(j)} runs): {line}; total {med["first_step"]:.1f} s']
  mt = [x['first_step_s'] for x in runs if x['trainer'] == 'maxtext']
  if mt:
    out.append(
      f'MaxText process start to step 0 done: median {statistics.median(mt):.1f} s over {len(mt)} runs'
    )
  return out


def format_cpu(runs: Sequence[dict]) -> list[str]:
  """The --cpu-profile table: per layout and dtype, each trainer's median CPU ms per step by kind."""
  keys = list(dict.fromkeys((r['spec'], r['dtype']) for r in runs))  # in the order they ran
  head = ['layout', 'dtype', 'trainer', *CPU_KINDS, 'total']
  lines = [
    '',
    'CPU ms per step in the device threads (perf, all samples of a run / its steps; median over rounds):',
    '| ' + ' | '.join(head) + ' |',
    '|' + '---|' * len(head),
  ]
  for spec, dtype in keys:
    for who in ('maxtext', 'jax3d'):
      rs = [r['cpu_ms'] for r in runs if (r['spec'], r['dtype'], r['trainer']) == (spec, dtype, who)]
      if not rs:
        continue
      med = {k: statistics.median(r[k] for r in rs) for k in CPU_KINDS}
      cells = [f'{med[k]:.0f}' for k in CPU_KINDS]
      lines.append(f'| {spec} | {dtype} | {who} | ' + ' | '.join(cells) + f' | {sum(med.values()):.0f} |')
  return lines


def format_load(runs: Sequence[dict], cores: int | None = None) -> str:
  """The machine's load during the runs, and a warning when other work shared the cores (a run
  itself keeps about `cores` busy): then the timings say as much about the scheduler as the step."""
  cores = cores or os.cpu_count() or 1
  loads = [x['load'] for x in runs if x.get('load') is not None]
  if not loads:
    return ''
  med = statistics.median(loads)
  line = f'load average (1 min) after each run: median {med:.1f}, max {max(loads):.1f}, on {cores} cores'
  if med > cores + 1:
    line += ' (warning: other processes shared the cores; rerun on a quiet machine to trust the ratios)'
  return line


# ---------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  """The flags; bad layouts or dtypes exit 2 with the reason."""
  ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  ap.add_argument('--layouts', default=DEFAULT_LAYOUTS, help='comma-separated DPxPPxTP[mM][kvK]')
  ap.add_argument('--dtypes', default='float32,bfloat16', help='float32 and/or bfloat16')
  ap.add_argument('--rounds', type=int, default=2, help='interleaved rounds (each runs every case once)')
  ap.add_argument('--steps', type=int, default=20, help='steps per run (steps 5.. are timed)')
  ap.add_argument('--json', default='bench_vs_maxtext.json', help='results (JSON)')
  ap.add_argument('--md', default=None, help='also write the printed table and notes here')
  ap.add_argument(
    '--maxtext-venv', default=None, help="MaxText's venv (default: what setup.sh prints); 'none': jax3d only"
  )
  ap.add_argument('--maxtext-dir', default=MAXTEXT_DIR, help='the folder of run.sh and setup.sh')
  ap.add_argument('--jax3d-python', default=None, help="jax3d's interpreter (default: --jax3d-venv's)")
  ap.add_argument('--jax3d-venv', default=DEFAULT_JAX3D_VENV, help='built here with MaxText jax when missing')
  ap.add_argument(
    '--cpu-profile', action='store_true', help='each run under perf record: CPU ms per step by kind'
  )
  args = ap.parse_args(argv)
  try:
    args.layout_list = [parse_layout(s) for s in args.layouts.split(',') if s.strip()]
  except ValueError as e:
    ap.error(str(e))
  args.dtype_list = [d.strip() for d in args.dtypes.split(',') if d.strip()]
  bad = [d for d in args.dtype_list if d not in ('float32', 'bfloat16')]
  if bad or not args.dtype_list or not args.layout_list:
    ap.error(
      f'--dtypes={args.dtypes!r} / --layouts={args.layouts!r}: float32 and/or bfloat16, one layout or more'
    )
  if args.rounds < 1 or args.steps <= SKIP + 1:
    ap.error(f'--rounds must be >= 1 and --steps > {SKIP + 1}')
  if args.cpu_profile and shutil.which('perf') is None:
    ap.error('--cpu-profile needs Linux perf on the PATH (linux-tools)')
  return args


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the benchmark; returns the exit status."""
  args = parse_args(argv)
  t_start = time.time()
  mt_venv = maxtext_venv_path(args.maxtext_venv, args.maxtext_dir)
  mt_info = python_info(os.path.join(mt_venv, 'bin', 'python')) if mt_venv else None
  if args.jax3d_python:
    j_python = args.jax3d_python
  elif mt_info:
    j_python = ensure_jax3d_venv(args.jax3d_venv, mt_venv, mt_info['jax'], args.maxtext_dir)
  else:
    j_python = sys.executable
  j_info = python_info(j_python)
  print(f'jax3d:   {j_python} (Python {j_info["python"]}, jax {j_info["jax"]})')
  if mt_info:
    print(f'MaxText: {mt_info["executable"]} (Python {mt_info["python"]}, jax {mt_info["jax"]})')
    if (mt_info['python'], mt_info['jax']) != (j_info['python'], j_info['jax']):
      print('warning: jax3d and MaxText run on different Python or jax versions')
  s = Shape()
  print(
    f'shape: {s.n_layers} layers, d_model {s.d_model}, {s.n_heads} heads, d_ff {s.d_ff}, vocab '
    f'{s.vocab_size}, seq {s.seq_len}, global batch {s.global_batch}, full remat, AdamW; '
    f'{N_DEVICES} fake CPU devices on {os.cpu_count()} cores; {args.steps} steps, median of steps '
    f'{SKIP}-{args.steps - 1}'
  )
  for lay in {lay.n_kv_heads: lay for lay in args.layout_list}.values():
    f = step_flops(lay.shape())
    print(
      f'FLOPs per step ({lay.n_kv_heads} KV heads): model {f["model"] / 1e9:.2f} G (6N + attention, '
      f'jax3d/model/formulas.py), executed under full remat {f["executed"] / 1e9:.2f} G'
    )
  shapes = list({lay.n_kv_heads: lay.shape() for lay in args.layout_list}.values())
  logdir = tempfile.mkdtemp(prefix='bench_vs_maxtext-')
  print(f'logs: {logdir}\nmeasuring the GEMM roof ...', flush=True)
  roofs = [measure_roof(j_python, args.dtype_list, shapes)]
  runs: list[dict] = []
  cases = [(lay, dt) for lay in args.layout_list for dt in args.dtype_list]
  try:
    for rnd in range(1, args.rounds + 1):
      for lay, dtype in cases:
        for who in ('jax3d', 'maxtext') if mt_venv else ('jax3d',):
          tag = f'r{rnd}-{lay.spec}-{dtype}-{who}'
          t0 = time.time()
          if who == 'jax3d':
            r = run_jax3d(j_python, lay, dtype, args.steps, logdir, tag, args.cpu_profile)
          else:
            r = run_maxtext(args.maxtext_dir, mt_venv, lay, dtype, args.steps, logdir, tag, args.cpu_profile)
          r.update(
            trainer=who, spec=lay.spec, layout=lay.label, dtype=dtype, round=rnd, wall_s=time.time() - t0
          )
          r['load'] = os.getloadavg()[0]  # the 1-minute load average: about this run's minute
          runs.append(r)
          print(
            f'[round {rnd}/{args.rounds}] {lay.label:>12} {dtype:>8} {who:>7}: {r["step_s"]:.3f} s/step, '
            f'start to step 0 {r["first_step_s"]:.1f} s ({r["wall_s"]:.0f} s wall, load {r["load"]:.1f})',
            flush=True,
          )
      print(f'measuring the GEMM roof after round {rnd} ...', flush=True)
      roofs.append(measure_roof(j_python, args.dtype_list, shapes))
  except RunFailed as e:
    fail(str(e), e.log)
  rows = summarize(runs, args.layout_list, args.dtype_list, roofs)
  text = '\n'.join(
    [
      format_table(rows),
      '',
      *format_roof(roofs, args.dtype_list),
      *format_startup(runs),
      format_load(runs),
      *(format_cpu(runs) if args.cpu_profile else []),
    ]
  )
  print('\n' + text)
  print(f'({time.time() - t_start:.0f} s in all)')
  result = {
    'command': ' '.join([os.path.relpath(sys.argv[0], REPO)] + list(sys.argv[1:] if argv is None else argv)),
    'shape': dataclasses.asdict(s),
    'steps': args.steps,
    'timed_steps': f'{SKIP}-{args.steps - 1} (from 0)',
    'cores': os.cpu_count(),
    'jax3d_python': j_info,
    'maxtext_python': mt_info,
    'roofs': roofs,  # before round 1, then after each round
    'rows': rows,
    'runs': runs,
    'logs': logdir,
    'wall_s': time.time() - t_start,
  }
  with open(args.json, 'w') as f:
    json.dump(result, f, indent=1)
  if args.md:
    with open(args.md, 'w') as f:
      f.write(text + '\n')
  print(f'wrote {args.json}' + (f' and {args.md}' if args.md else ''))
  return 0


if __name__ == '__main__':
  sys.exit(main())
