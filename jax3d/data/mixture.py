"""Weighted mixtures of corpora (`data.mixture`): several prepared folders, each step's rows drawn
from them in proportion to their weights (jax3d/data/apportion.py decides which source each row
comes from), each source read in its own epoch order (jax3d/data/epochs.py; a small source
repeats with a new permutation, a large one is read no further than the steps need). Imports no jax.

A `Mixture` stands where a `Corpus` does (`batch_at`, `epoch_at`, `eval_batches`, the prefetcher):
its `layout` holds the rows of all sources (source i's rows numbered from `offsets[i]`), its
`order` maps a step to those numbers, and its batches carry one more key, `source` (the source's
index of each row; the steps take only corpus.STEP_KEYS). The held-out batches are the mixture of
the sources' held-out rows under the first stage's weights (the same at every evaluation).

A checkpoint's metadata records the mixture and each source's cursor (`meta`); a resume with
another mixture goes on from those cursors (`resume`: the change is one log line).
"""

from __future__ import annotations

import zlib

import numpy as np

from jax3d.config import Config
from jax3d.data import apportion, corpus as corpus_lib, epochs, packing as packing_lib, shards
from jax3d.data.corpus import Corpus
from jax3d.data.tokenizer import Tokenizer
from jax3d.errors import ConfigError


def for_config(cfg: Config, tok: Tokenizer | None = None) -> Corpus | Mixture:
  """The data a run of `cfg` trains on: the mixture of data.mixture when it is set, else the corpus
  of data.path (corpus.for_config). What the trainer, `jax3d.batch` and `export --verify` read."""
  d = cfg.data
  if not d.mixture:
    if d.mixture_stages:
      raise ConfigError(
        f'data.mixture_stages={d.mixture_stages!r} needs data.mixture (the sources it weighs)'
      )
    return corpus_lib.for_config(cfg, tok)
  if d.path:
    raise ConfigError(
      f'data.path={d.path!r} and data.mixture={d.mixture!r} are both set: give one (a single source is '
      'data.path; a mixture names each of its sources)'
    )
  spec = apportion.parse(d.mixture, d.mixture_stages)
  sources = []
  for name, path in zip(spec.names, spec.paths, strict=True):
    try:
      sources.append(corpus_lib.load_corpus(path, d.eval_fraction, cfg.train.seq_len + 1, tok, d.packing))
    except ConfigError as e:
      raise ConfigError(f'data.mixture source {name!r} ({path}): {e}') from None
  made = [shards.read_index(p).get('tokenizer', {}) if shards.is_shards(p) else {} for p in spec.paths]
  _check_same_vocabulary(spec, sources, made)
  return Mixture(spec, sources)


def _check_same_vocabulary(spec: apportion.Spec, sources: list[Corpus], made: list[dict]) -> None:
  """ConfigError when two sources were tokenized differently (token shards that record other
  tokenizers, or other vocabularies)."""
  for i in range(1, len(sources)):
    a, b = spec.names[0], spec.names[i]
    if made[i].get('sha256') and made[0].get('sha256') and made[i]['sha256'] != made[0]['sha256']:
      raise ConfigError(
        f'data.mixture: sources {a!r} and {b!r} were tokenized with different tokenizers '
        f'({made[0].get("path")} and {made[i].get("path")}); a mixture needs one tokenizer'
      )
    if sources[i].vocab_size != sources[0].vocab_size:
      raise ConfigError(
        f'data.mixture: sources {a!r} (vocabulary {sources[0].vocab_size}) and {b!r} (vocabulary '
        f'{sources[i].vocab_size}) differ; a mixture needs one vocabulary (prepare them with one tokenizer)'
      )


