"""Where `jax3d.prepare` writes, so that a dataset is never rewritten in place.

A folder without a complete dataset (new, or an interrupted first run) is written in place: there
is nothing to lose, and a rerun resumes from its finished units. A folder with one (its index.json)
is left whole while the new dataset is written beside it, in `OUT.partial`: the units that did not
change are linked from OUT (no copy), the others tokenized, and only when the new index is
written is it swapped in (OUT -> OUT.old, OUT.partial -> OUT, OUT.old removed). A re-run that
fails, or is killed, leaves OUT as it was; its finished units stay in OUT.partial for the next run.
Files in OUT that jax3d.prepare did not write (a trained tokenizer.json among them) are linked
into the new folder, so the swap loses none of them. Imports no jax.
"""

from __future__ import annotations

import json
import os
import re
import shutil

from jax3d.data import shards
from jax3d.errors import ConfigError

PARTIAL, OLD = '.partial', '.old'
# What jax3d.prepare writes into a dataset folder (and its scratch folder of decompressed inputs).
OURS = re.compile(
  r'^((train|val)-\d{5}(\.starts|\.weights)?\.bin|unit-\d{5}\.json|index\.json)(\.tmp)?$|^\.inputs$'
)


def _clean(out: str) -> str:
  return os.path.normpath(os.path.abspath(out))


def check(inp: str, out: str) -> None:
  """ConfigError when --out cannot hold the dataset of --input: inside it (prepare would read its
  own output), holding it (the swap would replace the input), or holding an index.json that is not
  a jax3d token-shard index (the swap would replace it)."""
  o = _clean(out)
  if inp:
    i = _clean(inp)
    if o == i or o.startswith(i + os.sep):
      raise ConfigError(f'--out={out} is inside --input={inp}: prepare would read its own shards back')
    if i.startswith(o + os.sep):
      raise ConfigError(f'--input={inp} is inside --out={out}: a new dataset there replaces the folder')
  index = os.path.join(o, shards.INDEX)
  if os.path.exists(index):
    try:
      with open(index) as f:
        ours = json.load(f).get('format') == shards.FORMAT
    except (OSError, ValueError, AttributeError):
      ours = False
    if not ours:
      raise ConfigError(
        f'--out={out} holds an {shards.INDEX} that jax3d.prepare did not write: give an empty or new folder'
      )


def recover(out: str) -> None:
  """Puts back OUT.old when a swap was cut between its two renames (OUT missing)."""
  o = _clean(out)
  if not os.path.exists(o) and os.path.isdir(o + OLD):
    os.rename(o + OLD, o)


def folder(out: str) -> str:
  """The folder the new dataset is written into: OUT, or OUT.partial beside a complete one."""
  o = _clean(out)
  if not os.path.exists(os.path.join(o, shards.INDEX)):
    os.makedirs(o, exist_ok=True)
    return o
  os.makedirs(o + PARTIAL, exist_ok=True)
  return o + PARTIAL


def discard(out: str, made: bool, refused: bool) -> None:
  """After a run of prepare: OUT.partial removed when it is empty; and OUT when this run `made` it
  and it is empty, or the run was `refused` (bad input) and OUT holds only prepare's own files (its
  finished units mean nothing for an input that is refused). A folder with anything else (a trained
  tokenizer.json) stays, and so does an interrupted run's: a rerun resumes from its units."""
  o = _clean(out)
  if made and refused and os.path.isdir(o) and all(OURS.match(n) for n in os.listdir(o)):
    shutil.rmtree(o)
  for folder in [o + PARTIAL] + [o] * made:
    try:
      os.rmdir(folder)
    except OSError:  # absent, or holding something
      pass


def link(src: str, dst: str) -> None:
  """`dst` the same file as `src` (a hard link; a copy where links are not possible)."""
  if os.path.exists(dst):
    os.remove(dst)
  try:
    os.link(src, dst)
  except OSError:
    shutil.copy2(src, dst)


def swap(out: str, new: str) -> None:
  """Makes `new` the dataset at OUT: OUT's files that prepare did not write linked into it, then
  OUT -> OUT.old, new -> OUT, OUT.old removed. Nothing to do when `new` is OUT."""
  o = _clean(out)
  if new == o:
    return
  for name in os.listdir(o):
    if not OURS.match(name) and os.path.isfile(os.path.join(o, name)):
      if not os.path.exists(os.path.join(new, name)):
        link(os.path.join(o, name), os.path.join(new, name))
    elif not OURS.match(name):  # a folder of the user's: moved across whole
      os.rename(os.path.join(o, name), os.path.join(new, name))
  if os.path.exists(o + OLD):
    shutil.rmtree(o + OLD)
  os.rename(o, o + OLD)
  os.rename(new, o)
  shutil.rmtree(o + OLD)
