"""One run per workdir: an exclusive `fcntl.flock` on WORKDIR/.lock, held by process 0 for the run's
life (see WorkdirLock)."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable

from jax3d.trainer.checkpoint import CheckpointError


class WorkdirLock:
  """An exclusive lock on WORKDIR/.lock (fcntl.flock) held for a run's life, so that two runs never
  write the same checkpoints; the file names the holder (host and pid). The kernel releases it
  when the process ends, however it ends. A second Trainer on the same workdir in the same process
  (one not closed) goes on with a warning: the lock guards against other processes."""

  def __init__(self, workdir: str, warn: Callable[[str], None] = print):
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(os.path.abspath(workdir), '.lock')
    self.file = open(self.path, 'a+')
    try:
      fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      self.file.seek(0)
      holder = self.file.read().strip() or 'unknown'
      self.file.close()
      self.file = None
      if holder.endswith(f' pid {os.getpid()}'):
        warn(f'workdir {os.path.dirname(self.path)} is already in use by this process (a Trainer not closed)')
        return
      raise CheckpointError(
        f'workdir {os.path.dirname(self.path)} is in use by another run ({holder}, lock {self.path}); '
        'stop it or choose another --workdir'
      ) from e
    self.file.seek(0)
    self.file.truncate()
    self.file.write(f'host {os.uname().nodename} pid {os.getpid()}\n')
    self.file.flush()

  def release(self) -> None:
    """Releases the lock (idempotent)."""
    if self.file is not None:
      fcntl.flock(self.file, fcntl.LOCK_UN)
      self.file.close()
      self.file = None
