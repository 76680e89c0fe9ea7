"""Corpora, their documents, and the batch of step i.

The default corpus needs no download and was written by no one here: the Python standard
library's own source files, read from the running interpreter's installation, as bytes
(vocabulary 256). A user's text file or folder (`data.path`) is read the same way; a nanoGPT-style
token file (`.bin`, uint16) or a folder with `train.bin` and `val.bin` is used as is.

Documents: a file of a text folder (or of the standard library) is one document (its joining
newline, or its EOS, at its end); a text file or a `.bin` token file is one document (nothing
marks its documents); token shards record theirs (jax3d/data/shards.py). The held-out split is by
file where there are files (a file is held out when a hash of its relative path says so),
otherwise the tail of the stream (the document it cuts becomes two).

The batch of step i (`batch_at`) is rows of documents (`data.packing`, jax3d/data/packing.py) in
the epoch order (jax3d/data/epochs.py): it depends only on (seed, i), so no layout, process count
or resume point can change what a step sees. Each process builds only the rows of its own devices
(jax3d/data/global_batch.py `process_rows`); jax3d/data/prefetch.py prepares the next batches on a
thread while a step runs.
"""

from __future__ import annotations

import dataclasses
import os
import sysconfig
from typing import Any

import numpy as np

from jax3d.config import Config, ConfigError
from jax3d.config.values import PACKINGS
from jax3d.data import epochs, inputs, packing as packing_lib, shards, tokenizer
from jax3d.data.documents import TEXT_SUFFIXES, held_out, iter_files
from jax3d.data.tokenizer import Tokenizer
from jax3d.errors import DataError

__all__ = ['Corpus', 'DataError', 'STEP_KEYS', 'batch_at', 'epoch_at', 'load_corpus', 'step_batch']
MAX_CORPUS_BYTES = 64 << 20

# The keys of a batch that the compiled train and eval steps take (assemble's abstract batch):
# all of packing.KEYS (inputs, targets, weights, segment_ids, positions). This is the one place
# that chooses them for the steps (the prefetcher's and the held-out batches).
STEP_KEYS = packing_lib.KEYS


def step_batch(batch: dict[str, Any]) -> dict[str, Any]:
  """The entries of `batch` that the steps take (STEP_KEYS)."""
  return {k: batch[k] for k in STEP_KEYS}


@dataclasses.dataclass
class Corpus:
  """A tokenised corpus: the training and held-out token streams, the vocabulary they need, and
  where they came from."""

  train: np.ndarray  # 1-D token stream
  held_out: np.ndarray
  vocab_size: int
  source: str
  # Document starts of each stream (int64 [documents + 1]); None: the stream is one document.
  train_starts: np.ndarray | None = None
  held_starts: np.ndarray | None = None
  # Per-token loss weights (uint8 streams, chat data); None: weight 1 everywhere.
  train_weights: Any = None
  held_weights: Any = None
  packing: str = 'auto'  # data.packing; load_corpus resolves 'auto' (packing.resolve)
  max_id: int | None = None  # the largest token id of token files (None: text, tokenized here)
  _layouts: dict = dataclasses.field(default_factory=dict, repr=False)
  _orders: dict = dataclasses.field(default_factory=dict, repr=False)

  def documents(self, split: str = 'train') -> packing_lib.Documents:
    """The documents of 'train' or 'held_out'."""
    tokens = self.train if split == 'train' else self.held_out
    starts = self.train_starts if split == 'train' else self.held_starts
    weights = self.train_weights if split == 'train' else self.held_weights
    if starts is None:
      return packing_lib.Documents.whole(tokens, weights)
    return packing_lib.Documents(tokens, starts, weights)

  def layout(self, seq_len: int, split: str = 'train') -> packing_lib.Layout:
    """The rows of a split under the corpus's packing (built once per split and seq_len)."""
    key = (split, seq_len)
    if key not in self._layouts:
      how = packing_lib.resolve(self.packing, self.train_weights is not None)
      lay = packing_lib.layout(self.documents(split), seq_len, how)
      if not lay.n_rows:
        raise ConfigError(f'{self.source}: the {split} split has no document of two tokens or more')
      self._layouts[key] = lay
    return self._layouts[key]

  def order(self, seed: int, seq_len: int, split: str = 'train') -> epochs.Order:
    """The epoch order of a split's rows under `seed`."""
    key = (seed, seq_len, split)
    if key not in self._orders:
      self._orders[key] = epochs.Order(self.layout(seq_len, split).n_rows, seed)
    return self._orders[key]

  @property
  def evaluable(self) -> bool:
    """Whether there are held-out tokens to evaluate on (none: a run trains without evaluating)."""
    return self.held_out.size >= 2

  def describe(self) -> str:
    """One line: the source, the token counts of both streams and the vocabulary size."""
    return (
      f'{self.source}: {self.train.size / 1e6:.1f}M train tokens, '
      f'{self.held_out.size / 1e6:.2f}M held out, vocab {self.vocab_size}'
    )


