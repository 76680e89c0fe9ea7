"""Where a run's checkpoints are (`checkpoint_dir`), in plain Python: the workdir commands
(workdir.py) and the train state (state.py: a warm start, LoRA's base) read every workdir through it."""

from __future__ import annotations

import os


def checkpoint_dir(workdir: str) -> str:
  """WORKDIR/checkpoints, or WORKDIR itself when it is the checkpoints folder, as an absolute path
  (Orbax reads only absolute ones): every read of a workdir goes through here."""
  workdir = os.path.abspath(workdir)
  return workdir if os.path.basename(workdir) == 'checkpoints' else os.path.join(workdir, 'checkpoints')
