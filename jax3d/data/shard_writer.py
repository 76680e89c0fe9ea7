"""Token shards from text: an optional BPE tokenizer trained with `tokenizers`, then the corpus
tokenized on every core into `OUT/{train,val}-NNNNN.bin` with `OUT/index.json` (the format of
jax3d/data/shards.py). Behind `python -m jax3d.prepare`; imports no jax.

Documents (read by jax3d/data/reading.py, every file for what it is: jax3d/data/inputs.py): a text
file is one document (a file over `shard_bytes` is cut at line ends into several), a JSONL line is
one document (its `field`, a string). Each document ends with EOS (and starts with BOS when the
tokenizer has one); a table row is one (its `field` column: jax3d/data/arrow_tables.py, read a row
group at a time; a bad row fails or with on_bad='skip' is counted). With `fmt='chat'` a JSONL line
is a conversation ({"messages": [...]}) rendered with the tokenizer folder's chat template, with no
BOS/EOS added (the template writes its own), and a loss weight per token (jax3d/data/chat.py). Each
shard's document starts and (chat) weights are written beside it (jax3d/data/shards.py). A document
is held out when a hash of its name (relative path, plus the byte offset for JSONL lines and cut
files) says so (jax3d/data/documents.py): a document is wholly in train or wholly in val, so the
splits never share a document.

Work units (tokenized in worker processes: jax3d/data/shard_unit.py): consecutive documents of
about `shard_bytes` of text; unit i writes train-i.bin and
val-i.bin (into temporary names, renamed when complete) and then unit-i.json with a fingerprint
of its inputs (paths, sizes, mtimes, byte ranges), the tokenizer's sha256 and the settings. A
rerun skips every unit whose record matches, so an interrupted run resumes and a finished one
does nothing; the index is written last. Over a complete dataset the new one is written beside it
and swapped in when complete (jax3d/data/staging.py). Each shard's largest token id is recorded
(`max_id`), checked against the tokenizer's vocabulary here and the model's when a run opens it.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import time

import numpy as np

from jax3d.data import (
  arrow_tables,
  chat,
  hf_datasets,
  inputs,
  shard_unit,
  shards,
  staging,
  tokenizer as tok_lib,
)
from jax3d.data.reading import JSONL_SUFFIXES, Piece, input_files, pieces, units
from jax3d.errors import ConfigError

VERSION = 2  # 2: document starts (and chat weights) beside each shard


def _fingerprint(unit: list[Piece], settings: dict) -> str:
  stat = [(p.rel, p.start, p.end, os.path.getsize(p.origin), os.stat(p.origin).st_mtime_ns) for p in unit]
  return hashlib.sha256(json.dumps([VERSION, settings, stat]).encode()).hexdigest()


def _done(out: str, i: int, fingerprint: str, itemsize: int) -> dict | None:
  """The record of unit i when it is complete for this fingerprint, else None."""
  try:
    with open(os.path.join(out, f'unit-{i:05d}.json')) as f:
      rec = json.load(f)
  except (OSError, ValueError):
    return None

  def size(name: str | None) -> int | None:
    path = os.path.join(out, name) if name else None
    return os.path.getsize(path) if path and os.path.exists(path) else None

  files_ok = all(
    size(rec[k]['file']) == rec[k]['tokens'] * itemsize
    and size(rec[k].get('starts')) == rec[k]['documents'] * 8
    and ('weights' not in rec[k] or size(rec[k]['weights']) == rec[k]['tokens'])
    for k in ('train', 'val')
  )
  return rec if rec.get('fingerprint') == fingerprint and files_ok else None


def tokenize(
  path: str,
  out: str,
  tok_path: str,
  field: str = 'text',
  eval_fraction: float = 0.05,
  shard_bytes: int = 64 << 20,
  workers: int = 0,
  progress: bool = True,
  fmt: str = 'text',
  split: str = '',
  on_bad: str = 'fail',
) -> dict:
  """Tokenizes the corpus at `path` into `out` (see the module docstring; `fmt` 'text' or 'chat';
  `split` of a DatasetDict or hf: input; a bad row or line raises, or with on_bad='skip' is left
  out and counted); returns the index with the run's figures added ('seconds', 'mb_per_s',
  'workers', 'units_done', 'units_skipped', 'bytes', 'undecodable', 'bad_rows'). A complete
  dataset at `out` is replaced only once the new one is complete (jax3d/data/staging.py).
  ConfigError for input that holds no document."""
  staging.check(path, out)
  staging.recover(out)
  new = staging.folder(out)
  read = (split, on_bad)
  try:
    index = _tokenize(
      path, out, new, tok_path, field, eval_fraction, shard_bytes, workers, progress, fmt, read
    )
  finally:
    shutil.rmtree(os.path.join(new, '.inputs'), ignore_errors=True)  # decompressed inputs
  staging.swap(out, new)
  return index


def _tokenize(
  path: str,
  out: str,
  new: str,
  tok_path: str,
  field: str,
  eval_fraction: float,
  shard_bytes: int,
  workers: int,
  progress: bool,
  fmt: str,
  read: tuple[str, str] = ('', 'fail'),
) -> dict:
  """`tokenize`, writing into the folder `new` (OUT, or OUT.partial beside a complete dataset);
  `read`: (split, on_bad)."""
  tok = tok_lib.load(tok_path)
  dtype = shards.dtype_for(tok.vocab_size)
  settings = {
    'tokenizer': tok_lib.fingerprint(tok),
    'field': field,
    'eval_fraction': eval_fraction,
    'dtype': dtype,
    'format': fmt,
    'on_bad': read[1],
  }
  if fmt == 'chat':  # the template is part of what the shards are made with
    source = chat.load_template(os.path.dirname(tok.path)).source
    settings['template'] = hashlib.sha256(source.encode()).hexdigest()
  root, files = input_files(path, read[0])
  if fmt == 'chat':
    files = [f for f in files if inputs.plain_name(f).endswith(JSONL_SUFFIXES) or arrow_tables.is_table(f)]
  work = units(pieces(root, files, shard_bytes, os.path.join(new, '.inputs'), field, fmt), shard_bytes)
  if not work:
    raise ConfigError(
      f'--input={path}: no {"JSONL " if fmt == "chat" else ""}text to prepare '
      f'({len(files)} file(s), all empty): jax3d reads {inputs.TEXT_FORMATS}'
    )
  jobs, records = _jobs(work, out, new, settings)
  workers = workers or os.cpu_count() or 1
  total = sum(p.size for j in jobs for p in j[1])
  t0 = time.perf_counter()
  if jobs:
    records |= _run_jobs(jobs, (tok.path or tok_lib.BYTES, fmt), workers, total, progress)
  seconds = time.perf_counter() - t0
  bad = _undecodable(records, work)
  if not sum(records[i][k]['documents'] for i in records for k in ('train', 'val')):
    raise ConfigError(f'--input={path}: no document in {len(files)} file(s) (only blank lines)')
  index = {
    'format': shards.FORMAT,
    'version': VERSION,
    'dtype': dtype,
    'vocab_size': tok.vocab_size,
    'bos_id': tok.bos_id,
    'eos_id': tok.eos_id,
    'tokenizer': {'path': tok.path or tok_lib.BYTES, 'sha256': settings['tokenizer']},
    'source': (path if path.startswith(hf_datasets.HF) else os.path.abspath(path)) if path else root,
    'eval_fraction': eval_fraction,
    'data_format': fmt,
    'train': [records[i]['train'] for i in sorted(records)],
    'val': [records[i]['val'] for i in sorted(records)],
  }
  _write_index(new, index)
  figures = {'seconds': seconds, 'mb_per_s': total / 1e6 / max(seconds, 1e-9), 'workers': workers}
  done = {'units_done': len(jobs), 'units_skipped': len(work) - len(jobs), 'bytes': total}
  skipped = arrow_tables.merged([records[i].get('bad_rows', {}) for i in sorted(records)])
  return index | figures | done | {'undecodable': bad, 'bad_rows': skipped}


def _undecodable(records: dict[int, dict], work: list[list[Piece]]) -> dict[str, int]:
  """{input file: undecodable bytes} over every unit; ConfigError naming a file where they are more
  than inputs.MAX_UNDECODABLE of its bytes (it is not UTF-8)."""
  bad: dict[str, int] = {}
  for rec in records.values():
    for file, n in rec.get('undecodable', {}).items():
      bad[file] = bad.get(file, 0) + n
  sizes = {p.origin: os.path.getsize(p.file) for unit in work for p in unit}
  for file, n in bad.items():
    inputs.check_undecodable(file, n, sizes.get(file, n))
  return bad


def _jobs(work: list[list[Piece]], out: str, new: str, settings: dict) -> tuple[list[tuple], dict[int, dict]]:
  """(the jobs of the units still to tokenize into `new`, {unit: record} of those already done with
  these settings: in `new`, or in the complete dataset at `out`, linked into `new`)."""
  jobs, records = [], {}
  itemsize = np.dtype(settings['dtype']).itemsize
  for i, unit in enumerate(work):
    fp = _fingerprint(unit, settings)
    rec = _done(new, i, fp, itemsize)
    if rec is None and new != os.path.abspath(out):  # done in the complete dataset: linked into new
      rec = _done(out, i, fp, itemsize)
      if rec is not None:
        for name in _files(rec) + [f'unit-{i:05d}.json']:  # the record last: the unit is complete
          staging.link(os.path.join(out, name), os.path.join(new, name))
    if rec is None:
      jobs.append((i, unit, new, settings, fp))
    else:
      records[i] = rec
  return jobs, records


def _files(rec: dict) -> list[str]:
  """The shard files of a unit's record."""
  return [rec[k][f] for k in ('train', 'val') for f in ('file', 'starts', 'weights') if rec[k].get(f)]


