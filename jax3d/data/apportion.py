"""Which source each training row of a weighted mixture comes from (`data.mixture`,
`data.mixture_stages`; jax3d/data/mixture.py reads the rows). Imports no jax.

The rows of the steps form one sequence: row r of the run is slot r % batch of step r // batch.
Source i's weight at step s (its stage's weight, the weights of a stage summing to 1) gives its
cumulative target t_i(x): the rows it is owed over the first x rows of the sequence (piecewise
linear in x; sum_i t_i(x) = x). Source i's k-th row is due where t_i reaches k + 1/2, and the
sequence takes the rows in the order they fall due (ties: the source listed first). That is the
Sainte-Lague (Webster) apportionment, made continuous in time: house-monotone (no count ever goes
down as rows are added), every source's count within one row of its target (|C_i(x) - t_i(x)| < 1
for two sources, < the number of sources always), and free of state: the rows of step s come from
the due points around [s * batch, (s + 1) * batch) alone, so (seed, step) decide a batch whatever
the layout, process count or resume point. The k of a drawn row is that source's cursor: the rows
drawn from it so far, the index into its own epoch order (jax3d/data/epochs.py).

A stage change keeps the cursors: t_i is continuous, so each source goes on from where it was. A
mixture changed on resume at step R is a new `Apportionment` with origin R whose k count on from the
cursors at R (`base`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any

import numpy as np

from jax3d.errors import ConfigError

NAME = re.compile(r'^[A-Za-z0-9_.-]+$')  # a source's name (it becomes a metric key: tokens/NAME)
FORM = "NAME=WEIGHT:PATH,... (e.g. 'web=0.7:/d/web,code=0.3:/d/code')"
STAGE_FORM = "STEP:NAME=WEIGHT,...;STEP:... (e.g. '0:web=0.7,code=0.3;1000:web=0.5,code=0.5')"


@dataclasses.dataclass(frozen=True)
class Spec:
  """A mixture as configured: its sources (names, absolute paths) and its stages (first step,
  weights summing to 1 in the order of the names), the first stage at step 0."""

  names: tuple[str, ...]
  paths: tuple[str, ...]
  stages: tuple[tuple[int, tuple[float, ...]], ...]

  def text(self) -> str:
    """The mixture in one line: 'web=0.7:/d/web,code=0.3:/d/code' and its later stages."""
    first = ','.join(
      f'{n}={w:g}:{p}' for n, w, p in zip(self.names, self.stages[0][1], self.paths, strict=True)
    )
    later = ';'.join(f'{s}:' + _weights_text(self.names, w) for s, w in self.stages[1:])
    return first + (f' stages {later}' if later else '')

  def canonical(self) -> tuple[str, str]:
    """(data.mixture, data.mixture_stages) that give this Spec again: absolute paths, the weights
    normalised (what a run records in its config)."""
    first = ','.join(
      f'{n}={w!r}:{p}' for n, w, p in zip(self.names, self.stages[0][1], self.paths, strict=True)
    )
    return first, ';'.join(f'{s}:' + _weights_text(self.names, w, repr) for s, w in self.stages[1:])


def _weights_text(names: tuple[str, ...], weights: tuple[float, ...], fmt: Any = '{:g}'.format) -> str:
  return ','.join(f'{n}={fmt(w)}' for n, w in zip(names, weights, strict=True) if w > 0)


def _weight(setting: str, value: str, name: str, text: str, form: str) -> float:
  try:
    w = float(text)
  except ValueError:
    w = math.nan
  if not (math.isfinite(w) and w > 0):
    raise ConfigError(
      f'{setting}={value!r}: the weight of {name!r} is {text!r}; a weight is a number > 0 (the form is {form})'
    )
  return w


def _normalised(weights: list[float]) -> tuple[float, ...]:
  total = math.fsum(weights)
  return tuple(w / total for w in weights)


def parse(mixture: str, stages: str = '') -> Spec:
  """The Spec of data.mixture and data.mixture_stages. Relative paths are made absolute (from the
  working directory, as data.path). ConfigError naming the setting, its value and the valid form
  for any fault: a missing part, a bad name or weight, a name twice, a stage naming no source of
  data.mixture, stage steps not increasing, step 0's weights given twice or not at all."""
  m_set = 'data.mixture'
  names, paths, weights = [], [], []
  for part in [p.strip() for p in mixture.split(',')]:
    head, sep, path = part.partition(':')
    name, has_w, w_text = (x.strip() for x in head.partition('='))
    if not sep or not path.strip() or not name:
      raise ConfigError(f'{m_set}={mixture!r}: {part!r} is not NAME=WEIGHT:PATH (the form is {FORM})')
    if not NAME.match(name):
      raise ConfigError(f'{m_set}={mixture!r}: the name {name!r} may hold only letters, digits, _ . -')
    if name in names:
      raise ConfigError(f'{m_set}={mixture!r}: the name {name!r} is given twice; each source needs its own')
    names.append(name)
    paths.append(os.path.abspath(os.path.expanduser(path.strip())))
    weights.append(_weight(m_set, mixture, name, w_text, FORM) if has_w else None)
  if len({w is None for w in weights}) > 1:
    raise ConfigError(
      f'{m_set}={mixture!r}: give every source a weight, or none (then data.mixture_stages starts at 0)'
    )
  staged = _stages(stages, names)
  if weights[0] is None and (not staged or staged[0][0] != 0):
    raise ConfigError(
      f'{m_set}={mixture!r} gives no weights: give them (the form is {FORM}) or start data.mixture_stages at step 0'
    )
  if weights[0] is not None and staged and staged[0][0] == 0:
    raise ConfigError(
      f'data.mixture_stages={stages!r}: step 0 has weights in data.mixture already; start the stages after 0 '
      'or give data.mixture without weights'
    )
  first = [] if weights[0] is None else [(0, _normalised(weights))]
  return Spec(tuple(names), tuple(paths), tuple(first + staged))


