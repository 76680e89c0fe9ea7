"""Mixture of experts and expert parallelism (issue 55) on 8 fake CPU devices: for each mesh.ep (dp
fills the rest), the real train step compiled and run: parameter and temp bytes per device (the
experts split over ep), the experts' all-to-all bytes per step measured in the compiled HLO against
the formula (jax3d/analysis/ep_comm.py), the median step time, and the router's metrics of the last
step (the dropped share at moe.capacity_factor); and the dense model of equal active parameters
(d_ff = top_k x 256, no router) at dp=8, the baseline a mixture's step is weighed against.

  python scripts/bench_moe.py [--eps=1,2,4,8] [--experts=8] [--top_k=2] [--capacity_factor=1.25]
                              [--steps=6] [--json=docs/bench/bench_moe.json]

Shape: 2 layers, d_model 256, 4 heads, 8 experts of 256 (top-2), vocab 256, seq 128, 16 sequences
per step, float32, remat none. Step times on fake CPU devices share the host's cores: their
ratio, not their size, is the figure; the bytes are exact.
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
import numpy as np  # noqa: E402

from jax3d import assemble, config as config_lib, step as step_lib  # noqa: E402
from jax3d.data import packing  # noqa: E402

SHAPE = {
  'model.n_layers': 2,
  'model.d_model': 256,
  'model.n_heads': 4,
  'model.n_kv_heads': 4,
  'model.d_ff': 256,
  'model.vocab_size': 256,
  'train.seq_len': 128,
  'train.global_batch_size': 16,
  'train.warmup_steps': 1,
  'mesh.pp': 1,
  'mesh.tp': 1,
  'pipeline.microbatches': 1,
}
MIB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--eps', default='1,2,4,8')
  p.add_argument('--experts', type=int, default=8)
  p.add_argument('--top_k', type=int, default=2)
  p.add_argument('--capacity_factor', type=float, default=1.25)
  p.add_argument('--steps', type=int, default=6)
  p.add_argument('--json', default='')
  a = p.parse_args(argv)
  eps = [int(x) for x in a.eps.split(',') if x]
  if not eps or any(e < 1 or 8 % e or a.experts % e for e in eps) or a.steps < 2:
    p.error(f'--eps={a.eps} must divide 8 and --experts={a.experts}; --steps at least 2')
  a.ep_list = eps
  return a


def measure(ep: int, a: argparse.Namespace, dense: bool = False) -> dict:
  """One row: the mixture at `ep`, or with `dense` the dense model of its active parameters."""
  over = dict(SHAPE)
  if dense:  # top_k experts of 256 as one MLP: the same active parameters and matmul work per token
    over |= {'mesh.ep': 1, 'mesh.dp': 8, 'model.d_ff': a.top_k * 256}
  else:
    over |= {'mesh.ep': ep, 'mesh.dp': 8 // ep, 'moe.num_experts': a.experts, 'moe.top_k': a.top_k}
    over |= {'moe.d_expert': 256, 'moe.capacity_factor': a.capacity_factor}
  cfg = config_lib.load_config('tiny', over)
  s = assemble.build(cfg)
  step = assemble.compile_train_step(s)
  check = next((c for c in step.analysis()['checks'] if c['axis'] == 'ep'), None)
  state = step_lib.make_init(s)(cfg.train.seed)
  rng = np.random.default_rng(0)
  times, m = [], None
  for _ in range(a.steps):
    toks = rng.integers(0, 256, (cfg.train.global_batch_size, cfg.train.seq_len + 1))
    batch = {k: jax.device_put(v, s.batch_sharding) for k, v in packing.one_document_rows(toks).items()}
    t0 = time.perf_counter()
    state, m = step(state, batch)
    jax.block_until_ready(m['loss'])
    times.append(time.perf_counter() - t0)
  mem = step.memory
  return {
    'model': 'dense' if dense else 'moe',
    'ep': 1 if dense else ep,
    'dp': 8 if dense else 8 // ep,
    'argument_mib': mem['argument'] / MIB,
    'temp_mib': mem['temp'] / MIB,
    'all_to_all_mib': (check['measured'] if check else 0.0) / MIB,
    'all_to_all_formula_mib': (check['spmd'] if check else 0.0) / MIB,
    'step_ms': 1e3 * statistics.median(times[1:]),
    'loss': float(m['loss']),
    'moe_dropped': float(m['moe_dropped']) if 'moe_dropped' in m else 0.0,
  }


def main(argv: list[str] | None = None) -> None:
  a = parse_args(argv)
  rows = [measure(1, a, dense=True)] + [measure(ep, a) for ep in a.ep_list]
  dense_ms = rows[0]['step_ms']
  print(
    '| model | ep | dp | params+opt MiB/dev | temp MiB/dev | all-to-all MiB (formula) | step ms | / dense | dropped |'
  )
  print('|---|---:|---:|---:|---:|---:|---:|---:|---:|')
  for r in rows:
    r['vs_dense'] = r['step_ms'] / dense_ms
    print(
      f'| {r["model"]} | {r["ep"]} | {r["dp"]} | {r["argument_mib"]:.2f} | {r["temp_mib"]:.2f} | '
      f'{r["all_to_all_mib"]:.2f} ({r["all_to_all_formula_mib"]:.2f}) | {r["step_ms"]:.0f} | '
      f'{r["vs_dense"]:.2f} | {r["moe_dropped"]:.3f} |'
    )
  if a.json:
    with open(a.json, 'w') as f:
      json.dump({'args': {k: v for k, v in vars(a).items() if k != 'ep_list'}, 'rows': rows}, f, indent=2)


if __name__ == '__main__':
  main()
