"""Peak host memory of a training run as its token shards grow (issue 15: data larger than memory).

  python scripts/rss_shards.py [--sizes-mb=100,1000] [--steps=20] [--dir=/tmp/jax3d_rss]

For each size, writes a token-shard folder (random uint16 tokens below 256, in 4 shards, with the
index jax3d.prepare writes; written in chunks, never held whole) and runs the trainer on it in a
fresh process (the tiny model, on 8 fake CPU devices, `--steps` steps, evaluation included). The
child prints its peak resident set (VmHWM, /proc/self/status) after training; the shards are
memory-mapped, so the peak should not move with the corpus size. The peak of the training loop is
measured from after the compiles (VmHWM reset through /proc/self/clear_refs): XLA's compiler
peak, ~1.5 GiB here, varies by tens of MiB from run to run and has nothing to do with the data.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def write_shards(folder: str, total_mb: int, n_shards: int = 4) -> None:
  os.makedirs(folder, exist_ok=True)
  rng = np.random.default_rng(0)
  per = total_mb * 1_000_000 // 2 // n_shards  # tokens per train shard
  index = {'format': 'jax3d-token-shards', 'version': 1, 'dtype': 'uint16', 'vocab_size': 256}
  index |= {'bos_id': None, 'eos_id': None, 'tokenizer': {'path': 'bytes', 'sha256': 'bytes'}}
  index |= {'train': [], 'val': []}
  for split, n, tokens in (('train', n_shards, per), ('val', 1, 100_000)):
    for i in range(n):
      name = f'{split}-{i:05d}.bin'
      with open(os.path.join(folder, name), 'wb') as f:
        for a in range(0, tokens, 1 << 24):
          rng.integers(0, 256, min(1 << 24, tokens - a), dtype=np.uint16).tofile(f)
      index[split].append({'file': name, 'tokens': tokens})
  with open(os.path.join(folder, 'index.json'), 'w') as f:
    json.dump(index, f)


def child(folder: str, steps: int) -> None:
  from jax3d.cli import prepare_devices

  prepare_devices(8)
  from jax3d import config as config_lib
  from jax3d.trainer.trainer import Trainer

  cfg = config_lib.load_config(
    'tiny',
    {'data.path': folder, 'train.steps': steps, 'eval.every': 10, 'log.every': 5, 'checkpoint.every': 0},
  )
  t = Trainer(cfg, workdir=None, console=False)
  status = lambda: {
    k: int(v.split()[0])
    for k, v in (l.split(':', 1) for l in open('/proc/self/status') if ':' in l)
    if k in ('VmHWM', 'VmRSS', 'RssFile', 'RssAnon')
  }
  try:
    t.init_state()
    t.compile()
    t.evaluate()  # the eval step compiles here
    compiled = status()['VmHWM']
    with open('/proc/self/clear_refs', 'w') as f:  # '5': reset the peak (VmHWM) to the current RSS
      f.write('5')
    t.train()
  finally:
    t.close()
  s = status()
  print(json.dumps({k: s[k] for k in ('VmHWM', 'VmRSS', 'RssFile', 'RssAnon')} | {'compile_hwm': compiled}))


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument('--sizes-mb', default='100,1000')
  p.add_argument('--steps', type=int, default=20)
  p.add_argument('--dir', default='/tmp/jax3d_rss')
  p.add_argument('--child', default='')
  a = p.parse_args()
  if a.child:
    child(a.child, a.steps)
    return
  rows = []
  for mb in (int(x) for x in a.sizes_mb.split(',')):
    folder = os.path.join(a.dir, f'{mb}mb')
    if not os.path.exists(os.path.join(folder, 'index.json')):
      write_shards(folder, mb)
    out = (
      subprocess.run(
        [sys.executable, __file__, f'--child={folder}', f'--steps={a.steps}'],
        capture_output=True,
        text=True,
        check=True,
        env=dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=8'),
      )
      .stdout.strip()
      .splitlines()[-1]
    )
    kb = json.loads(out)
    rows.append((mb, kb))
    print(
      f'{mb:>6} MB of token shards: peak RSS while training {kb["VmHWM"] / 1024:.1f} MiB, at the end '
      f'{kb["VmRSS"] / 1024:.1f} MiB (file-backed {kb["RssFile"] / 1024:.1f} MiB); '
      f'peak while compiling {kb["compile_hwm"] / 1024:.1f} MiB',
      flush=True,
    )
  if len(rows) > 1:
    d = (rows[-1][1]['VmHWM'] - rows[0][1]['VmHWM']) / 1024
    print(f'peak RSS change from {rows[0][0]} MB to {rows[-1][0]} MB: {d:+.1f} MiB')


if __name__ == '__main__':
  main()
