"""Start-up time of a 3-source mixture (data.mixture, issue 46) beside one source of the same tokens.

  python scripts/bench_mixture.py [--mb=8] [--rounds=5] [--json=docs/bench/bench_mixture.json]
                                  [--dir=/tmp/jax3d_bench_mixture]

The data is made here, no download: text files of standard-library lines, --mb MB in all, split
60/30/10 into three folders (web, code, math) and prepared by `jax3d.prepare` (bytes tokenizer)
into three token-shard folders, and the same files prepared as one folder. Each figure is a fresh
process (so no cache is warm but the OS's page cache): the time to import jax3d's data modules,
to load the data (`mixture.for_config`: indexes, document starts, the rows' layout), to build the
first batch (step 0) and a batch far into the run (step 100,000: the mixture's schedule is
state-free, nothing before it is replayed), of train.global_batch_size 64 x seq_len 1024. The
variants run interleaved, --rounds times each; the table gives medians and the mixture / one
source ratio (written beside the JSON as .txt), the JSON every round too.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = (('web', 0.6), ('code', 0.3), ('math', 0.1))
PROBE = r"""
import json, sys, time
t0 = time.perf_counter()
from jax3d import config as config_lib
from jax3d.data import corpus as corpus_lib, mixture, tokenizer as tok_lib
t1 = time.perf_counter()
cfg = config_lib.load_config('tiny', json.loads(sys.argv[1]))
c = mixture.for_config(cfg, tok_lib.load('bytes'))
c.order(cfg.train.seed, cfg.train.seq_len)
t2 = time.perf_counter()
corpus_lib.batch_at(c, cfg.train.seed, 0, cfg.train.global_batch_size, cfg.train.seq_len)
t3 = time.perf_counter()
corpus_lib.batch_at(c, cfg.train.seed, 100_000, cfg.train.global_batch_size, cfg.train.seq_len)
t4 = time.perf_counter()
print(json.dumps({'import_s': t1 - t0, 'load_s': t2 - t1, 'first_batch_s': t3 - t2, 'far_batch_s': t4 - t3}))
"""


def _write_text(folder: str, mb: float, seed: int) -> None:
  """Files of standard-library source lines, about `mb` MB in all."""
  import random

  os.makedirs(folder, exist_ok=True)
  lines = []
  for name in sorted(os.listdir(sysconfig.get_paths()['stdlib']))[:200]:
    path = os.path.join(sysconfig.get_paths()['stdlib'], name)
    if name.endswith('.py'):
      lines += open(path, encoding='utf-8', errors='replace').read().splitlines()
  rng, size, i = random.Random(seed), 0, 0
  while size < mb * 1e6:
    text = '\n'.join(rng.choice(lines) for _ in range(300))
    with open(os.path.join(folder, f'f{i:04d}.txt'), 'w') as f:
      f.write(text)
    size, i = size + len(text), i + 1


def _prepare(inp: str, out: str) -> None:
  cmd = [sys.executable, '-m', 'jax3d.prepare', f'--input={inp}', f'--out={out}', '--noprogress']
  subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)


def make_data(base: str, mb: float) -> dict[str, dict]:
  """The config overrides of each variant: the three shard folders mixed, and one folder of all."""
  if os.path.exists(os.path.join(base, 'one', 'index.json')):
    return _variants(base)
  shutil.rmtree(base, ignore_errors=True)
  for i, (name, share) in enumerate(SOURCES):
    _write_text(os.path.join(base, 'text', name), mb * share, i)
    _write_text(os.path.join(base, 'text_all', name), mb * share, i)
    _prepare(os.path.join(base, 'text', name), os.path.join(base, name))
  _prepare(os.path.join(base, 'text_all'), os.path.join(base, 'one'))
  return _variants(base)


def _variants(base: str) -> dict[str, dict]:
  common = {'train.global_batch_size': 64, 'train.seq_len': 1024}
  mix = ','.join(f'{n}={w}:{os.path.join(base, n)}' for n, w in SOURCES)
  return {
    'one source': common | {'data.path': os.path.join(base, 'one')},
    '3-source mixture': common | {'data.mixture': mix},
  }


def probe(over: dict) -> dict:
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=ROOT)
  r = subprocess.run(
    [sys.executable, '-c', PROBE, json.dumps(over)], cwd=ROOT, env=env, capture_output=True, text=True
  )
  if r.returncode:
    raise SystemExit(f'probe failed:\n{r.stderr[-3000:]}')
  return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--mb', type=float, default=8.0)
  p.add_argument('--rounds', type=int, default=5)
  p.add_argument('--json', default=os.path.join(ROOT, 'docs', 'bench', 'bench_mixture.json'))
  p.add_argument('--dir', default='/tmp/jax3d_bench_mixture')
  a = p.parse_args(argv)
  variants = make_data(a.dir, a.mb)
  rounds: dict[str, list[dict]] = {k: [] for k in variants}
  for _ in range(a.rounds):
    for name, over in variants.items():
      rounds[name].append(probe(over))
  keys = ('import_s', 'load_s', 'first_batch_s', 'far_batch_s')
  med = {n: {k: statistics.median(r[k] for r in rs) for k in keys} for n, rs in rounds.items()}
  lines = [f'{a.mb:g} MB of text, batch 64 x 1024, medians of {a.rounds} fresh processes each (seconds)']
  lines.append(f'{"":18s}' + ''.join(f'{k:>15s}' for k in keys))
  for n, m in med.items():
    lines.append(f'{n:18s}' + ''.join(f'{m[k]:15.3f}' for k in keys))
  one, mix = med['one source'], med['3-source mixture']
  ratio = {k: mix[k] / one[k] for k in keys}
  lines.append(f'{"mixture / one":18s}' + ''.join(f'{ratio[k]:15.2f}' for k in keys))
  print('\n'.join(lines))
  if a.json:  # the figures, and the table beside them (.txt)
    with open(a.json, 'w') as f:
      json.dump({'mb': a.mb, 'rounds': rounds, 'medians': med, 'ratio': ratio}, f, indent=1)
    with open(os.path.splitext(a.json)[0] + '.txt', 'w') as f:
      f.write(
        '$ python scripts/bench_mixture.py ' + ' '.join(argv if argv is not None else sys.argv[1:]) + '\n'
      )
      f.write('\n'.join(lines) + '\n')
    print(f'wrote {a.json} and its .txt')
  return 0


if __name__ == '__main__':
  sys.exit(main())