def _read_files(
  root: str, fraction: float, suffixes: tuple[str, ...] = TEXT_SUFFIXES
) -> tuple[list[tuple[str, bytes]], list[tuple[str, bytes]]]:
  """(name, bytes) of the files under `root` with these suffixes (or those compressed), split by
  file into (train, held out)."""
  train, held, total = [], [], 0
  for path in iter_files(root, inputs.with_compressed(suffixes)):
    try:
      raw = inputs.read_bytes(path, f'data.path={root!r}: ')
    except OSError:
      continue
    if not raw:
      continue
    name = inputs.plain_name(os.path.relpath(path, root))
    (held if held_out(name, fraction) else train).append((path, raw))
    total += len(raw)
    if total > MAX_CORPUS_BYTES:  # the cap ends the whole walk
      break
  return train, held


def _tokens(files: list[tuple[str, bytes]], tok: Tokenizer | None) -> tuple[np.ndarray, np.ndarray]:
  """(stream, document starts) of (name, bytes) documents as one stream: bytes joined by a newline
  (each document's newline at its end), or a subword tokenizer's ids with EOS after each document
  (its text decoded: a file with too many bytes that are not UTF-8 is refused, inputs.py)."""
  parts = [raw for _, raw in files]
  if tok is None or tok.name == tokenizer.BYTES:
    lens = [len(p) + 1 for p in parts]
    if lens:
      lens[-1] -= 1  # no newline after the last
    stream = np.frombuffer(b'\n'.join(parts), dtype=np.uint8)
  else:
    eos = [tok.eos_id] if tok.eos_id is not None else []
    ids = tok.encode_batch([inputs.decode_checked(name, raw) for name, raw in files])
    lens = [len(doc) + len(eos) for doc in ids]
    stream = np.asarray([t for doc in ids for t in doc + eos], dtype=shards.dtype_for(tok.vocab_size))
  return stream, np.concatenate([[0], np.cumsum(lens, dtype=np.int64)]).astype(np.int64)


def _tail_split(stream: np.ndarray, starts: np.ndarray | None, fraction: float) -> tuple:
  """(train, train starts, held out, held-out starts): the tail of the stream held out (the
  document the cut falls in becomes two)."""
  n = len(stream)
  cut = int(n * (1 - fraction))
  if starts is None:
    return stream[:cut], None, stream[cut:], None
  head = np.concatenate([[0], starts[(starts > 0) & (starts < cut)], [cut]])
  tail = np.concatenate([[0], starts[(starts > cut) & (starts < n)] - cut, [n - cut]])
  return stream[:cut], head.astype(np.int64), stream[cut:], tail.astype(np.int64)


def _shard_corpus(path: str, tok: Tokenizer | None) -> Corpus:
  """Token shards written by jax3d.prepare (index checked against the files and the tokenizer)."""
  index = shards.read_index(path)
  made_with = index.get('tokenizer', {}).get('sha256')
  if tok is not None and made_with and made_with != tokenizer.fingerprint(tok):
    raise ConfigError(
      f'data.path={path!r} was tokenized with {index["tokenizer"].get("path")}, not with '
      f'data.tokenizer={tok.path or tok.name!r} (the shards record its sha256)'
    )
  train, held = shards.streams(index)
  max_id = shards.max_id(index)
  (train_starts, train_w), (held_starts, held_w) = (
    shards.documents(index, 'train'),
    shards.documents(index, 'val'),
  )
  return Corpus(
    train,
    held,
    index['vocab_size'],
    f'token shards {index["folder"]}',
    train_starts,
    held_starts,
    train_w,
    held_w,
    max_id=max_id,
  )


def for_config(cfg: Config, tok: Tokenizer | None = None) -> Corpus:
  """The corpus a run of `cfg` trains on: data.path, data.eval_fraction, data.packing, rows of
  train.seq_len + 1 tokens (what the trainer, `jax3d.batch` and `export --verify` read)."""
  d = cfg.data
  return load_corpus(d.path, d.eval_fraction, cfg.train.seq_len + 1, tok, d.packing)


def load_corpus(
  path: str, eval_fraction: float, min_tokens: int, tok: Tokenizer | None = None, packing: str = 'auto'
) -> Corpus:
  """Reads the corpus named by `data.path` ('' = the standard library), text tokenized with `tok`
  (default bytes), its rows made by `packing` (data.packing). ConfigError when the path does not
  exist or holds no document of two tokens to train on."""
  if packing not in PACKINGS:
    raise ConfigError(f'data.packing={packing!r} is invalid: one of {", ".join(PACKINGS)}')
  corpus = _load(path, eval_fraction, min_tokens, tok)
  corpus.packing = packing_lib.resolve(packing, corpus.train_weights is not None)
  return corpus


