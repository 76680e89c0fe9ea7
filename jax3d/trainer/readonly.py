"""Reading a run's checkpoints without writing: an Orbax CheckpointManager that never cleans up (a
save that a run on the same workdir has in flight stays safe), without its read-only warnings."""

from __future__ import annotations

import logging

import orbax.checkpoint as ocp


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
