"""Compile time, median step time and compiled memory of the train step under several layouts.

  python scripts/bench_step.py [--steps=20] [--json=bench_step.json] [--dtype=float32,bfloat16]
                               [--layouts=1x1x1,4x1x2,2x2x2] [--layer-sweep] [--sp-sweep]
                               [--malloc-sweep]

Shape (the issue's reference): 4 layers, d_model 256, 4 heads, 4 KV heads, d_ff 1024, vocab 1024,
seq 128, global batch 8, full rematerialisation. Layout DPxPPxTP; pipelined layouts use
microbatches=4 unless given as DPxPPxTPmM. Step time is the median of steps 5..N-1; the ratio is
against the one-device run of the same dtype, next to the ideal ratio from the bubble
(v*m+p-1)/(v*m). Everything is measured side by side in one process.

--sp-sweep (sequence parallelism, issue 17): at seq 1024 (global batch 4, one micro-batch),
tp = 2 and 4 (dp = pp = 1), remat none and full, SP off and on: compiled temp memory per device
and tp bytes from `jax3d.inspect`; then the median step time SP off / on at the reference shape
(4x1x2) and at seq 1024 (1x1x4), one micro-batch. Use --layouts= to skip the layout table.

--malloc-sweep (jax3d/devices/cpu_heap.py): each of --layouts and --dtype in child processes with the
C allocator tuned (jax3d's default on CPU) and untuned (JAX3D_NO_MALLOC_TUNING=1), alternating,
3 rounds: median step time and minor page faults per step, and the ratio tuned / untuned.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jax3d.cli import prepare_devices  # noqa: E402

prepare_devices(8)
import jax  # noqa: E402

from jax3d import assemble, config as config_lib

SHAPE = {
  'model.n_layers': 4,
  'model.d_model': 256,
  'model.n_heads': 4,
  'model.n_kv_heads': 4,
  'model.d_ff': 1024,
  'model.vocab_size': 1024,
  'train.seq_len': 128,
  'train.global_batch_size': 8,
  'train.remat': 'full',
  'train.warmup_steps': 2,
}


def parse_layout(s: str):
  m = None
  if 'm' in s:
    s, m = s.split('m')
  dp, pp, tp = (int(x) for x in s.split('x'))
  return dp, pp, tp, int(m) if m else (4 if pp > 1 else 1)


def measure(overrides: dict, steps: int) -> dict:
  cfg = config_lib.load_config('tiny', overrides)
  n = cfg.mesh.dp * cfg.mesh.pp * cfg.mesh.tp
  s = assemble.build(cfg, jax.devices()[:n])
  r = assemble.benchmark(s, steps)
  times, m, mem = r['step_times'], r['metrics'], r['compiled'].memory
  return {
    'compile_s': r['compile_s'],
    'step_s': statistics.median(times[5:]),
    'page_faults': statistics.median(r['page_faults'][5:]),
    'loss': float(m['loss']),
    'temp_bytes': mem['temp'],
    'argument_bytes': mem['argument'],
    'bubble_ratio': s.plan.iterations / (s.plan.repeats * s.plan.microbatches),
  }


def log_overhead(rounds: int = 3, steps: int = 30) -> dict:
  """Seconds per step of the real trainer loop (prefetch, metrics, console, no checkpoints or
  evals) with a record every step against one every 100, alternating in one process."""
  import tempfile

  from jax3d.trainer.trainer import Trainer

  ov = dict(SHAPE, **{'mesh.dp': 4, 'mesh.pp': 1, 'mesh.tp': 2, 'pipeline.microbatches': 1})
  ov.update({'train.steps': 10_000, 'eval.every': 0, 'eval.batches': 1, 'log.progress': False})
  trainers = {}
  for every in (1, 100):
    t = Trainer(
      config_lib.load_config('tiny', dict(ov, **{'log.every': every})), tempfile.mkdtemp(), console=False
    )
    t.checkpointer = None  # train() saves when it returns: only the loop is timed here
    t.train(steps=5)  # compile and warm up
    trainers[every] = t
  times = {1: [], 100: []}
  for _ in range(rounds):
    for every, t in trainers.items():
      t0 = time.perf_counter()
      t.train(steps=steps)
      times[every].append((time.perf_counter() - t0) / steps)
  med = {k: statistics.median(v) for k, v in times.items()}
  print(
    f'trainer loop, s/step: log.every=1 {med[1]:.4f}, log.every=100 {med[100]:.4f}, '
    f'ratio {med[1] / med[100]:.3f} (median of {rounds} rounds of {steps} steps)'
  )
  for t in trainers.values():
    t.close()
  return {'every_1_s': med[1], 'every_100_s': med[100], 'ratio': med[1] / med[100], 'times': times}


def sp_sweep(steps: int) -> dict:
  """Sequence parallelism off and on, side by side (see the module docstring)."""
  long = dict(SHAPE, **{'train.seq_len': 1024, 'model.max_seq_len': 1024, 'train.global_batch_size': 4})
  mem = []
  print(
    f'{"tp":>3} {"remat":>6} {"temp MiB off":>13} {"on":>8} {"on/off":>7} {"tp MiB off":>11} {"on":>8} {"on/off":>7}'
  )
  for tp in (2, 4):
    for remat in ('none', 'full'):
      r = {'tp': tp, 'remat': remat}
      for sp in ('false', 'true'):
        ov = dict(long, **{'mesh.dp': 1, 'mesh.pp': 1, 'mesh.tp': tp, 'train.remat': remat})
        cfg = config_lib.load_config('tiny', dict(ov, **{'train.sequence_parallel': sp}))
        c = assemble.compile_train_step(assemble.build(cfg, jax.devices()[:tp]))
        a = c.analysis()
        r[sp] = {'temp_bytes': c.memory['temp'], 'tp_bytes': a['comm_bytes']['tp'], 'checks': a['checks']}
      r['temp_ratio'] = r['true']['temp_bytes'] / r['false']['temp_bytes']
      r['tp_ratio'] = r['true']['tp_bytes'] / r['false']['tp_bytes']
      mem.append(r)
      mib = lambda x: x / 2**20
      print(
        f'{tp:>3} {remat:>6} {mib(r["false"]["temp_bytes"]):>13.1f} {mib(r["true"]["temp_bytes"]):>8.1f} '
        f'{r["temp_ratio"]:>7.3f} {mib(r["false"]["tp_bytes"]):>11.1f} {mib(r["true"]["tp_bytes"]):>8.1f} '
        f'{r["tp_ratio"]:>7.3f}',
        flush=True,
      )
  times = []
  print(f'{"shape":>22} {"step s off":>10} {"on":>8} {"on/off":>7}')
  for name, ov in (
    (
      'reference 4x1x2',
      dict(SHAPE, **{'mesh.dp': 4, 'mesh.pp': 1, 'mesh.tp': 2, 'pipeline.microbatches': 1}),
    ),
    ('seq 1024 1x1x4', dict(long, **{'mesh.dp': 1, 'mesh.pp': 1, 'mesh.tp': 4, 'pipeline.microbatches': 1})),
  ):
    r = {'shape': name}
    for sp in ('false', 'true'):
      r[sp] = measure(dict(ov, **{'train.sequence_parallel': sp}), steps)
    r['step_ratio'] = r['true']['step_s'] / r['false']['step_s']
    times.append(r)
    print(
      f'{name:>22} {r["false"]["step_s"]:>10.3f} {r["true"]["step_s"]:>8.3f} {r["step_ratio"]:>7.3f}',
      flush=True,
    )
  return {'memory_and_bytes': mem, 'step_times': times}


def malloc_sweep(layouts: str, dtypes: str, steps: int, rounds: int = 3) -> list[dict]:
  """Tuned vs untuned C allocator, one child process per measurement (mallopt is process-wide)."""
  import subprocess
  import tempfile

  out = []
  print(f'{"layout":>10} {"dtype":>9} {"untuned s":>9} {"tuned s":>8} {"ratio":>6} {"faults/step":>19}')
  for dtype in dtypes.split(','):
    for lay in layouts.split(','):
      times, faults = {'untuned': [], 'tuned': []}, {'untuned': [], 'tuned': []}
      for _ in range(rounds):
        for kind in times:
          env = dict(os.environ, JAX3D_NO_MALLOC_TUNING='1' if kind == 'untuned' else '0')
          with tempfile.NamedTemporaryFile(suffix='.json') as f:
            cmd = [sys.executable, __file__, f'--layouts={lay}', f'--dtype={dtype}', f'--steps={steps}']
            subprocess.run([*cmd, f'--json={f.name}'], env=env, check=True, capture_output=True)
            row = json.load(open(f.name))['rows'][0]
          times[kind].append(row['step_s'])
          faults[kind].append(row['page_faults'])
      med = {k: statistics.median(v) for k, v in times.items()}
      flt = {k: statistics.median(v) for k, v in faults.items()}
      r = {
        'layout': lay,
        'dtype': dtype,
        'times': times,
        'faults': faults,
        'ratio': med['tuned'] / med['untuned'],
      }
      out.append(r)
      print(
        f'{lay:>10} {dtype:>9} {med["untuned"]:>9.3f} {med["tuned"]:>8.3f} {r["ratio"]:>6.2f} '
        f'{flt["untuned"]:>9.0f} -> {flt["tuned"]:>6.0f}',
        flush=True,
      )
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument('--steps', type=int, default=20)
  ap.add_argument('--json', default='bench_step.json')
  ap.add_argument('--dtype', default='float32,bfloat16')
  ap.add_argument('--layouts', default='1x1x1,8x1x1,4x1x2,2x2x2,1x2x4,2x4x1m4')
  ap.add_argument('--layer-sweep', action='store_true', help='compile time against 4, 16, 64 layers')
  ap.add_argument(
    '--log-overhead',
    action='store_true',
    help='the trainer loop at 4x1x2 with log.every=1 against log.every=100 (alternating, 3 rounds)',
  )
  ap.add_argument(
    '--remat-sweep',
    action='store_true',
    help='each remat policy at (2,2,2), seq 1024: compiled temp memory and step time',
  )
  ap.add_argument('--sp-sweep', action='store_true', help='sequence parallelism off/on (see the docstring)')
  ap.add_argument('--malloc-sweep', action='store_true', help='C allocator tuned/untuned (see the docstring)')
  args = ap.parse_args()
  if args.malloc_sweep:
    sweep = malloc_sweep(args.layouts, args.dtype, args.steps)
    with open(args.json, 'w') as f:
      json.dump({'malloc_sweep': sweep, 'jax': jax.__version__}, f, indent=1)
    print(f'wrote {args.json}')
    return
  rows = []
  print(
    f'{"layout":>12} {"dtype":>9} {"compile s":>9} {"step s":>8} {"ratio":>6} {"ideal":>6} '
    f'{"temp MiB":>9} {"args MiB":>9}'
  )
  for dtype in args.dtype.split(',') if args.layouts else []:
    base = None
    for lay in args.layouts.split(','):
      dp, pp, tp, m = parse_layout(lay)
      ov = dict(
        SHAPE,
        **{
          'mesh.dp': dp,
          'mesh.pp': pp,
          'mesh.tp': tp,
          'pipeline.microbatches': m,
          'train.compute_dtype': dtype,
        },
      )
      r = measure(ov, args.steps)
      base = base or (r['step_s'] if (dp, pp, tp) == (1, 1, 1) else None)
      r.update(layout=lay, dtype=dtype, ratio=r['step_s'] / base if base else None)
      rows.append(r)
      ratio = f'{r["ratio"]:.2f}' if r['ratio'] else '-'
      print(
        f'{lay:>12} {dtype:>9} {r["compile_s"]:>9.2f} {r["step_s"]:>8.3f} {ratio:>6} '
        f'{r["bubble_ratio"]:>6.2f} {r["temp_bytes"] / 2**20:>9.1f} {r["argument_bytes"] / 2**20:>9.1f}',
        flush=True,
      )
  remat = []
  if args.remat_sweep:
    print(f'{"remat":>6} {"temp MiB":>9} {"vs none":>8} {"step s":>8} {"vs none":>8}')
    for policy in ('none', 'dots', 'attn', 'full', 'stage'):
      ov = dict(
        SHAPE,
        **{
          'mesh.dp': 2,
          'mesh.pp': 2,
          'mesh.tp': 2,
          'pipeline.microbatches': 2,
          'train.seq_len': 1024,
          'train.remat': policy,
        },
      )
      r = measure(ov, 8)
      r.update(remat=policy)
      remat.append(r)
      print(
        f'{policy:>6} {r["temp_bytes"] / 2**20:>9.1f} {r["temp_bytes"] / remat[0]["temp_bytes"]:>8.2f} '
        f'{r["step_s"]:>8.3f} {r["step_s"] / remat[0]["step_s"]:>8.2f}',
        flush=True,
      )
  overhead = log_overhead() if args.log_overhead else None
  sp = sp_sweep(args.steps) if args.sp_sweep else None
  sweep = []
  if args.layer_sweep:
    for L in (4, 16, 64):
      ov = dict(
        SHAPE, **{'mesh.dp': 2, 'mesh.pp': 2, 'mesh.tp': 2, 'pipeline.microbatches': 4, 'model.n_layers': L}
      )
      r = measure(ov, 6)
      sweep.append({'n_layers': L, 'compile_s': r['compile_s']})
      print(f'compile time, {L:>2} layers (2x2x2): {r["compile_s"]:.2f} s')
    print(f'ratio 64 layers / 4 layers: {sweep[-1]["compile_s"] / sweep[0]["compile_s"]:.2f}')
  with open(args.json, 'w') as f:
    json.dump(
      {
        'rows': rows,
        'layer_sweep': sweep,
        'remat_sweep': remat,
        'log_overhead': overhead,
        'sp_sweep': sp,
        'jax': jax.__version__,
      },
      f,
      indent=1,
    )
  print(f'wrote {args.json}')


if __name__ == '__main__':
  main()
