"""Every error jax3d raises on purpose, and the exit status each one means for every command.

  2  bad input, found before anything compiles: ConfigError, UsageError, NoCheckpoint
  3  the run failed: TrainingError, DataError, CheckpointError, DistributedError

Each message is one line that names the setting (or file), its value and what would be valid.
The commands print it as `error: MESSAGE` on stderr and exit with `exit_status(e)`: they catch
these errors in one place (`jax3d.cli.run_command`; jax3d.train, which runs on several processes,
in its own) and hand them to `jax3d.cli.fail`, that is `report` below; nothing else maps errors
to statuses.
"""

from __future__ import annotations

import sys

BAD_INPUT = 2
RUN_FAILED = 3


class Jax3dError(Exception):
  """The base of jax3d's errors; `exit_status` is what a command exits with."""

  exit_status = RUN_FAILED


class ConfigError(Jax3dError, ValueError):
  """A setting that cannot work. The message is one line: setting, value, what would be valid."""

  exit_status = BAD_INPUT


class UsageError(Jax3dError, ValueError):
  """Bad command-line input: an unknown flag, a value of the wrong type."""

  exit_status = BAD_INPUT


class NoCheckpoint(Jax3dError):
  """The workdir holds no checkpoint to sample or export from."""

  exit_status = BAD_INPUT


class DataError(Jax3dError, RuntimeError):
  """The data pipeline failed: building a batch raised on the prefetch thread (that exception is the
  cause), or the training data changed under the run (a token file truncated)."""


class CheckpointError(Jax3dError, RuntimeError):
  """A checkpoint that cannot be used (the message lists what is wrong), a failed write (disk
  full), or a workdir another run holds."""


class TrainingError(Jax3dError, RuntimeError):
  """The run cannot go on: consecutive non-finite steps, a data error during the loop."""


class DistributedError(Jax3dError, RuntimeError):
  """The processes could not be joined (an unreachable coordinator, ...)."""


def exit_status(e: BaseException) -> int:
  """The exit status of a command that stops on `e`: the error's own for jax3d's errors, 2 for
  any other ValueError (bad input caught by a library check), else 3."""
  if isinstance(e, Jax3dError):
    return e.exit_status
  return BAD_INPUT if isinstance(e, ValueError) else RUN_FAILED


def report(e: BaseException | str) -> int:
  """Prints `error: e` as one line on stderr; returns its exit status (exit_status(e); a plain
  message is bad input)."""
  print(f'error: {e}', file=sys.stderr, flush=True)
  return exit_status(e) if isinstance(e, BaseException) else BAD_INPUT
