"""Token shards on disk: the JSON index `jax3d.prepare` writes, and a memory-mapped view of them.

  DIR/index.json          {"format": "jax3d-token-shards", "dtype": "uint16", "vocab_size": ...,
                           "bos_id", "eos_id", "tokenizer": {...}, "train": [{"file", "tokens"}],
                           "val": [...]}
  DIR/train-00000.bin ... raw little-endian token ids (uint16, or uint32 for vocabularies > 65536)
  DIR/val-00000.bin ...   held-out documents: no document is in both

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
      size = os.path.getsize(file) if os.path.exists(file) else None
      if size != shard['tokens'] * itemsize:
        raise ConfigError(
          f'data.path={path!r}: shard {file} has {size} bytes but {index_file} says '
          f'{shard["tokens"]} {index["dtype"]} tokens ({shard["tokens"] * itemsize} bytes): '
          'the shards and the index disagree (run jax3d.prepare again)'
        )
  index['folder'] = folder
  return index


def streams(index: dict) -> tuple[TokenStream, TokenStream]:
  """(train, held out) token streams of a checked index."""
  dtype = np.dtype(index['dtype'])
  make = lambda split: TokenStream(
    [os.path.join(index['folder'], s['file']) for s in index[split]],
    dtype,
    [s['tokens'] for s in index[split]],
  )
  return make('train'), make('val')
