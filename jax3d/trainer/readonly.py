"""Reading a run's checkpoints without writing: an Orbax CheckpointManager that never cleans up (a
save that a run on the same workdir has in flight stays safe), without its read-only warnings; and
whether an error raised reading a step means that its files are damaged (`skip_damaged`)."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
from collections.abc import Callable

import orbax.checkpoint as ocp

from jax3d.errors import CheckpointError


class _QuietReadOnly(logging.Filter):
  """A read-only CheckpointManager (sampling, exporting, a warm start) logs three warnings that it
  is read-only, each time one is made: what was asked for, not news. This drops those only."""

  def filter(self, record: logging.LogRecord) -> bool:
    msg = str(record.msg)
    return not (msg.startswith('Given directory is read only') or 'read_only=True, setting' in msg)


_QUIET = _QuietReadOnly()


def manager(directory: str) -> ocp.CheckpointManager:
  """A CheckpointManager that only reads `directory` (items 'state' and 'meta')."""
  logging.getLogger('absl').addFilter(_QUIET)  # once: a Filter is added to a logger at most once
  options = ocp.CheckpointManagerOptions(read_only=True)
  return ocp.CheckpointManager(directory, item_names=('state', 'meta'), options=options)


# Tensorstore's statuses for a file that is missing, short or unparsable ('OUT_OF_RANGE: Error
# reading "params.embed.embedding/7.0" in OCDBT database at local file ...' for a truncated one).
_TENSORSTORE_READ = re.compile(
  r'\b(NOT_FOUND|DATA_LOSS|OUT_OF_RANGE|FAILED_PRECONDITION|INVALID_ARGUMENT): '
  r'Error (reading|opening|decoding)'
)


def _read_error(e: BaseException) -> str | None:
  """What in e's chain says that files do not read (see skip_damaged), as 'Type: first line'."""
  seen, x = set(), e
  while x is not None and id(x) not in seen:
    seen.add(id(x))
    text = str(x)
    if (
      isinstance(x, (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError, EOFError))
      or (isinstance(x, OSError) and x.errno in (errno.EIO, errno.EISDIR, errno.ENOTDIR))
      or (isinstance(x, KeyError) and 'not found in the checkpoint' in text)
      or _TENSORSTORE_READ.search(text)
    ):
      return f'{type(x).__name__}: {(text.splitlines() or [""])[0][:200]}'
    x = x.__cause__ or x.__context__
  return None


def skip_damaged(e: BaseException, step_dir: str, warn: Callable[[str], None]) -> None:
  """Warns that the checkpoint step `step_dir` is damaged, when `e` (raised reading it) says that
  its files do not read: a file missing, short or unparsable (FileNotFoundError, an I/O error, a
  JSON or UTF-8 decode error, an item Orbax does not find, a tensorstore read error, anywhere in
  e's chain; or the state's `_METADATA` gone, which Orbax reports as a pytree mismatch). Any other
  error (a relative path, a permission, the wrong devices, a bug) says nothing about the files:
  CheckpointError with that error, and the step is not called damaged."""
  why = _read_error(e)
  state = os.path.join(step_dir, 'state')
  if why is None and os.path.isdir(state) and not os.path.exists(os.path.join(state, '_METADATA')):
    why = 'state/_METADATA is missing'
  if why is None:
    first = (str(e).splitlines() or [''])[0][:300]
    raise CheckpointError(f'could not read checkpoint {step_dir}: {type(e).__name__}: {first}') from e
  warn(f'checkpoint {step_dir} is damaged or incomplete ({why}); trying the previous one')
