"""Context parallelism's memory (issue 43): compiled temp bytes per device of the train step
against the sequence length at mesh.cp = 1, 2, 4, 8 on 8 fake CPU devices, and the longest
sequence that fits a per-device budget; then the two attention strategies side by side
(train.cp_strategy allgather and ring at --strategy_cp): compiled temp bytes at --strategy_seqs
and the median step time (steps run alternately, A B A B ..., the first of each left out) at
those up to --time_max_seq.

  python scripts/bench_cp.py [--seqs=4096,8192,16384,32768] [--cps=1,2,4,8] [--budget_mib=512]
                             [--strategy_seqs=2048,4096,16384] [--strategy_cp=8] [--steps=6]
                             [--time_max_seq=4096] [--json=docs/bench/cp_memory.json]

The real train step (`assemble.compile_train_step`, one row of documents per step, dp=1, the row
split over cp devices, train.attention=blockwise) compiled, not run: XLA's memory_analysis temp
bytes of one device. Shape as scripts/bench_attention_memory.py's (2 layers, d_model 256, 4 heads
of 64, 2 KV heads, d_ff 1024, vocab 256, float32, remat none). The goal: activation (temp) memory
per device falling as 1/cp. The K/V all-gather holds the whole sequence's K and V of one layer
on every device (2 * seq * kv_heads * head_dim * 4 bytes), which does not fall with cp; the ring
holds its own, the visiting and the arriving block (3 * 2/cp of that) and the backward's fp32
dK/dV accumulators. Step times on fake CPU devices share the host's cores: their ratio, not
their size, is the figure (on GPUs the ring's transfers overlap the block computation).
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
  'model.n_kv_heads': 2,
  'model.d_ff': 1024,
  'model.vocab_size': 256,
  'train.global_batch_size': 1,
  'train.remat': 'none',
  'train.attention': 'blockwise',
  'train.warmup_steps': 1,
  'model.max_seq_len': 65536,
  'mesh.dp': 1,
  'mesh.pp': 1,
  'mesh.tp': 1,
  'pipeline.microbatches': 1,
}
MIB = 2**20


STRATEGIES = ('allgather', 'ring')


def setup(seq: int, cp: int, strategy: str = 'allgather'):
  over = SHAPE | {'train.seq_len': seq, 'mesh.cp': cp, 'train.cp_strategy': strategy}
  return assemble.build(config_lib.load_config('tiny', over), jax.devices()[:cp])


def temp_bytes(seq: int, cp: int) -> int:
  return int(assemble.compile_train_step(setup(seq, cp)).memory['temp'])


def strategies(seq: int, cp: int, steps: int) -> dict:
  """Both strategies at (seq, cp): compiled temp bytes, and with steps > 0 their step times
  (seconds, the steps alternating between the two on one batch), the losses of the first step."""
  runs = {}
  for st in STRATEGIES:
    s = setup(seq, cp, st)
    step = assemble.compile_train_step(s)
    runs[st] = {'s': s, 'step': step, 'temp_bytes': int(step.memory['temp']), 'times': []}
  if steps:
    s = runs[STRATEGIES[0]]['s']
    toks = np.random.default_rng(0).integers(0, s.dims.vocab_size, (1, seq + 1)).astype(np.int32)
    rows = packing.one_document_rows(toks)
    for r in runs.values():
      r['state'] = step_lib.make_init(r['s'])(0)
      r['batch'] = {k: jax.device_put(v, r['s'].batch_sharding) for k, v in rows.items()}
    for _ in range(steps):
      for r in runs.values():
        t0 = time.perf_counter()
        r['state'], m = r['step'](r['state'], r['batch'])
        r['loss'] = r.get('loss', float(m['loss']))  # the first step's
        r['times'].append(time.perf_counter() - t0)
  out = {'seq': seq, 'cp': cp}
  for st, r in runs.items():
    out[f'{st}_temp_bytes'] = r['temp_bytes']
    if steps:
      out[f'{st}_step_s_median'] = statistics.median(r['times'][1:])
      out[f'{st}_step_s'] = r['times']
      out[f'{st}_first_loss'] = r['loss']
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  ap.add_argument('--seqs', default='4096,8192,16384,32768')
  ap.add_argument('--cps', default='1,2,4,8')
  ap.add_argument('--budget_mib', type=float, default=512.0)
  ap.add_argument('--strategy_seqs', default='2048,4096,16384')
  ap.add_argument('--strategy_cp', type=int, default=8)
  ap.add_argument('--steps', type=int, default=6)
  ap.add_argument('--time_max_seq', type=int, default=4096)
  ap.add_argument('--json', default='docs/bench/cp_memory.json')
  a = ap.parse_args()
  seqs, cps = [int(x) for x in a.seqs.split(',')], [int(x) for x in a.cps.split(',')]
  rows = []
  print(f'{"seq":>6} ' + ' '.join(f'{f"cp={c} MiB":>11}' for c in cps) + f' {"cp=1/cp=max":>12}')
  for seq in seqs:
    row = {'seq': seq, **{f'cp{c}_temp_bytes': temp_bytes(seq, c) for c in cps}}
    row['ratio_first_last'] = row[f'cp{cps[0]}_temp_bytes'] / row[f'cp{cps[-1]}_temp_bytes']
    rows.append(row)
    cells = ' '.join(f'{row[f"cp{c}_temp_bytes"] / MIB:>11.1f}' for c in cps)
    print(f'{seq:>6} {cells} {row["ratio_first_last"]:>12.2f}', flush=True)
  budget = a.budget_mib * MIB
  longest = {c: max([r['seq'] for r in rows if r[f'cp{c}_temp_bytes'] <= budget], default=0) for c in cps}
  print(
    f'longest measured seq within {a.budget_mib:.0f} MiB temp per device: '
    + ', '.join(f'cp={c}: {v}' for c, v in longest.items())
  )
  cp = a.strategy_cp
  print(f'\nallgather against ring at cp={cp}: compiled temp MiB per device, median step seconds')
  print(
    f'{"seq":>6} {"allgather MiB":>14} {"ring MiB":>9} {"allgather s":>12} {"ring s":>7} {"ring/allgather s":>17}'
  )
  ring_rows = []
  for seq in [int(x) for x in a.strategy_seqs.split(',') if x]:
    r = strategies(seq, cp, a.steps if seq <= a.time_max_seq else 0)
    ring_rows.append(r)
    mem = f'{r["allgather_temp_bytes"] / MIB:>14.1f} {r["ring_temp_bytes"] / MIB:>9.1f}'
    if 'ring_step_s_median' in r:
      ag, ring = r['allgather_step_s_median'], r['ring_step_s_median']
      print(f'{seq:>6} {mem} {ag:>12.3f} {ring:>7.3f} {ring / ag:>17.2f}', flush=True)
    else:
      print(f'{seq:>6} {mem} {"-":>12} {"-":>7} {"-":>17}', flush=True)
  out = {
    'shape': SHAPE,
    'rows': rows,
    'budget_mib': a.budget_mib,
    'longest_within_budget': longest,
    'strategies': {'cp': cp, 'steps': a.steps, 'rows': ring_rows},
  }
  os.makedirs(os.path.dirname(a.json) or '.', exist_ok=True)
  with open(a.json, 'w') as f:
    json.dump(out, f, indent=1)
  print(f'wrote {a.json}')


if __name__ == '__main__':
  main()
