"""Log-likelihood requests per second: jax3d's lm-eval model (requests packed into rows) against
lm-eval's own `hf` model (transformers, CPU torch) on the same folder and the same local tasks.

  python scripts/bench_eval.py [--docs=64] [--rounds=3] [--rows=16] [--json=docs/bench/bench_eval.json]

The model: tests/eval_helpers.py's tiny random Llama (4 layers, d_model 64, vocab ~320, 64
positions), written by transformers, fp32. The tasks: its multiple-choice task (4 choices per
document, --docs documents) and its rolling log-likelihood task (windows of 64 tokens). Both
models run the same lm-eval requests (`lm_eval.simple_evaluate`) in alternation for --rounds
rounds after one warm-up round each (jax3d's compiles); the figure is the median. jax3d runs on one
CPU device (layout 1-1-1, --rows rows of 64 per step); `hf` with batch size --rows.

Packing: the rows jax3d filled (share of slots holding a token), the requests per step, and the
steps one request per row would take (the same fixed-shape step, so the time of the packed run
times steps(one per row) / steps(packed) is what it would cost) are printed from the model's
counters. Prints a table and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, 'tests')]
from jax3d.harness import offline_tasks  # noqa: E402

offline_tasks.go_offline()
from jax3d.cli import prepare_devices  # noqa: E402

prepare_devices(1)
import eval_helpers as eh  # noqa: E402
import jax  # noqa: E402

from jax3d import assemble, config as config_lib  # noqa: E402
from jax3d.harness.model import JaxLM  # noqa: E402
from jax3d.hf import weights  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--docs', type=int, default=64)
  p.add_argument('--rounds', type=int, default=3)
  p.add_argument('--rows', type=int, default=16)
  p.add_argument('--json', default=os.path.join(ROOT, 'docs', 'bench', 'bench_eval.json'))
  a = p.parse_args(argv)
  if min(a.docs, a.rounds, a.rows) < 1:
    p.error('--docs, --rounds and --rows must be positive')
  return a


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  from lm_eval.models.huggingface import HFLM

  tmp = tempfile.mkdtemp()
  model = os.path.join(tmp, 'model')
  eh.make_model(model, layers=4)
  folder = eh.write_tasks(os.path.join(tmp, 'tasks'), n=args.docs)
  cfg = config_lib.load_config(
    'tiny',
    {
      'checkpoint.init_from': f'hf:{model}',
      'mesh.dp': 1,
      'mesh.pp': 1,
      'mesh.tp': 1,
      'pipeline.microbatches': 1,
      'train.global_batch_size': args.rows,
      'train.seq_len': eh.MAX_LENGTH,
    },
  )
  s = assemble.build(cfg, jax.devices()[:1])
  ours = JaxLM(s, weights.load_params(s))
  hf = HFLM(pretrained=model, device='cpu', dtype='float32', batch_size=args.rows, max_length=eh.MAX_LENGTH)
  rows = []
  for task in (eh.MC_TASK, eh.ROLL_TASK):
    times = {'jax3d': [], 'hf': []}
    n_requests = stats = None
    for r in range(args.rounds + 1):
      for name, lm in (('jax3d', ours), ('hf', hf)):
        loaded = offline_tasks.load([task], folder)
        ours.stats = dict.fromkeys(ours.stats, 0)
        t0 = time.perf_counter()
        out = offline_tasks.evaluate(lm, loaded, bootstrap_iters=0, log_samples=True)
        dt = time.perf_counter() - t0
        if r:  # round 0 warms up (compiles)
          times[name].append(dt)
        if name == 'jax3d':
          stats, n_requests = dict(ours.stats), sum(len(x['resps']) for x in out['samples'][task])
    if task == eh.ROLL_TASK:
      n_requests = stats['requests']  # windows
    med = {k: statistics.median(v) for k, v in times.items()}
    one_per_row_steps = -(-stats['requests'] // args.rows)
    rows.append(
      {
        'task': task,
        'requests': n_requests,
        'jax3d_req_per_s': n_requests / med['jax3d'],
        'hf_req_per_s': n_requests / med['hf'],
        'ratio': med['hf'] / med['jax3d'],
        'rows': stats['rows'],
        'fill': stats['slots'] / max(stats['rows'] * eh.MAX_LENGTH, 1),
        'requests_per_step': stats['requests'] / max(stats['steps'], 1),
        'steps': stats['steps'],
        'steps_one_per_row': one_per_row_steps,
        'seconds_jax3d': med['jax3d'],
        'seconds_hf': med['hf'],
      }
    )
  head = f'{"task":<8} {"requests":>8} {"jax3d req/s":>11} {"hf req/s":>9} {"ratio":>6} {"rows":>5} {"fill":>6} {"req/step":>8} {"steps":>5} {"1/row steps":>11}'
  print(head)
  for r in rows:
    print(
      f'{r["task"]:<8} {r["requests"]:>8} {r["jax3d_req_per_s"]:>11.1f} {r["hf_req_per_s"]:>9.1f} '
      f'{r["ratio"]:>6.2f} {r["rows"]:>5} {r["fill"]:>6.1%} {r["requests_per_step"]:>8.1f} '
      f'{r["steps"]:>5} {r["steps_one_per_row"]:>11}'
    )
  os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
  with open(args.json, 'w') as f:
    json.dump({'args': vars(args), 'device': str(jax.devices()[0]), 'rows': rows}, f, indent=2)
  print(f'wrote {args.json}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
