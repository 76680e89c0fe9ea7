"""Context parallelism's memory (issue 43): compiled temp bytes per device of the train step
against the sequence length at mesh.cp = 1, 2, 4, 8 on 8 fake CPU devices, and the longest
sequence that fits a per-device budget.

  python scripts/bench_cp.py [--seqs=4096,8192,16384,32768] [--cps=1,2,4,8] [--budget_mib=512]
                             [--json=docs/bench/cp_memory.json]

The real train step (`assemble.compile_train_step`, one row of documents per step, dp=1, the row
split over cp devices, train.attention=blockwise) compiled, not run: XLA's memory_analysis temp
bytes of one device. Shape as scripts/bench_attention_memory.py's (2 layers, d_model 256, 4 heads
of 64, 2 KV heads, d_ff 1024, vocab 256, float32, remat none). The goal: activation (temp) memory
per device falling as 1/cp. The K/V all-gather holds the whole sequence's K and V of one layer
on every device (2 * seq * kv_heads * head_dim * 4 bytes), which does not fall with cp.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jax3d.parallel.mesh import use_fake_cpu_devices  # noqa: E402

use_fake_cpu_devices(8)
import jax  # noqa: E402

from jax3d import assemble, config as config_lib  # noqa: E402

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


def temp_bytes(seq: int, cp: int) -> int:
  over = SHAPE | {'train.seq_len': seq, 'mesh.cp': cp}
  s = assemble.build(config_lib.load_config('tiny', over), jax.devices()[:cp])
  return int(assemble.compile_train_step(s).memory['temp'])


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  ap.add_argument('--seqs', default='4096,8192,16384,32768')
  ap.add_argument('--cps', default='1,2,4,8')
  ap.add_argument('--budget_mib', type=float, default=512.0)
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
  out = {'shape': SHAPE, 'rows': rows, 'budget_mib': a.budget_mib, 'longest_within_budget': longest}
  os.makedirs(os.path.dirname(a.json) or '.', exist_ok=True)
  with open(a.json, 'w') as f:
    json.dump(out, f, indent=1)
  print(f'wrote {a.json}')


if __name__ == '__main__':
  main()
