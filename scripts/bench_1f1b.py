"""1F1B against GPipe: compiled FLOPs and temp memory per device, and step time on CPU, side by side.

  python scripts/bench_1f1b.py [--pp=2,4,8] [--m-per-pp=1,2,4] [--vocab=16384,131072] [--time-steps=7]
                               [--json=docs/bench/bench_1f1b.json]

Three parts, every figure from one run of this script:
  goal     `python -m jax3d.inspect`'s layout of issue 44: dp1 pp4 tp2, m=8, 8 layers, d_model 256,
           vocabulary 16K, pipeline.skip_bubbles=false (the accelerator path): FLOPs per device
           (the HLO's matmuls times their loops' trip counts, jax3d/analysis/hlo.py) of each
           schedule and their ratio (bar: 1F1B at most 1.3x GPipe's).
  sweep    compile only, dp = tp = 1 on pp fake CPU devices, 8 layers of d_model 64, seq 64, 2
           sequences per micro-batch, m = p, 2p, 4p, both vocabularies: FLOPs and XLA's temp bytes.
  time     pp4 m8 (scripts/bench_pipeline_schedule.py's shape, vocab 256): the median of the
           steps after the first of each run, two runs per schedule in alternating order (bar:
           1F1B within 10% of GPipe).
Prints the tables and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jax3d.cli import prepare_devices  # noqa: E402

prepare_devices(8)
import jax  # noqa: E402

from jax3d import assemble, config as config_lib  # noqa: E402

SCHEDULES = ('gpipe', '1f1b')
GOAL = {
  'mesh.dp': 1,
  'mesh.pp': 4,
  'mesh.tp': 2,
  'pipeline.microbatches': 8,
  'model.n_layers': 8,
  'model.vocab_size': 16384,
  'pipeline.skip_bubbles': 'false',
}
SWEEP = {
  'model.n_layers': 8,
  'model.d_model': 64,
  'model.n_heads': 4,
  'model.n_kv_heads': 4,
  'model.d_ff': 256,
  'train.seq_len': 64,
  'train.remat': 'none',
  'mesh.dp': 1,
  'mesh.tp': 1,
  'pipeline.skip_bubbles': 'false',
}
TIME = {
  'model.n_layers': 8,
  'model.d_model': 256,
  'model.n_heads': 4,
  'model.n_kv_heads': 4,
  'model.d_ff': 1024,
  'model.vocab_size': 256,
  'train.seq_len': 128,
  'train.remat': 'none',
  'mesh.dp': 1,
  'mesh.pp': 4,
  'mesh.tp': 1,
  'pipeline.microbatches': 8,
  'train.global_batch_size': 16,
}


def build(over: dict, schedule: str, n: int) -> assemble.Setup:
  cfg = config_lib.load_config('tiny', over | {'pipeline.schedule': schedule})
  return assemble.build(cfg, jax.devices()[:n])


def measure(over: dict, n: int) -> dict:
  out = {}
  for sched in SCHEDULES:
    a = assemble.compile_train_step(build(over, sched, n)).analysis()
    out[sched] = {'gflops': a['flops'] / 1e9, 'temp_mib': a['memory_bytes']['temp'] / 2**20}
  out['flops_ratio'] = out['1f1b']['gflops'] / out['gpipe']['gflops']
  out['temp_ratio'] = out['1f1b']['temp_mib'] / out['gpipe']['temp_mib']
  return out


def step_times(steps: int) -> dict:
  """Two rounds, the schedules in one order then the other (each compiles afresh), so that both
  see the same load on the shared cores; the median over both rounds' steps after the first."""
  runs = {sched: build(TIME, sched, 4) for sched in SCHEDULES}
  times = {k: [] for k in runs}
  for order in (SCHEDULES, SCHEDULES[::-1]):
    for k in order:
      times[k] += assemble.benchmark(runs[k], steps)['step_times'][1:]
  med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
  return {'median_ms': med, 'ratio': med['1f1b'] / med['gpipe'], 'steps_timed': len(times['gpipe'])}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  ap.add_argument('--pp', default='2,4,8')
  ap.add_argument('--vocab', default='16384,131072')
  ap.add_argument('--m-per-pp', default='1,2,4', help='the micro-batch counts m, in multiples of pp')
  ap.add_argument('--time-steps', type=int, default=7)
  ap.add_argument('--json', default='docs/bench/bench_1f1b.json')
  a = ap.parse_args()
  ints = lambda s: [int(x) for x in s.split(',') if x]
  report = {}

  def save() -> None:  # after each part: a partial run still leaves its figures
    os.makedirs(os.path.dirname(a.json) or '.', exist_ok=True)
    with open(a.json, 'w') as f:
      json.dump(report, f, indent=1)

  goal = measure(GOAL, 8)
  report['goal'] = {'config': GOAL} | goal
  save()
  print(
    f'goal (dp1 pp4 tp2 m8, vocab 16K, skip off): GFLOP/device gpipe {goal["gpipe"]["gflops"]:.2f}  '
    f'1f1b {goal["1f1b"]["gflops"]:.2f}  ratio {goal["flops_ratio"]:.2f} (bar <= 1.30)',
    flush=True,
  )
  t = step_times(a.time_steps)
  report['time'] = {'config': TIME} | t
  save()
  print(
    f'step time pp4 m8 (CPU, median): gpipe {t["median_ms"]["gpipe"]:.1f} ms  1f1b '
    f'{t["median_ms"]["1f1b"]:.1f} ms  ratio {t["ratio"]:.2f} (bar <= 1.10)',
    flush=True,
  )
  report['sweep'] = {'config': SWEEP, 'rows': []}
  print(
    f'{"pp":>3} {"m":>3} {"vocab":>7}  {"GFLOP gpipe":>11} {"1f1b":>7} {"x":>5}  {"temp MiB gpipe":>14} {"1f1b":>7} {"x":>5}'
  )
  for pp in ints(a.pp):
    for m in [k * pp for k in ints(a.m_per_pp)]:
      for vocab in ints(a.vocab):
        over = SWEEP | {'mesh.pp': pp, 'pipeline.microbatches': m, 'model.vocab_size': vocab}
        r = {'pp': pp, 'm': m, 'vocab': vocab} | measure(over | {'train.global_batch_size': 2 * m}, pp)
        report['sweep']['rows'].append(r)
        save()
        g, o = r['gpipe'], r['1f1b']
        print(
          f'{pp:>3} {m:>3} {vocab:>7}  {g["gflops"]:>11.3f} {o["gflops"]:>7.3f} {r["flops_ratio"]:>5.2f}  '
          f'{g["temp_mib"]:>14.2f} {o["temp_mib"]:>7.2f} {r["temp_ratio"]:>5.2f}',
          flush=True,
        )


if __name__ == '__main__':
  main()
