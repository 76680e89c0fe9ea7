"""Step time with segment masks against without (issue 31), side by side, same shape.

  python scripts/bench_segments.py [--layouts=1-1-1,2-2-2,2-1-4-sp,2-2-2-1f1b] [--steps=8]
                                   [--rounds=3] [--json=bench_segments.json]

Both programs run the train step's own `loss_and_grads` (embedding, pipeline, head, weighted loss,
gradients over dp) and the AdamW update on the same tokens and weights: `with` on rows of
documents (segment ids and restarting positions: the attention mask of every layer, per-row
rotary angles), `without` on the same rows given no segment ids or positions (one causal sequence
per row, the program of a batch without documents). Shape: 4 layers, d_model 256, 4 heads, d_ff
1024, vocab 256, seq 256, 16 rows, float32, remat none, fake CPU devices. The two run in
alternation, `--rounds` rounds of `--steps` steps each (the first step of a round is dropped);
the figure is the median over all kept steps. Prints a table and writes the JSON.
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
import optax  # noqa: E402

from jax3d import (  # noqa: E402
  assemble,
  config as config_lib,
  loss as loss_lib,
  step as step_lib,  # noqa: E402
)
from jax3d.data import packing  # noqa: E402
from jax3d.parallel import sharding  # noqa: E402

SHAPE = {
  'model.n_layers': 4,
  'model.d_model': 256,
  'model.n_heads': 4,
  'model.n_kv_heads': 4,
  'model.d_ff': 1024,
  'model.vocab_size': 256,
  'train.seq_len': 256,
  'train.global_batch_size': 16,
  'train.remat': 'none',
  'mesh.dp': 1,
  'mesh.pp': 1,
  'mesh.tp': 1,
  'pipeline.microbatches': 1,
}
LAYOUTS = {
  '1-1-1': {},
  '2-2-2': {'mesh.dp': 2, 'mesh.pp': 2, 'mesh.tp': 2, 'pipeline.microbatches': 4},
  '2-1-4-sp': {'mesh.dp': 2, 'mesh.tp': 4, 'train.sequence_parallel': 'true'},
  '2-2-2-1f1b': {
    'mesh.dp': 2,
    'mesh.pp': 2,
    'mesh.tp': 2,
    'pipeline.microbatches': 4,
    'pipeline.schedule': '1f1b',
  },
}


def documents_batch(rows: int, seq: int, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
  """Rows of documents of 16 to 128 tokens, concatenated (data.packing=concat): ~4 per row."""
  rng = np.random.default_rng(seed)
  sizes = rng.integers(16, 129, 8 * rows * seq // 64)
  starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
  docs = packing.Documents(rng.integers(0, vocab, starts[-1]), starts)
  return packing.layout(docs, seq, 'concat').rows(np.arange(rows))


def make_step(s: assemble.Setup) -> step_lib.MeshJit:
  """loss_and_grads and the AdamW update: the train step's work (no skip cond, no metrics)."""

  def one(state, batch):
    with sharding.use_rules(s.rules):
      loss, grads, _ = loss_lib.loss_and_grads(state['params'], batch, None, s)
    updates, opt_state = s.tx.update(grads, state['opt_state'], state['params'])
    return {**state, 'params': optax.apply_updates(state['params'], updates), 'opt_state': opt_state}, loss

  return step_lib.MeshJit(one, s.mesh, donate_argnums=(0,))


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  ap.add_argument('--layouts', default=','.join(LAYOUTS))
  ap.add_argument('--steps', type=int, default=8)
  ap.add_argument('--rounds', type=int, default=3)
  ap.add_argument('--json', default='bench_segments.json')
  args = ap.parse_args()
  results = []
  print(f'{"layout":<12} {"without ms":>11} {"with ms":>9} {"ratio":>7}  segments/row')
  for name in args.layouts.split(','):
    cfg = config_lib.load_config('tiny', SHAPE | LAYOUTS[name])
    s = assemble.build(cfg, jax.devices()[: cfg.mesh.dp * cfg.mesh.pp * cfg.mesh.tp])
    host = documents_batch(s.plan.global_batch, s.plan.seq_len, s.dims.vocab_size)
    keys = {'without': ('inputs', 'targets', 'weights'), 'with': packing.KEYS}
    batches = {n: {k: jax.device_put(host[k], s.batch_sharding) for k in ks} for n, ks in keys.items()}
    step = make_step(s)
    state = {k: step_lib.make_init(s)(0) for k in batches}
    times: dict[str, list[float]] = {k: [] for k in batches}
    for _ in range(args.rounds):
      for k, b in batches.items():
        for i in range(args.steps):
          t0 = time.perf_counter()
          state[k], loss = step(state[k], b)
          jax.block_until_ready(loss)
          if i:
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    per_row = float(np.mean(host['segment_ids'].max(axis=1)))
    row = {
      'layout': name,
      'without_ms': med['without'],
      'with_ms': med['with'],
      'ratio': med['with'] / med['without'],
      'segments_per_row': per_row,
      'steps_timed': len(times['with']),
    }
    results.append(row)
    print(f'{name:<12} {row["without_ms"]:>11.1f} {row["with_ms"]:>9.1f} {row["ratio"]:>7.3f}  {per_row:.1f}')
  shape = {**SHAPE, 'devices': 'fake CPU', 'jax': jax.__version__}
  with open(args.json, 'w') as f:
    json.dump({'shape': shape, 'results': results}, f, indent=1)
  print(f'wrote {args.json}')


if __name__ == '__main__':
  main()
