"""Where a run's checkpoints are (`checkpoint_dir`), in plain Python: the workdir commands
(workdir.py) and the train state (state.py: a warm start, LoRA's base) read every workdir through it."""

from __future__ import annotations

import os
import shutil


def checkpoint_dir(workdir: str) -> str:
  """WORKDIR/checkpoints, or WORKDIR itself when it is the checkpoints folder, as an absolute path
  (Orbax reads only absolute ones): every read of a workdir goes through here."""
  workdir = os.path.abspath(workdir)
  return workdir if os.path.basename(workdir) == 'checkpoints' else os.path.join(workdir, 'checkpoints')


def discard_unused(workdir: str) -> bool:
  """Removes `workdir` when it holds nothing of a run (a refused one made it): no file but its
  .lock and empty ones (an empty metrics.jsonl, an empty checkpoints folder). Returns whether it did."""
  for root, _, names in os.walk(workdir):
    for name in names:
      path = os.path.join(root, name)
      if not (path == os.path.join(workdir, '.lock') or os.path.isfile(path) and os.path.getsize(path) == 0):
        return False
  shutil.rmtree(workdir, ignore_errors=True)
  return True
