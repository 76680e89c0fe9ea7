"""Token shards on disk: the JSON index `jax3d.prepare` writes, and a memory-mapped view of them.

  DIR/index.json          {"format": "jax3d-token-shards", "dtype": "uint16", "vocab_size": ...,
                           "bos_id", "eos_id", "tokenizer": {...}, "train": [{"file", "tokens"}],
                           "val": [...]}
  DIR/train-00000.bin ... raw little-endian token ids (uint16, or uint32 for vocabularies > 65536)
  DIR/val-00000.bin ...   held-out documents: no document is in both
  DIR/train-00000.starts.bin  where each document of the shard starts (int64 token offsets; the
                          shard's entry names it as "starts", with its "documents" count)
  DIR/train-00000.weights.bin the loss weight of each token (uint8 0/1; chat data only: the entry
                          names it as "weights"; without one every token has weight 1)

Shards written before document boundaries were recorded (no "starts") still load: their documents
end at each EOS (what jax3d.prepare wrote after every document), or, with no EOS id (the bytes
tokenizer), each shard is one document (`documents`).

`TokenStream` is the concatenation of a split's shards as one 1-D token stream, backed by one
`np.memmap` per shard: a window `stream[a:b]` reads only the pages it touches, so a run's memory
does not grow with the corpus (what data.batch_rows reads is its own rows' windows).
"""

from __future__ import annotations

import json
import mmap
import os

import numpy as np

from jax3d.config import ConfigError

INDEX = 'index.json'
FORMAT = 'jax3d-token-shards'


def dtype_for(vocab_size: int) -> str:
  """uint16 when every id fits, else uint32."""
  return 'uint16' if vocab_size <= 1 << 16 else 'uint32'


def is_shards(path: str) -> bool:
  """Whether data.path names a token-shard folder (or its index.json)."""
  return bool(path) and (
    os.path.basename(path) == INDEX or (os.path.isdir(path) and os.path.exists(os.path.join(path, INDEX)))
  )


RELEASE_ALIGN = 4 << 20  # at least the largest page-cache folio the kernel maps in one fault (2 MiB)


