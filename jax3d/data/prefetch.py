"""The prefetch thread: the batches of the coming steps, built while a step runs.

Each process builds only its own rows of each batch (`global_batch.process_rows` of the batch
sharding), with `corpus.batch_at`, keeps the keys the train step takes (`corpus.step_batch`:
corpus.STEP_KEYS) and assembles the global arrays (`global_batch.to_global`).
"""

from __future__ import annotations

import os
import queue
import threading

import jax

from jax3d.data import corpus as corpus_lib, global_batch, mixture as mixture_lib
from jax3d.data.corpus import Corpus, DataError


class Prefetcher:
  """Builds the batches of steps start, start+1, ... on a thread, `depth` ahead of the step. An
  exception on the thread is handed to the caller: `next` raises DataError from it.

  A memory-mapped token file is checked (fstat of the mapped inode) before each batch: reading a
  mapped page past a truncated file's end would kill the process with SIGBUS, so a file shorter
  than at the start is a DataError. A deleted file is not an error: the mapping keeps its data
  readable until the run ends."""

  def __init__(
    self,
    corpus: Corpus | mixture_lib.Mixture,
    seed: int,
    start: int,
    stop: int,
    batch: int,
    seq_len: int,
    sharding: jax.sharding.Sharding,
    depth: int = 2,
  ):
    self.rows = global_batch.process_rows(sharding, batch)
    self.corpus, self.args = corpus, (seed, batch, seq_len)
    corpus.order(seed, seq_len)  # the rows laid out here: a ConfigError is the caller's, before the thread
    self.sharding, self.batch = sharding, batch
    self.q: queue.Queue = queue.Queue(maxsize=max(depth, 1))
    self._stop = threading.Event()
    # The mapped files (one .bin, or every token shard), each with its size at the start.
    files = []
    for part in mixture_lib.parts(corpus):
      files += getattr(part.train, 'filenames', None) or [getattr(part.train, 'filename', None)]
      files += getattr(part.train_weights, 'filenames', [])
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

  def epoch(self, step: int) -> int:
    """The epoch (0-based) of the batch of step `step` (corpus.epoch_at)."""
    seed, batch, seq_len = self.args
    return corpus_lib.epoch_at(self.corpus, seed, step, batch, seq_len)

  def per_source(self, step: int) -> dict[str, int]:
    """A mixture's tokens/NAME and epoch/NAME once the steps before `step` are done (none for one source)."""
    if not isinstance(self.corpus, mixture_lib.Mixture):
      return {}
    seed, batch, seq_len = self.args
    return self.corpus.per_source(seed, step, batch, seq_len)

  def _run(self, start: int, stop: int) -> None:
    seed, batch, seq_len = self.args
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
        local = corpus_lib.step_batch(corpus_lib.batch_at(self.corpus, seed, i, batch, seq_len, self.rows))
        if not self._put((i, global_batch.to_global(local, self.sharding, self.batch))):
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