def _run_jobs(jobs: list[tuple], init: tuple, workers: int, total: int, progress: bool) -> dict[int, dict]:
  """Runs the jobs in a pool of `workers` processes (`init`: their (tokenizer path, format); a
  progress bar over their `total` bytes); returns {unit: record}."""
  from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

  records = {}
  ctx = multiprocessing.get_context('spawn')  # tokenizers' threads do not survive a fork
  columns = (TextColumn('tokenizing'), BarColumn(), TransferSpeedColumn(), TimeRemainingColumn())
  with Progress(*columns, disable=not progress) as bar:
    task = bar.add_task('tokenize', total=total)
    if workers == 1:  # in this process (no pool to start)
      shard_unit.init_worker(*init, pool=False)
      done = map(shard_unit.run_unit, jobs)
    else:
      pool = ctx.Pool(min(workers, len(jobs)), shard_unit.init_worker, init)
      done = pool.imap_unordered(shard_unit.run_unit, jobs)
    try:
      for rec in done:
        records[rec['unit']] = rec
        bar.advance(task, rec['bytes'])
    finally:
      if workers != 1:
        pool.terminate()
  return records


def _write_index(out: str, index: dict) -> None:
  """Writes the index into `out` atomically (a temporary file, then renamed)."""
  tmp = os.path.join(out, shards.INDEX + '.tmp')
  with open(tmp, 'w') as f:
    json.dump(index, f, indent=1)
  os.replace(tmp, os.path.join(out, shards.INDEX))
