"""Throughput and memory of `python -m jax3d.prepare` on a Parquet file (issue 46): MB of text per
second per worker process, beside the `tokenizers` library's own `encode_batch` on the same texts
(one thread: what one worker has), and the peak resident memory of the prepare process tree at
several input sizes (it should stay flat: tables are read row group by row group).

  python scripts/bench_prepare.py [--sizes_mb=100,300] [--workers=1,2] [--shard_mb=8] [--vocab=8192]
                                  [--dir=/tmp/jax3d_bench_prepare] [--json=docs/bench/bench_prepare.json]

The data is made here, no download: documents of 1-8 KB cut from the standard library's source
(shuffled, so that neighbouring rows differ), written with pyarrow in row groups of about 4 MB, and a byte-level BPE tokenizer trained on the standard library's json and email
packages. Each prepare run is a fresh process (wall time, start-up included; its own figure of the
tokenizing alone is printed too); memory is the sum over the process and its workers, sampled
every 50 ms (psutil). The reference tokenizes the same texts in this process, row group by row
group, with RAYON_NUM_THREADS=1, timing encode_batch alone; prepare runs with RAYON_NUM_THREADS=1
too (one core per worker process, also for --workers=1). Prints a table; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import sysconfig
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STDLIB = sysconfig.get_paths()['stdlib']
GROUP_BYTES = 4 << 20  # row groups of 4 MB of text: several in each work unit


def _sources() -> list[str]:
  out = []
  for name in sorted(os.listdir(STDLIB)):
    if name.endswith('.py'):
      out.append(open(os.path.join(STDLIB, name), encoding='utf-8', errors='replace').read())
  return out


def make_parquet(path: str, mb: int, seed: int = 0) -> int:
  """A Parquet file of about `mb` MB of text in the column 'text'; returns its text bytes."""
  import pyarrow as pa
  import pyarrow.parquet as pq

  if os.path.exists(path) and os.path.exists(path + '.bytes'):
    return int(open(path + '.bytes').read())
  rng = random.Random(seed)
  src = _sources()
  total, rows, size = 0, [], 0
  schema = pa.schema([('id', pa.int64()), ('text', pa.string())])
  with pq.ParquetWriter(path + '.tmp', schema) as w:
    while total < mb * 1e6:
      s = rng.choice(src)
      a = rng.randrange(max(len(s) - 1000, 1))
      doc = s[a : a + rng.randrange(1000, 8000)]
      rows.append(doc)
      n = len(doc.encode())
      size, total = size + n, total + n
      if size >= GROUP_BYTES:
        w.write_table(pa.table({'id': range(len(rows)), 'text': rows}, schema=schema))
        rows, size = [], 0
    if rows:
      w.write_table(pa.table({'id': range(len(rows)), 'text': rows}, schema=schema))
  os.replace(path + '.tmp', path)
  open(path + '.bytes', 'w').write(str(total))
  return total


def make_tokenizer(path: str, vocab: int) -> str:
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  if os.path.exists(path):
    return path
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  texts = []
  for pkg in ('json', 'email'):
    d = os.path.join(STDLIB, pkg)
    texts += [
      open(os.path.join(d, n), encoding='utf-8').read() for n in sorted(os.listdir(d)) if n.endswith('.py')
    ]
  alphabet = pre_tokenizers.ByteLevel.alphabet()
  trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=['<|endoftext|>'], initial_alphabet=alphabet)
  tok.train_from_iterator(texts, trainer)
  tok.save(path)
  return path


def reference_mb_per_s(parquet: str, tok_path: str, limit_mb: float) -> float:
  """The `tokenizers` library's encode_batch alone, one thread (a fresh process with
  RAYON_NUM_THREADS=1), over the file's first `limit_mb` MB of text, row group by row group; MB/s."""
  code = f'import sys; sys.path.insert(0, {ROOT + "/scripts"!r}); import bench_prepare as b; '
  code += f'print(b._reference({parquet!r}, {tok_path!r}, {limit_mb}))'
  env = dict(os.environ, RAYON_NUM_THREADS='1')
  out = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True, check=True)
  return float(out.stdout.strip().splitlines()[-1])


def _reference(parquet: str, tok_path: str, limit_mb: float) -> float:
  import pyarrow.parquet as pq
  from tokenizers import Tokenizer

  tok = Tokenizer.from_file(tok_path)
  pf = pq.ParquetFile(parquet)
  done, seconds = 0, 0.0
  for g in range(pf.num_row_groups):
    texts = pf.read_row_group(g, columns=['text']).column(0).to_pylist()
    t0 = time.perf_counter()
    tok.encode_batch(texts, add_special_tokens=False)
    seconds += time.perf_counter() - t0
    done += sum(len(t.encode()) for t in texts)
    if done >= limit_mb * 1e6:
      break
  return done / 1e6 / seconds


