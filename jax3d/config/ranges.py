"""What a setting may be: one `Range` per config key, declared beside its default in keys.py, and
one per command-line flag, declared in its `cli.Flag`. Both are checked before anything compiles,
and the error names the setting, its value and the range's words (`Range.words`).

A range is a test of a value that already has the setting's type, and the words that say what is
valid. `{kind}` in the words becomes the type's name ('an integer', 'a number', 'a string'), so
one range serves an int and a float key: `at_least(0)` reads 'an integer >= 0' or 'a number >= 0'.
Numbers must be finite (nan and inf are outside every numeric range).

Declaring config keys (keys.py): `KEY: TYPE = key(DEFAULT, RANGE)  # what it means`, a field of
its section's frozen dataclass; the line's comment is the key's documentation
(scripts/config_docs.py).
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
from collections.abc import Callable
from typing import Any

KINDS = {bool: 'true or false', int: 'an integer', float: 'a number', str: 'a string'}


@dataclasses.dataclass(frozen=True)
class Range:
  """A test of a setting's value (`ok`) and the words of what is valid (`{kind}`: the type's name)."""

  ok: Callable[[Any], bool]
  valid: str = '{kind}'

  def words(self, kind: type) -> str:
    """What is valid, in words, for a setting of type `kind`."""
    return self.valid.format(kind=KINDS.get(kind, kind.__name__))


def has_kind(value: Any, kind: type) -> bool:
  """Whether `value` is of the setting's type (an int is a valid float; a bool is no number)."""
  if kind is float:
    return isinstance(value, int | float) and not isinstance(value, bool)
  if kind is int:
    return isinstance(value, int) and not isinstance(value, bool)
  return isinstance(value, kind)


def _finite(v: Any) -> bool:
  return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _note(note: str) -> str:
  return f' ({note})' if note else ''


ANY = Range(lambda v: True)  # any value of the setting's type
NUMBER = Range(_finite, '{kind}, finite')


def at_least(low: float, note: str = '') -> Range:
  return Range(lambda v: _finite(v) and v >= low, f'{{kind}} >= {low}{_note(note)}')


def above(low: float, note: str = '') -> Range:
  return Range(lambda v: _finite(v) and v > low, f'{{kind}} > {low}{_note(note)}')


def between(
  low: float, high: float, *, low_open: bool = False, high_open: bool = False, note: str = ''
) -> Range:
  """low <= v <= high, either end excluded when open: 'in [0, 1)'."""
  lo, hi = '(' if low_open else '[', ')' if high_open else ']'
  ok = lambda v: _finite(v) and (v > low if low_open else v >= low) and (v < high if high_open else v <= high)
  return Range(ok, f'{{kind}} in {lo}{low}, {high}{hi}{_note(note)}')


def one_of(*values: str, fold_case: bool = False) -> Range:
  """One of these words (`fold_case`: in any case, for true | false | auto)."""
  return Range(
    lambda v: (str(v).lower() if fold_case else v) in values,
    f'one of {", ".join(v or repr(v) for v in values)}',
  )


def either(value: Any, other: Range, note: str = '') -> Range:
  """`value` itself, or what `other` allows: either(-1, at_least(1)) reads '-1 or an integer >= 1'."""
  return Range(lambda v: v == value or other.ok(v), f'{value} or {other.valid}{_note(note)}')


def text(note: str) -> Range:
  """A non-empty string."""
  return Range(lambda v: bool(str(v).strip()), f'a non-empty string{_note(note)}')


def _no_file_on_the_way(path: str) -> bool:
  """Whether `path` is a folder or could be made one: its first existing ancestor is a folder."""
  path = os.path.abspath(path)
  while not os.path.exists(path):
    path = os.path.dirname(path)
  return os.path.isdir(path)


# Paths of a command's flags: a file where a folder is written (a workdir, an --out) is refused.
FOLDER = Range(lambda v: os.path.isdir(v), 'an existing folder')
NEW_OR_FOLDER = Range(_no_file_on_the_way, 'a folder, or a path where one can be made (not a file)')


def _writable_in(folder: str) -> bool:
  """Whether this process can create a file in `folder` (tried: permissions alone say nothing to
  root, nor on a read-only mount); the unnamed file the probe makes is gone when it closes."""
  try:
    with tempfile.TemporaryFile(dir=folder):
      return True
  except OSError:
    return False


def _new_file(v: str) -> bool:
  folder = os.path.dirname(os.path.abspath(v))
  return v == '' or (not os.path.isdir(v) and os.path.isdir(folder) and _writable_in(folder))


# a file a command writes: '' (none), or a path in an existing folder this process can write, not a folder
NEW_FILE = Range(_new_file, 'a file path in an existing folder that can be written')


def existing(what: str, prefix: str = '') -> Range:
  """A path key: '' (unset), or a file or folder that exists, after `prefix` where it has one
  (checkpoint.init_from's 'hf:'). It fails only on a path that does not exist, and says so."""

  def ok(v: Any) -> bool:
    return v == '' or os.path.exists(v.removeprefix(prefix) if prefix else v)

  return Range(ok, f"'' or an existing {what} (a path that does not exist is refused)")


POSITIVE = at_least(1)  # sizes and counts
NON_NEGATIVE = at_least(0)
FRACTION = between(0, 1)
SEED = Range(lambda v: 0 <= v < 2**63, '{kind} in [0, 2**63)')  # numpy's and jax's seeds
