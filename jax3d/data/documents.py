"""The documents of a text corpus: which files, in which order, and which are held out.

Shared by the trainer's text corpora (jax3d/data/corpus.py) and `jax3d.prepare`
(jax3d/data/shard_writer.py), so both split a corpus the same way. Imports no jax.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator

TEXT_SUFFIXES = ('.py', '.txt', '.md', '.rst', '.c', '.h', '.json', '.toml', '.cfg', '.ini', '.html')


def held_out(rel_path: str, fraction: float) -> bool:
  """Whether the document named `rel_path` is held out (a hash of the name, so a rerun, another
  process or jax3d.prepare decides the same)."""
  h = int.from_bytes(hashlib.sha1(rel_path.encode()).digest()[:4], 'little')
  return h / 2**32 < fraction


def iter_files(root: str, suffixes: tuple[str, ...] = TEXT_SUFFIXES) -> Iterator[str]:
  """The files under `root` with these suffixes, in a fixed (sorted) order; site-packages,
  __pycache__ and hidden folders are skipped. Stopping the iteration ends the walk."""
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(
      d for d in dirnames if d not in ('site-packages', '__pycache__') and not d.startswith('.')
    )
    yield from (os.path.join(dirpath, n) for n in sorted(filenames) if n.endswith(suffixes))