def _load(path: str, eval_fraction: float, min_tokens: int, tok: Tokenizer | None) -> Corpus:
  text_vocab = tok.vocab_size if tok is not None else 256
  if not path:
    root = sysconfig.get_paths()['stdlib']
    (train, ts), (held, hs) = (_tokens(p, tok) for p in _read_files(root, eval_fraction, ('.py',)))
    corpus = Corpus(train, held, text_vocab, f'Python standard library source ({root})', ts, hs)
  elif shards.is_shards(path):
    corpus = _shard_corpus(path, tok)
  elif not os.path.exists(path):
    raise ConfigError(
      f'data.path={path!r} does not exist (give a text file, a folder of text files, '
      'a uint16 .bin token file, or a folder with train.bin and val.bin)'
    )
  elif os.path.isdir(path) and os.path.exists(os.path.join(path, 'train.bin')):
    train = np.memmap(os.path.join(path, 'train.bin'), dtype=np.uint16, mode='r')
    val_path = os.path.join(path, 'val.bin')
    if os.path.exists(val_path):
      held = np.memmap(val_path, dtype=np.uint16, mode='r')
    else:  # no val.bin: the tail is held out and so no longer trained on
      train, _, held, _ = _tail_split(train, None, eval_fraction)
    top = int(max(train.max(initial=0), held.max(initial=0)))
    corpus = Corpus(train, held, top + 1, f'tokens {path}', max_id=top)
  elif path.endswith('.bin'):
    tokens = np.memmap(path, dtype=np.uint16, mode='r')
    train, _, held, _ = _tail_split(tokens, None, eval_fraction)
    top = int(tokens.max(initial=0))
    corpus = Corpus(train, held, top + 1, f'tokens {path}', max_id=top)
  elif os.path.isdir(path):
    (train, ts), (held, hs) = (_tokens(p, tok) for p in _read_files(path, eval_fraction))
    if held.size < min_tokens:  # too few files to split by file: hold out the tail instead
      stream = np.concatenate([train, held])
      train, ts, held, hs = _tail_split(stream, np.concatenate([ts[:-1], hs + ts[-1]]), eval_fraction)
    corpus = Corpus(train, held, text_vocab, f'text files under {path}', ts, hs)
  elif inputs.plain_name(path).endswith(inputs.JSONL_SUFFIXES):
    raise ConfigError(
      f'data.path={path!r} is JSONL: tokenize its text field first (docs/data.md: jax3d.prepare)'
    )
  else:
    stream, starts = _tokens([(path, inputs.read_bytes(path, f'data.path={path!r}: '))], tok)
    train, ts, held, hs = _tail_split(stream, starts, eval_fraction)
    corpus = Corpus(train, held, text_vocab, f'text file {path}', ts, hs)
  # Rows are padded: data shorter than a row fills one; no held-out data: no evaluation (`evaluable`).
  if corpus.train.size < 2:
    raise ConfigError(f'data.path={path!r} holds no usable training data: {corpus.train.size} tokens, need 2')
  return corpus


def check_vocab(corpus: Corpus, vocab_size: int) -> None:
  """Raises ConfigError when the model's vocabulary is smaller than the corpus needs: a token id of
  token files (the largest, named) or the tokenizer's vocabulary past model.vocab_size."""
  if corpus.max_id is not None and corpus.max_id >= vocab_size:
    raise ConfigError(
      f'model.vocab_size={vocab_size} is smaller than the data needs: {corpus.source} holds token id '
      f'{corpus.max_id} (the largest); every id must be below model.vocab_size'
    )
  if corpus.vocab_size > vocab_size:
    raise ConfigError(
      f"model.vocab_size={vocab_size} is smaller than the data's vocabulary ({corpus.vocab_size}, {corpus.source})"
    )


def batch_at(
  corpus: Corpus,
  seed: int,
  step: int,
  batch: int,
  seq_len: int,
  rows: slice | np.ndarray = slice(None),
  split: str = 'train',
) -> dict[str, np.ndarray]:
  """Rows `rows` (default all `batch`) of the batch of step `step` (0-based: the batch the model's
  step counter `step` trains on, logged as step `step + 1`): rows of the corpus's packing in the
  epoch order of `seed`, as [rows, seq_len] arrays inputs, targets, segment_ids, positions (int32)
  and weights (float32) (jax3d/data/packing.py)."""
  return corpus.layout(seq_len, split).rows(corpus.order(seed, seq_len, split).rows(step, batch, rows))


def epoch_at(corpus: Corpus, seed: int, step: int, batch: int, seq_len: int) -> int:
  """The epoch (0-based) of the training batch of step `step` (of its first row)."""
  return corpus.order(seed, seq_len).epoch(step, batch)


def eval_batches(corpus: Corpus, seed: int, n: int, batch: int, seq_len: int) -> list[dict[str, np.ndarray]]:
  """The fixed held-out batches (the same for every eval of a run and every layout): the first n
  batches of the held-out rows' epoch order, with the keys the eval step takes (STEP_KEYS)."""
  return [
    step_batch(batch_at(corpus, seed + 1_000_003, j, batch, seq_len, split='held_out')) for j in range(n)
  ]
