"""Corpora, tokenisation and deterministic batches.

The default corpus needs no download and was written by no one here: the Python standard
library's own source files, read from the running interpreter's installation, as bytes
(vocabulary 256). A user's text file or folder (`data.path`) is read the same way; a nanoGPT-style
token file (`.bin`, uint16) or a folder with `train.bin` and `val.bin` is used as is.

The held-out split is by file where there are files (a file is held out when a hash of its
relative path says so), otherwise the tail of the stream. The batch of step i depends only on
(seed, i): its rows are windows at offsets drawn from `default_rng([seed, i])`, so no layout,
process count or resume point can change what a step sees. Each process builds only the rows of
its own data-parallel shard; a background thread prepares the next batches while a step runs.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import sysconfig
import threading

import jax
import numpy as np

from jax3d.config import ConfigError
from jax3d.data import shards, tokenizer
from jax3d.data.documents import TEXT_SUFFIXES, held_out, iter_files
from jax3d.data.tokenizer import Tokenizer
from jax3d.errors import DataError

MAX_CORPUS_BYTES = 64 << 20


@dataclasses.dataclass
class Corpus:
  """A tokenised corpus: the training and held-out token streams, the vocabulary they need, and
  where they came from."""

  train: np.ndarray  # 1-D token stream
  held_out: np.ndarray
  vocab_size: int
  source: str

  def describe(self) -> str:
    """One line: the source, the token counts of both streams and the vocabulary size."""
    return (
      f'{self.source}: {self.train.size / 1e6:.1f}M train tokens, '
      f'{self.held_out.size / 1e6:.2f}M held out, vocab {self.vocab_size}'
    )


def _read_files(
  root: str, fraction: float, suffixes: tuple[str, ...] = TEXT_SUFFIXES
) -> tuple[list[bytes], list[bytes]]:
  """The bytes of the files under `root` with these suffixes, split by file into (train, held out)."""
  train, held, total = [], [], 0
  for path in iter_files(root, suffixes):
    try:
      with open(path, 'rb') as f:
        raw = f.read()
    except OSError:
      continue
    if not raw:
      continue
    (held if held_out(os.path.relpath(path, root), fraction) else train).append(raw)
    total += len(raw)
    if total > MAX_CORPUS_BYTES:  # the cap ends the whole walk
      break
  return train, held


def _tokens(parts: list[bytes], tok: Tokenizer | None) -> np.ndarray:
  """Documents as one stream: bytes joined by a newline, or a subword tokenizer's ids with EOS
  after each document."""
  if tok is None or tok.name == tokenizer.BYTES:
    return np.frombuffer(b'\n'.join(parts), dtype=np.uint8)
  eos = [tok.eos_id] if tok.eos_id is not None else []
  ids = tok.encode_batch([p.decode('utf-8', errors='replace') for p in parts])
  return np.asarray([t for doc in ids for t in doc + eos], dtype=shards.dtype_for(tok.vocab_size))


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
  return Corpus(train, held, index['vocab_size'], f'token shards {index["folder"]}')


def load_corpus(path: str, eval_fraction: float, min_tokens: int, tok: Tokenizer | None = None) -> Corpus:
  """Reads the corpus named by `data.path` ('' = the standard library), text tokenized with `tok`
  (default bytes). Raises ConfigError when the path does not exist or holds too little usable
  data for one sequence."""
  text_vocab = tok.vocab_size if tok is not None else 256
  if not path:
    root = sysconfig.get_paths()['stdlib']
    train, held = (_tokens(p, tok) for p in _read_files(root, eval_fraction, ('.py',)))
    corpus = Corpus(train, held, text_vocab, f'Python standard library source ({root})')
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
      cut = int(len(train) * (1 - eval_fraction))
      train, held = train[:cut], train[cut:]
    corpus = Corpus(train, held, int(max(train.max(initial=0), held.max(initial=0))) + 1, f'tokens {path}')
  elif path.endswith('.bin'):
    tokens = np.memmap(path, dtype=np.uint16, mode='r')
    cut = int(len(tokens) * (1 - eval_fraction))
    corpus = Corpus(tokens[:cut], tokens[cut:], int(tokens.max(initial=0)) + 1, f'tokens {path}')
  elif os.path.isdir(path):
    train, held = (_tokens(p, tok) for p in _read_files(path, eval_fraction))
    if held.size < min_tokens:  # too few files to split by file: hold out the tail instead
      stream = np.concatenate([train, held])
      cut = int(len(stream) * (1 - eval_fraction))
      train, held = stream[:cut], stream[cut:]
    corpus = Corpus(train, held, text_vocab, f'text files under {path}')
  else:
    with open(path, 'rb') as f:
      stream = _tokens([f.read()], tok)
    cut = int(len(stream) * (1 - eval_fraction))
    corpus = Corpus(stream[:cut], stream[cut:], text_vocab, f'text file {path}')
  for name, arr in (('training', corpus.train), ('held-out', corpus.held_out)):
    if arr.size < min_tokens:
      raise ConfigError(
        f'data.path={path!r} holds no usable {name} data: {arr.size} tokens, need at '
        f'least {min_tokens} (train.seq_len + 1)'
      )
  return corpus


def check_vocab(corpus: Corpus, vocab_size: int) -> None:
  """Raises ConfigError when the model's vocabulary is smaller than the corpus needs."""
  if corpus.vocab_size > vocab_size:
    raise ConfigError(
      f"model.vocab_size={vocab_size} is smaller than the data's vocabulary ({corpus.vocab_size}, {corpus.source})"
    )


