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

Work units: consecutive documents of about `shard_bytes` of text; unit i writes train-i.bin and
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
from typing import Any

import numpy as np

from jax3d.data import (
  arrow_tables,
  chat,
  documents,
  hf_datasets,
  inputs,
  shards,
  staging,
  tokenizer as tok_lib,
)
from jax3d.data.reading import JSONL_SUFFIXES, Piece, input_files, locate, pieces, read_documents, units
from jax3d.errors import ConfigError

VERSION = 2  # 2: document starts (and chat weights) beside each shard
CHUNK_CHARS = 4 << 20  # text encoded at a time within a unit


# --- the work units, in worker processes ---------------------------------------------------------
_TOK: dict = {}


def _init_worker(tok_path: str, fmt: str = 'text', pool: bool = True) -> None:
  if pool:
    os.environ['RAYON_NUM_THREADS'] = '1'  # one core per worker process (tokenizers' own threads)
  _TOK['tok'] = tok_lib.load(tok_path)
  _TOK['chat'] = chat.load_template(os.path.dirname(_TOK['tok'].path)) if fmt == 'chat' else None


def _write(file: str, arr: np.ndarray) -> None:
  tmp = file + '.tmp'
  arr.tofile(tmp)
  os.replace(tmp, file)


def run_unit(job: tuple) -> dict:
  """Tokenizes one unit into its train and val shards (with their document starts, and weights
  for chat); returns its record."""
  i, unit, out, settings, fingerprint = job
  field, fraction, dtype, fmt = (settings[k] for k in ('field', 'eval_fraction', 'dtype', 'format'))
  split, bad, bad_rows = {'train': [], 'val': []}, {}, {}
  encoded: dict = {'train': ([], []), 'val': ([], [])}  # (ids, weights) arrays of each document
  try:
    chars = 0
    for p in unit:
      for name, doc in read_documents(p, field, fmt, bad, settings['on_bad'], bad_rows):
        split['val' if documents.held_out(name, fraction) else 'train'].append((name, doc))
        chars += len(doc) if isinstance(doc, str) else 1000
        if chars > CHUNK_CHARS:  # encoded a batch at a time: memory follows the batch, not the unit
          _encode_into(encoded, split, fmt, dtype, unit[0].origin)
          chars = 0
    _encode_into(encoded, split, fmt, dtype, unit[0].origin)
  except ValueError as e:
    raise ValueError(locate(str(e), unit)) from None
  rec = {
    'unit': i,
    'fingerprint': fingerprint,
    'bytes': sum(p.size for p in unit),
    'undecodable': bad,
    'bad_rows': bad_rows,
  }
  for key, (ids, weights) in encoded.items():
    arr = np.concatenate(ids) if ids else np.zeros(0, dtype)
    name = f'{key}-{i:05d}'
    _write(os.path.join(out, f'{name}.bin'), arr)
    starts = np.concatenate([[0], np.cumsum([len(d) for d in ids])[:-1]]) if ids else np.zeros(0)
    _write(os.path.join(out, f'{name}.starts.bin'), starts.astype('<i8'))
    rec[key] = {
      'file': f'{name}.bin',
      'tokens': int(arr.size),
      'documents': len(ids),
      'starts': f'{name}.starts.bin',
      'max_id': int(arr.max()) if arr.size else -1,
    }
    if fmt == 'chat':
      w = np.concatenate(weights) if weights else np.zeros(0, np.uint8)
      _write(os.path.join(out, f'{name}.weights.bin'), w)
      rec[key] |= {'weights': f'{name}.weights.bin', 'supervised': int(w.sum())}
  with open(os.path.join(out, f'unit-{i:05d}.json'), 'w') as f:
    json.dump(rec, f)
  return rec


def _encode_into(encoded: dict, split: dict, fmt: str, dtype: str, origin: str) -> None:
  """Encodes the documents waiting in `split` into `encoded` ({key: (ids, weights)}, arrays of
  `dtype` and uint8), and empties it. ConfigError for an id past the tokenizer's vocabulary."""
  for key, docs in split.items():
    ids, weights = _encode(docs, fmt)
    if (top := max((max(d) for d in ids if d), default=-1)) >= (vocab := _TOK['tok'].vocab_size):
      why = '(a tokenizer.json whose added tokens are not counted?)'
      raise ConfigError(
        f'{origin}: the tokenizer gave token id {top}, past its own vocabulary of {vocab} {why}'
      )
    encoded[key][0].extend(np.asarray(d, dtype) for d in ids)
    encoded[key][1].extend(weights or [])
    docs.clear()


def _encode(docs: list[tuple[str, Any]], fmt: str) -> tuple[list[list[int]], list[np.ndarray] | None]:
  """(ids of each document, the chat weights of each or None): text with BOS/EOS around it; chat
  rendered with the folder's template (chat.encode; `name` says where a bad one is)."""
  tok = _TOK['tok']
  if fmt == 'chat':
    encoded = chat.encode(_TOK['chat'], tok, docs)
    return [ids for ids, _ in encoded], [w for _, w in encoded]
  bos = [tok.bos_id] if tok.bos_id is not None else []
  eos = [tok.eos_id] if tok.eos_id is not None else []
  texts = [text for _, text in docs]
  return [bos + d + eos for d in (tok.encode_batch(texts) if texts else [])], None


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
  size = lambda name: os.path.getsize(p) if name and os.path.exists(p := os.path.join(out, name)) else None
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
  """Tokenizes the corpus at `path` into `out` (the module docstring; `fmt` 'text' or 'chat',
  `split` and `on_bad` as jax3d.prepare's flags); returns the index with the run's figures added
  ('seconds', 'mb_per_s', 'workers', 'units_done', 'units_skipped', 'bytes', 'undecodable',
  'bad_rows'). A complete dataset at `out` is replaced only once the new one is complete
  (jax3d/data/staging.py). ConfigError for input that holds no document."""
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
  """`tokenize` into the folder `new` (OUT, or OUT.partial beside a complete one); `read`: (split, on_bad)."""
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
    if rec is None and new != os.path.abspath(out) and (rec := _done(out, i, fp, itemsize)):
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
      _init_worker(*init, pool=False)
      done = map(run_unit, jobs)
    else:
      pool = ctx.Pool(min(workers, len(jobs)), _init_worker, init)
      done = pool.imap_unordered(run_unit, jobs)
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