def _stages(stages: str, names: list[str]) -> list[tuple[int, tuple[float, ...]]]:
  """The stages of data.mixture_stages: [(step, normalised weights in the order of `names`)]."""
  setting, out = 'data.mixture_stages', []
  for part in [p.strip() for p in stages.split(';') if p.strip()]:
    step_text, sep, body = part.partition(':')
    try:
      step = int(step_text)
    except ValueError:
      step = -1
    if not sep or step < 0 or not body.strip():
      raise ConfigError(
        f'{setting}={stages!r}: {part!r} is not STEP:NAME=WEIGHT,... (the form is {STAGE_FORM})'
      )
    if out and step <= out[-1][0]:
      raise ConfigError(f'{setting}={stages!r}: the steps must increase ({step} after {out[-1][0]})')
    w = [0.0] * len(names)
    for item in [x.strip() for x in body.split(',')]:
      name, eq, w_text = (x.strip() for x in item.partition('='))
      if name not in names:
        raise ConfigError(
          f'{setting}={stages!r}: {name!r} is no source of data.mixture (its sources: {", ".join(names)})'
        )
      if not eq or w[names.index(name)]:
        raise ConfigError(f'{setting}={stages!r}: {item!r} in step {step} (the form is {STAGE_FORM})')
      w[names.index(name)] = _weight(setting, stages, name, w_text, STAGE_FORM)
    out.append((step, _normalised(w)))
  return out


class Apportionment:
  """The sources of the rows of the steps from step `origin` on, under `spec`'s stages, for global
  batches of `batch` rows; source i's rows counted on from `base[i]` (its cursor at `origin`)."""

  def __init__(self, spec: Spec, batch: int, origin: int = 0, base: np.ndarray | None = None):
    self.batch, self.origin, self.n = batch, origin, len(spec.names)
    self.base = np.zeros(self.n, np.int64) if base is None else np.asarray(base, np.int64)
    kept = [
      (max(s, origin), w)
      for i, (s, w) in enumerate(spec.stages)
      if i + 1 == len(spec.stages) or spec.stages[i + 1][0] > origin
    ]
    self.x = np.array([(s - origin) * batch for s, _ in kept], np.float64)  # stage starts, in rows
    self.w = np.array([w for _, w in kept], np.float64)  # [stages, sources]
    self.t = np.zeros_like(self.w)  # t_i at each stage's start
    self.t[1:] = np.cumsum(self.w[:-1] * np.diff(self.x)[:, None], axis=0)

  def target(self, x: float) -> np.ndarray:
    """t_i(x): the rows each source is owed over the first x rows (from the origin)."""
    j = int(np.searchsorted(self.x, x, side='right')) - 1
    return self.t[j] + self.w[j] * (x - self.x[j])

  def due(self, i: int, k: np.ndarray) -> np.ndarray:
    """Where source i's rows k (counted from the origin) fall due: the first x with t_i(x) = k + 1/2."""
    v = k + 0.5
    j = np.searchsorted(self.t[:, i], v, side='left')  # the first stage start already past v
    seg = np.maximum(j - 1, 0)
    with np.errstate(divide='ignore'):
      x = self.x[seg] + (v - self.t[seg, i]) / self.w[seg, i]
    at_start = (j < len(self.x)) & (self.t[np.minimum(j, len(self.x) - 1), i] == v)
    return np.where(at_start, self.x[np.minimum(j, len(self.x) - 1)], np.where(self.w[seg, i] > 0, x, np.inf))

  def _around(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(each source's rows due before the window, and the sources and k of the rows due inside it
    in the order they fall due) for a window of the sequence holding rows lo..hi (from the origin)."""
    a, b = max(0, lo - self.n - 2), hi + self.n + 2
    ta, tb = self.target(a), self.target(b)
    before, src, ks, xs = np.zeros(self.n, np.int64), [], [], []
    for i in range(self.n):
      k = np.arange(max(0, math.floor(ta[i] - 0.5) - 1), math.ceil(tb[i]) + 2, dtype=np.int64)
      x = self.due(i, k)
      before[i] = k[0] + (x < a).sum()
      keep = (x >= a) & (x < b)
      src.append(np.full(int(keep.sum()), i, np.int64))
      ks.append(k[keep])
      xs.append(x[keep])
    src, ks, xs = np.concatenate(src), np.concatenate(ks), np.concatenate(xs)
    order = np.lexsort((src, xs))
    assert before.sum() <= lo and before.sum() + len(order) >= hi, (before, lo, hi, len(order))
    return before, src[order], ks[order]

  def draws(self, step: int) -> tuple[np.ndarray, np.ndarray]:
    """(source, k) of each row of step `step`'s batch: k is the source's cursor at that row."""
    lo = (step - self.origin) * self.batch
    before, src, k = self._around(lo, lo + self.batch)
    sl = slice(lo - int(before.sum()), lo - int(before.sum()) + self.batch)
    return src[sl], k[sl] + self.base[src[sl]]

  def cursors(self, step: int) -> np.ndarray:
    """The rows drawn from each source by the steps before `step` (its cursor at `step`)."""
    lo = (step - self.origin) * self.batch
    before, src, _ = self._around(lo, lo)
    return before + np.bincount(src[: lo - int(before.sum())], minlength=self.n) + self.base
