"""Context parallelism on GPUs that are not attached (issue 43): the train step of a 1B-shaped model
at a long sequence compiled by XLA:GPU for `--target` (deviceless, jax3d/devices/gpu_target.py),
bytes per GPU from the executable's memory_analysis beside the memory model's estimate.

  python scripts/bench_cp_gpu.py [--target=h100x8] [--seq=65536] [--cps=8,4]
                                 [--json=docs/bench/cp_gpu.json]

Shape: scripts/bench_attention_memory.py's 1B (16 layers, d_model 2048, 32 heads / 8 KV heads of
128, d_ff 8192, vocab 32000, bf16, remat dots, the head and loss in 8 pieces), one row of `--seq`
tokens per dp rank (dp = GPUs/cp), the row split over mesh.cp devices (attention blockwise, K/V all-gathered over cp).
Needs the CUDA plugin (`pip install 'jax3d[cuda12]'`), no GPU. One compile at a time (about 20 s
each on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jax3d import config as config_lib  # noqa: E402

GIB = 2**30


def shape(seq: int, cp: int, n_gpus: int) -> dict:
  """The 1B shape's overrides at `seq` tokens, `cp` (dp fills the rest, one row per dp rank)."""
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from bench_attention_memory import GPU_1B

  dp = n_gpus // cp
  return GPU_1B | {
    'mesh.dp': dp,
    'mesh.cp': cp,
    'train.seq_len': seq,
    'model.max_seq_len': seq,
    'train.global_batch_size': dp,  # one row per dp rank
    'train.attention': 'blockwise',
    'train.loss_chunks': 8,
  }


def one(target: str, seq: int, cp: int) -> dict:
  """Compiled bytes per GPU and the memory model's estimate of one layout."""
  from jax3d import api
  from jax3d.devices import gpu_target
  from jax3d.planning import costmodel
  from jax3d.planning.hardware import Hardware

  gpus = gpu_target.parse(target, 'target')
  cfg = config_lib.load_config('tiny', shape(seq, cp, gpus.n))
  plan = config_lib.validate(cfg, gpus.n)
  hw = Hardware(nodes=max(1, gpus.nodes), gpus_per_node=gpus.per_node, attention='blockwise')
  est = costmodel.estimate(cfg, plan, gpus.memory_bytes, hw)
  t0 = time.time()
  m = api.compiled_memory(cfg, target=target)
  return {
    'seq': seq,
    'cp': cp,
    'dp': plan.dp,
    'compile_s': round(time.time() - t0, 1),
    'compiled_total_gib': round(m['total'] / GIB, 2),
    'compiled_temp_gib': round(m['temp'] / GIB, 2),
    'estimate_gib': round(est.total_bytes / GIB, 2),
    'estimate_breakdown_gib': {k: round(v / GIB, 3) for k, v in est.breakdown.items()},
    'device_gib': round(gpus.memory_bytes / GIB, 1),
    'fits': bool(m['fits']),
  }


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  ap.add_argument('--target', default='h100x8')
  ap.add_argument('--seq', type=int, default=65536)
  ap.add_argument('--cps', default='8,4')
  ap.add_argument('--json', default='docs/bench/cp_gpu.json')
  a = ap.parse_args()
  rows = []
  print(f'{a.target}, 1B-shaped model, seq {a.seq}:')
  print(
    f'{"cp":>3} {"dp":>3} {"compiled GiB":>13} {"temp GiB":>9} {"estimate GiB":>13} {"est/comp":>9}  fits'
  )
  for cp in [int(x) for x in a.cps.split(',') if x]:
    r = one(a.target, a.seq, cp)
    rows.append(r)
    print(
      f'{cp:>3} {r["dp"]:>3} {r["compiled_total_gib"]:>13.2f} {r["compiled_temp_gib"]:>9.2f} '
      f'{r["estimate_gib"]:>13.2f} {r["estimate_gib"] / r["compiled_total_gib"]:>9.2f}  {r["fits"]}'
      f'  ({r["compile_s"]} s)',
      flush=True,
    )
    with open(a.json, 'w') as f:  # after each compile: a partial table survives a stopped run
      common = {k: v for k, v in shape(a.seq, 1, 1).items() if k not in ('mesh.dp', 'mesh.cp')}
      json.dump({'target': a.target, 'shape': common, 'rows': rows}, f, indent=1)
  print(f'wrote {a.json}')


if __name__ == '__main__':
  main()