def run_prepare(parquet: str, out: str, tok_path: str, workers: int, shard_mb: float) -> dict:
  """One prepare run in a fresh process: wall seconds, its own MB/s, peak RSS of the tree (MB)."""
  import psutil

  shutil.rmtree(out, ignore_errors=True)
  argv = [
    sys.executable,
    '-m',
    'jax3d.prepare',
    f'--input={parquet}',
    f'--out={out}',
    f'--tokenizer={tok_path}',
  ]
  argv += ['--noprogress', f'--workers={workers}', '--eval_fraction=0.01', f'--shard_mb={shard_mb}']
  env = dict(os.environ, PYTHONPATH=ROOT, RAYON_NUM_THREADS='1')  # one core per worker, also for 1
  t0 = time.perf_counter()
  proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  ps, peak = psutil.Process(proc.pid), 0
  while proc.poll() is None:
    try:
      tree = [ps, *ps.children(recursive=True)]
      peak = max(peak, sum(p.memory_info().rss for p in tree))
    except psutil.Error:
      pass
    time.sleep(0.05)
  wall = time.perf_counter() - t0
  stdout, stderr = proc.communicate()
  if proc.returncode:
    raise SystemExit(f'prepare failed ({proc.returncode}): {stderr[-2000:]}')
  own = re.search(r'= ([0-9.]+) MB/s on', stdout)
  return {'wall_s': wall, 'prepare_mb_per_s': float(own.group(1)) if own else None, 'peak_rss_mb': peak / 1e6}


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--sizes_mb', default='100,300')
  p.add_argument('--workers', default='1,2')
  p.add_argument('--shard_mb', type=float, default=8.0, help='work units: several at every size measured')
  p.add_argument('--vocab', type=int, default=8192)
  p.add_argument('--dir', default='/tmp/jax3d_bench_prepare')
  p.add_argument('--json', default=os.path.join(ROOT, 'docs', 'bench', 'bench_prepare.json'))
  a = p.parse_args(argv)
  os.makedirs(a.dir, exist_ok=True)
  tok = make_tokenizer(os.path.join(a.dir, f'tokenizer{a.vocab}.json'), a.vocab)
  sizes, workers = [int(s) for s in a.sizes_mb.split(',')], [int(w) for w in a.workers.split(',')]
  rows = []
  for mb in sizes:
    parquet = os.path.join(a.dir, f'text{mb}.parquet')
    text_bytes = make_parquet(parquet, mb)
    ref = reference_mb_per_s(parquet, tok, 20)
    for w in workers:
      r = run_prepare(parquet, os.path.join(a.dir, 'out'), tok, w, a.shard_mb)
      mbps = text_bytes / 1e6 / r['wall_s']
      rows.append(
        {
          'input_mb': round(text_bytes / 1e6, 1),
          'file_mb': round(os.path.getsize(parquet) / 1e6, 1),
          'workers': w,
        }
        | r
        | {'mb_per_s': mbps, 'mb_per_s_per_worker': mbps / w, 'tokenizers_1thread_mb_per_s': ref}
        | {'per_worker_vs_tokenizers': mbps / w / ref}
      )
      x = rows[-1]
      print(
        f'{x["input_mb"]:>8.1f} MB text ({x["file_mb"]:.0f} MB file)  {w} worker(s): {x["mb_per_s"]:6.2f} MB/s '
        f'wall ({x["prepare_mb_per_s"]} tokenizing), {x["mb_per_s_per_worker"]:5.2f} per worker = '
        f'{x["per_worker_vs_tokenizers"]:.2f} x tokenizers encode_batch 1 thread ({ref:.2f} MB/s); '
        f'peak RSS {x["peak_rss_mb"]:.0f} MB',
        flush=True,
      )
  by_w = {w: [r['peak_rss_mb'] for r in rows if r['workers'] == w] for w in workers}
  flat = {str(w): max(v) / min(v) for w, v in by_w.items() if len(v) > 1}
  print('peak RSS, largest input over smallest, per worker count:', {k: round(v, 2) for k, v in flat.items()})
  with open(a.json, 'w') as f:
    json.dump(
      {'cpus': os.cpu_count(), 'load_avg': os.getloadavg(), 'vocab': a.vocab, 'shard_mb': a.shard_mb}
      | {'rows': rows, 'rss_largest_over_smallest': flat},
      f,
      indent=1,
    )
  return 0


if __name__ == '__main__':
  sys.exit(main())
