"""One work unit of jax3d/data/shard_writer.py, in a worker process: its documents read
(jax3d/data/reading.py), each held out or not (jax3d/data/documents.py), tokenized a batch of
CHUNK_CHARS at a time (text with BOS/EOS around it, chat rendered with the tokenizer folder's
template: jax3d/data/chat.py) and written as the unit's train and val shards with their document
starts (and chat weights), then its record, unit-i.json. Imports no jax.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from jax3d.data import chat, documents, tokenizer as tok_lib
from jax3d.data.reading import locate, read_documents
from jax3d.errors import ConfigError

CHUNK_CHARS = 4 << 20  # text encoded at a time within a unit

_TOK: dict = {}


def init_worker(tok_path: str, fmt: str = 'text', pool: bool = True) -> None:
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
    top = max((max(d) for d in ids if d), default=-1)
    if top >= _TOK['tok'].vocab_size:
      raise ConfigError(
        f'{origin}: the tokenizer gave token id {top}, past its own vocabulary of '
        f'{_TOK["tok"].vocab_size} (a tokenizer.json whose added tokens are not counted?)'
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