class Mixture:
  """Sources (Corpora) mixed by `spec`. `history` is the part of the run's schedule that the
  steps from here on use: (origin step, the spec in force from it, each source's cursor there)."""

  def __init__(self, spec: apportion.Spec, sources: list[Corpus]):
    self.spec, self.sources, self.names = spec, sources, spec.names
    self.vocab_size = sources[0].vocab_size
    ids = [s.max_id for s in sources if s.max_id is not None]
    self.max_id = max(ids) if ids else None
    self.source = f'mixture {spec.text()}'
    self.origin, self.base = 0, np.zeros(len(sources), np.int64)
    self.packing = ','.join(sorted({s.packing for s in sources}))
    self._layouts: dict = {}
    self._orders: dict = {}

  @property
  def evaluable(self) -> bool:
    """Whether every source has held-out data (the held-out batches draw on all of them)."""
    return all(s.evaluable for s in self.sources)

  def describe(self) -> str:
    """One line per source: its name, weight now and what it holds."""
    w = self.spec.stages[0][1]
    return '; '.join(
      f'{n} ({w[i]:.3g}) {s.describe()}'
      for i, (n, s) in enumerate(zip(self.names, self.sources, strict=True))
    )

  def layout(self, seq_len: int, split: str = 'train') -> MixLayout:
    """The rows of all sources of a split (each source's own packing)."""
    key = (seq_len, split)
    if key not in self._layouts:
      self._layouts[key] = MixLayout([s.layout(seq_len, split) for s in self.sources], self.names)
    return self._layouts[key]

  def order(self, seed: int, seq_len: int, split: str = 'train') -> MixOrder:
    """Which rows of `layout` make each step's batch: the schedule's sources, each source's rows
    in its own epoch order (seeded by `seed` and its name)."""
    key = (seed, seq_len, split, self.origin, tuple(self.base))
    if key not in self._orders:
      lay = self.layout(seq_len, split)
      orders = [
        epochs.Order(lay.layouts[i].n_rows, seed * 2**32 + zlib.crc32(n.encode()))
        for i, n in enumerate(self.names)
      ]
      if split == 'train':
        self._orders[key] = MixOrder(self.spec, orders, lay.offsets, self.origin, self.base)
      else:  # held out: the first stage's weights, from step 0
        first = apportion.Spec(self.spec.names, self.spec.paths, self.spec.stages[:1])
        self._orders[key] = MixOrder(first, orders, lay.offsets, 0, None)
    return self._orders[key]

  def per_source(self, seed: int, step: int, batch: int, seq_len: int) -> dict[str, int]:
    """What a metric record of step `step` (the steps before it done) says of each source: tokens/NAME
    (row slots drawn from it so far) and epoch/NAME (the epoch its last drawn row belongs to)."""
    order = self.order(seed, seq_len)
    drawn = order.cursors(step, batch)
    out = {f'tokens/{n}': int(drawn[i]) * seq_len for i, n in enumerate(self.names)}
    return out | {
      f'epoch/{n}': int(max(drawn[i] - 1, 0) // order.orders[i].n_rows) for i, n in enumerate(self.names)
    }

  def meta(self, seed: int, step: int, batch: int, seq_len: int) -> dict:
    """What a checkpoint of step `step` records of the mixture: its spec, the origin and cursors of
    the schedule in force, and each source's cursor at `step`."""
    drawn = self.order(seed, seq_len).cursors(step, batch)
    return {
      'spec': self.spec.text(),
      'origin': self.origin,
      'base': dict(zip(self.names, self.base.tolist(), strict=True)),
      'cursors': dict(zip(self.names, drawn.tolist(), strict=True)),
    }

  def resume(self, saved: dict | None, step: int) -> str | None:
    """Goes on from a checkpoint of step `step` whose metadata's mixture is `saved` (None: the run
    read data.path): the same mixture keeps its schedule; another one (or none before) starts a new
    schedule at `step` from the saved cursors (by name; a new source from 0). Returns the line
    that says what changed, None when nothing did."""
    if saved and saved.get('spec') == self.spec.text():
      self.origin = int(saved['origin'])
      self.base = np.array([saved['base'].get(n, 0) for n in self.names], np.int64)
      return None
    if not step:
      return None
    cursors = (saved or {}).get('cursors', {})
    self.origin, self.base = step, np.array([cursors.get(n, 0) for n in self.names], np.int64)
    old = f'data.mixture {saved["spec"]}' if saved else 'one source (data.path)'
    return f'data.mixture changed on resume at step {step}: was {old}, now {self.spec.text()} (each source goes on from its cursor: {dict(zip(self.names, self.base.tolist(), strict=True))})'


class MixLayout:
  """The rows of several sources' layouts as one numbering: source i's row r is offsets[i] + r."""

  def __init__(self, layouts: list[packing_lib.Layout], names: tuple[str, ...]):
    self.layouts, self.names = layouts, names
    self.offsets = np.concatenate([[0], np.cumsum([lay.n_rows for lay in layouts])]).astype(np.int64)
    self.n_rows = int(self.offsets[-1])
    self.seq_len = layouts[0].seq_len

  def rows(self, ids: np.ndarray) -> dict[str, np.ndarray]:
    """The rows `ids` as [len(ids), seq_len] arrays (packing.KEYS) and `source` [len(ids)]: each
    row's source index."""
    ids = np.asarray(ids, np.int64)
    src = np.searchsorted(self.offsets, ids, side='right') - 1
    out = packing_lib.empty_rows(len(ids), self.seq_len)
    for i in np.unique(src):
      at = src == i
      part = self.layouts[i].rows(ids[at] - self.offsets[i])
      for k in packing_lib.KEYS:
        out[k][at] = part[k]
    return out | {'source': src.astype(np.int32)}

  def describe(self) -> str:
    return '; '.join(f'{n}: {lay.describe()}' for n, lay in zip(self.names, self.layouts, strict=True))


class MixOrder:
  """The rows (in MixLayout's numbering) of each step's batch: the schedule's source of each row,
  and that source's row at its cursor in its own epoch order."""

  def __init__(
    self,
    spec: apportion.Spec,
    orders: list[epochs.Order],
    offsets: np.ndarray,
    origin: int,
    base: np.ndarray | None,
  ):
    self.spec, self.orders, self.offsets, self.origin, self.base = spec, orders, offsets, origin, base
    self._apportionments: dict[int, apportion.Apportionment] = {}

  def apportionment(self, batch: int) -> apportion.Apportionment:
    if batch not in self._apportionments:
      self._apportionments[batch] = apportion.Apportionment(self.spec, batch, self.origin, self.base)
    return self._apportionments[batch]

  def draws(self, step: int, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """(source, cursor) of each row of step `step`."""
    if step < self.origin:
      raise ConfigError(
        f'step {step} is before step {self.origin}, where this run changed data.mixture: '
        'its rows came from the mixture of then'
      )
    return self.apportionment(batch).draws(step)

  def rows(self, step: int, batch: int, which: slice | np.ndarray = slice(None)) -> np.ndarray:
    """The row ids of batch rows `which` (default all `batch`) of step `step`."""
    src, k = (a[which] for a in self.draws(step, batch))
    out = np.empty(src.shape, np.int64)
    for i in np.unique(src):
      at = src == i
      out[at] = self.offsets[i] + self.orders[i].at(k[at])
    return out

  def cursors(self, step: int, batch: int) -> np.ndarray:
    """The rows each source gave the steps before `step`."""
    return self.apportionment(batch).cursors(max(step, self.origin))

  def epoch(self, step: int, batch: int) -> int:
    """The largest epoch among the sources' rows of step `step` (the most repeated source's)."""
    src, k = self.draws(step, batch)
    return max(int(k[src == i].max()) // self.orders[i].n_rows for i in np.unique(src))


def parts(corpus: Corpus | Mixture) -> list[Corpus]:
  """The corpora a run reads: a mixture's sources, or the corpus itself."""
  return corpus.sources if isinstance(corpus, Mixture) else [corpus]


def resume(corpus: Corpus | Mixture, saved: dict | None, step: int) -> str | None:
  """`Mixture.resume` for a run resumed at `step` whose checkpoint recorded the mixture `saved`
  (None: it read one source); for a run of one source, the line saying a mixture was left."""
  if isinstance(corpus, Mixture):
    return corpus.resume(saved, step)
  if saved:
    return f'data.mixture changed on resume at step {step}: was data.mixture {saved["spec"]}, now one source ({corpus.source})'
  return None


def eval_batches(
  corpus: Corpus | Mixture, seed: int, n: int, batch: int, seq_len: int
) -> list[tuple[str | None, dict[str, np.ndarray]]]:
  """The fixed held-out batches, each with its source's name (None for one corpus): a corpus's
  `corpus.eval_batches`; a mixture's n batches shared among its sources by the first stage's
  weights (largest remainder, at least one each), each source's batches its own held-out rows'
  (`corpus.eval_batches` of the source), so that the evaluation gives each source's loss too."""
  if not isinstance(corpus, Mixture):
    return [(None, b) for b in corpus_lib.eval_batches(corpus, seed, n, batch, seq_len)]
  share = np.asarray(corpus.spec.stages[0][1]) * n
  counts = np.floor(share).astype(int)
  counts[np.argsort(-np.round(share - counts, 9), kind='stable')[: n - counts.sum()]] += (
    1  # ties: listed first
  )
  out = []
  for name, src, c in zip(corpus.names, corpus.sources, np.maximum(counts, 1), strict=True):
    out += [(name, b) for b in corpus_lib.eval_batches(src, seed, int(c), batch, seq_len)]
  return out