def _release(m: np.memmap, start: int, stop: int) -> None:
  """Unmaps the pages around bytes [start, stop) of a memory map from this process (madvise
  MADV_DONTNEED; the data stays in the page cache). Without it, each window read maps a whole
  page-cache folio (up to 2 MiB on current kernels) into the process, and the resident set grows
  with the number of distinct windows read, towards the corpus size."""
  mm = getattr(m, '_mmap', None)
  if mm is None or not hasattr(mm, 'madvise'):
    return
  a = start // RELEASE_ALIGN * RELEASE_ALIGN
  b = min(-(-stop // RELEASE_ALIGN) * RELEASE_ALIGN, len(mm))
  if b > a:
    mm.madvise(mmap.MADV_DONTNEED, a, b - a)


class TokenStream:
  """The shards of one split as one token stream (see the module docstring)."""

  def __init__(self, files: list[str], dtype: np.dtype, counts: list[int]):
    self.filenames = [f for f, n in zip(files, counts, strict=True) if n > 0]
    self.maps = [
      np.memmap(f, dtype=dtype, mode='r', shape=(n,)) for f, n in zip(files, counts, strict=True) if n
    ]
    self.starts = np.cumsum([0] + [m.size for m in self.maps])
    self.size = int(self.starts[-1])
    self.dtype = np.dtype(dtype)

  def __len__(self) -> int:
    return self.size

  def __getitem__(self, sl: slice) -> np.ndarray:
    a, b, step = sl.indices(self.size)
    if step != 1:
      raise IndexError('token streams are read in contiguous windows')
    first = int(np.searchsorted(self.starts, a, side='right')) - 1
    parts = []
    while a < b:
      m, base = self.maps[first], int(self.starts[first])
      take = min(b, base + m.size) - a
      parts.append(np.array(m[a - base : a - base + take]))  # a copy: the mapping is released next
      _release(m, (a - base) * self.dtype.itemsize, (a - base + take) * self.dtype.itemsize)
      a, first = a + take, first + 1
    return np.concatenate(parts) if len(parts) != 1 else parts[0]


def read_index(path: str) -> dict:
  """The index of a shard folder, with every shard's file checked against it (size = tokens x
  dtype bytes): ConfigError naming the file and what disagrees."""
  folder = os.path.dirname(path) if os.path.basename(path) == INDEX else path
  index_file = os.path.join(folder, INDEX)
  try:
    with open(index_file) as f:
      index = json.load(f)
  except (OSError, ValueError) as e:
    raise ConfigError(f'data.path={path!r}: {index_file} cannot be read ({e})') from None
  if index.get('format') != FORMAT or index.get('dtype') not in ('uint16', 'uint32'):
    raise ConfigError(
      f'data.path={path!r}: {index_file} is not a jax3d token-shard index (format {index.get("format")!r}, '
      f'dtype {index.get("dtype")!r}; expected {FORMAT!r} with uint16 or uint32)'
    )
  if index['vocab_size'] > 1 << 16 and index['dtype'] == 'uint16':
    raise ConfigError(
      f'data.path={path!r}: {index_file} says dtype uint16 but vocab_size {index["vocab_size"]} > 65536'
    )
  itemsize = np.dtype(index['dtype']).itemsize
  for split in ('train', 'val'):
    for shard in index[split]:
      file = os.path.join(folder, shard['file'])
      _check_size(path, file, shard['tokens'] * itemsize, f'{shard["tokens"]} {index["dtype"]} tokens')
      if shard.get('starts'):
        n_docs = shard.get('documents', 0)
        _check_size(path, os.path.join(folder, shard['starts']), n_docs * 8, f'{n_docs} document starts')
      if shard.get('weights'):
        _check_size(
          path,
          os.path.join(folder, shard['weights']),
          shard['tokens'],
          f"a weight for each of {file}'s tokens",
        )
  index['folder'] = folder
  return index


def _check_size(path: str, file: str, want: int, what: str) -> None:
  """ConfigError unless `file` has `want` bytes (what the index says it holds: `what`)."""
  size = os.path.getsize(file) if os.path.exists(file) else None
  if size != want:
    raise ConfigError(
      f'data.path={path!r}: {file} has {size} bytes but {INDEX} says {what} ({want} bytes): '
      'the shards and the index disagree (run jax3d.prepare again)'
    )


def weighted(index: dict) -> bool:
  """Whether the shards carry loss weights (chat data)."""
  return any(s.get('weights') for split in ('train', 'val') for s in index[split])


def documents(index: dict, split: str) -> tuple[np.ndarray, TokenStream | None]:
  """(starts, weights) of a checked index's split: `starts` int64 [documents + 1], document d is
  tokens starts[d]:starts[d+1] of the split's stream; `weights` the uint8 stream of per-token loss
  weights, or None (weight 1 everywhere) when no shard has one."""
  parts, offset = [], 0
  dtype = np.dtype(index['dtype'])
  for shard in index[split]:
    n = shard['tokens']
    if shard.get('starts'):
      local = np.fromfile(os.path.join(index['folder'], shard['starts']), dtype='<i8')
    elif index.get('eos_id') is not None and n:  # older shards: documents end at each EOS
      local = _eos_starts(os.path.join(index['folder'], shard['file']), dtype, n, index['eos_id'])
    else:  # no EOS to find them by: the shard is one document
      local = np.zeros(1 if n else 0, np.int64)
    parts.append(local + offset)
    offset += n
  starts = np.concatenate(parts + [np.array([offset], np.int64)])
  if not weighted(index):
    return starts, None
  files = [os.path.join(index['folder'], s['weights']) if s.get('weights') else None for s in index[split]]
  if None in files:
    missing = index[split][files.index(None)]['file']
    raise ConfigError(
      f'data.path={index["folder"]!r}: {missing} has no loss weights but other shards do: '
      'the weights and their shards disagree (run jax3d.prepare again)'
    )
  return starts, TokenStream(files, np.dtype('uint8'), [s['tokens'] for s in index[split]])


def _eos_starts(file: str, dtype: np.dtype, n: int, eos: int, chunk: int = 1 << 24) -> np.ndarray:
  """Document starts of a shard whose documents each end with `eos`: 0 and every token after an
  EOS (read in chunks, each released after the scan)."""
  m = np.memmap(file, dtype=dtype, mode='r', shape=(n,))
  ends = []
  for a in range(0, n, chunk):
    ends.append(np.flatnonzero(np.asarray(m[a : a + chunk]) == eos) + a + 1)
    _release(m, a * dtype.itemsize, min(a + chunk, n) * dtype.itemsize)
  ends = np.concatenate(ends)
  return np.concatenate([[0], ends[ends < n]]).astype(np.int64)


def max_id(index: dict) -> int:
  """The largest token id of a checked index's shards: as each shard's entry records it
  (jax3d.prepare writes "max_id"), else read from the shard (in chunks, each released after)."""
  top = -1
  dtype = np.dtype(index['dtype'])
  for shard in index['train'] + index['val']:
    n = shard['tokens']
    if 'max_id' in shard or not n:
      top = max(top, shard.get('max_id', -1))
      continue
    m = np.memmap(os.path.join(index['folder'], shard['file']), dtype=dtype, mode='r', shape=(n,))
    for a in range(0, n, 1 << 24):
      top = max(top, int(np.asarray(m[a : a + (1 << 24)]).max()))
      _release(m, a * dtype.itemsize, min(a + (1 << 24), n) * dtype.itemsize)
  return top


def streams(index: dict) -> tuple[TokenStream, TokenStream]:
  """(train, held out) token streams of a checked index."""
  dtype = np.dtype(index['dtype'])
  make = lambda split: TokenStream(
    [os.path.join(index['folder'], s['file']) for s in index[split]],
    dtype,
    [s['tokens'] for s in index[split]],
  )
  return make('train'), make('val')