def batch_rows(
  tokens: np.ndarray, seed: int, step: int, batch: int, seq_len: int, rows: slice | np.ndarray = slice(None)
) -> dict[str, np.ndarray]:
  """Rows `rows` of the batch of step `step`: windows of seq_len+1 tokens at (seed, step) offsets,
  as {'inputs', 'targets'} int32 arrays of [rows, seq_len] (targets shifted by one token)."""
  # Every window start 0 .. size - seq_len - 1 (a stream of exactly seq_len + 1 tokens has one).
  offsets = np.random.default_rng([seed, step]).integers(0, tokens.size - seq_len, size=batch)
  windows = np.stack([np.asarray(tokens[o : o + seq_len + 1]) for o in offsets[rows]]).astype(np.int32)
  return {'inputs': windows[:, :-1], 'targets': windows[:, 1:]}


def eval_batches(corpus: Corpus, seed: int, n: int, batch: int, seq_len: int) -> list[dict[str, np.ndarray]]:
  """The fixed held-out batches (the same for every eval of a run and every layout)."""
  return [batch_rows(corpus.held_out, seed + 1_000_003, j, batch, seq_len) for j in range(n)]


def process_rows(sharding: jax.sharding.Sharding, batch: int) -> np.ndarray:
  """Indices of the global-batch rows this process holds, in global order (its row blocks
  concatenated: what jax.make_array_from_process_local_data expects)."""
  idx = sharding.addressable_devices_indices_map((batch,))
  blocks = sorted({(s[0].start or 0, batch if s[0].stop is None else s[0].stop) for s in idx.values()})
  return np.concatenate([np.arange(a, b) for a, b in blocks])


def to_global(
  local: dict[str, np.ndarray], sharding: jax.sharding.Sharding, batch: int
) -> dict[str, jax.Array]:
  """Global arrays of `batch` rows from this process's rows (those of `process_rows`) of each entry."""
  return {
    k: jax.make_array_from_process_local_data(sharding, v, (batch,) + v.shape[1:]) for k, v in local.items()
  }


class Prefetcher:
  """Builds the batches of steps start, start+1, ... on a thread, `depth` ahead of the step. An
  exception on the thread is handed to the caller: `next` raises DataError from it.

  A memory-mapped token file is checked (fstat of the mapped inode) before each batch: reading a
  mapped page past a truncated file's end would kill the process with SIGBUS, so a file shorter
  than at the start is a DataError. A deleted file is not an error: the mapping keeps its data
  readable until the run ends."""

  def __init__(
    self,
    corpus: Corpus,
    seed: int,
    start: int,
    stop: int,
    batch: int,
    seq_len: int,
    sharding: jax.sharding.Sharding,
    depth: int = 2,
  ):
    self.rows = process_rows(sharding, batch)
    self.args = (corpus.train, seed, batch, seq_len)
    self.sharding, self.batch = sharding, batch
    self.q: queue.Queue = queue.Queue(maxsize=max(depth, 1))
    self._stop = threading.Event()
    # The mapped files (one .bin, or every token shard), each with its size at the start.
    files = getattr(corpus.train, 'filenames', None) or [getattr(corpus.train, 'filename', None)]
    self._watch: list[tuple[str, int, int]] = []
    for file in filter(None, files):
      try:  # a file deleted since it was mapped cannot be truncated: nothing to watch
        fd = os.open(file, os.O_RDONLY)
      except FileNotFoundError:
        continue
      self._watch.append((file, fd, os.fstat(fd).st_size))
    self.thread = threading.Thread(target=self._run, args=(start, stop), daemon=True)
    self.thread.start()

  def _put(self, item: tuple) -> bool:
    """Puts item on the queue unless stopped first; False when stopped."""
    while not self._stop.is_set():
      try:
        self.q.put(item, timeout=0.1)
        return True
      except queue.Full:
        continue
    return False

  def _run(self, start: int, stop: int) -> None:
    tokens, seed, batch, seq_len = self.args
    i = start
    try:
      for i in range(start, stop):
        if self._stop.is_set():
          return
        for file, fd, start_size in self._watch:
          if (size := os.fstat(fd).st_size) < start_size:
            raise DataError(
              f'data file {file} was truncated while the run reads it ({start_size} bytes at the '
              f'start, {size} now; batch of step {i + 1}): restore it and run the same command again'
            )
        local = batch_rows(tokens, seed, i, batch, seq_len, self.rows)
        if not self._put((i, to_global(local, self.sharding, self.batch))):
          return
    except BaseException as e:  # noqa: BLE001 - any failure must reach the waiting caller
      self._put((i, e))

  def next(self, expected_step: int) -> dict[str, jax.Array]:
    """The batch of step `expected_step` (waits for it). Raises DataError when the thread failed
    (or ended without it), RuntimeError if another step's batch came."""
    while True:
      try:
        i, b = self.q.get(timeout=1.0)
        break
      except queue.Empty:
        if not self.thread.is_alive() and self.q.empty():
          raise DataError(f'data pipeline ended before the batch of step {expected_step}') from None
    if isinstance(b, DataError):
      raise b
    if isinstance(b, BaseException):
      raise DataError(f'data pipeline failed building the batch of step {i}: {type(b).__name__}: {b}') from b
    if i != expected_step:
      raise RuntimeError(f'data pipeline out of order: got step {i}, expected {expected_step}')
    return b

  def close(self) -> None:
    """Stops the thread and waits for it: a daemon thread still inside jax when the interpreter
    exits can abort the process ('FATAL: exception not rethrown')."""
    self._stop.set()
    self.thread.join(timeout=30)
    for _, fd, _ in self._watch:
      os.close(fd)
    self._watch = []
