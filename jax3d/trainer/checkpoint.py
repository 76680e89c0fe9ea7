"""Checkpoints with Orbax: save, exact resume, resume onto another layout, integrity, warm start.

Layout on disk: WORKDIR/checkpoints/<step>/{state, meta}. `state` is the whole train state
(params, optimizer state with its schedule count, step); `meta` is JSON: the config, the layout
(dp, pp, tp, repeats), the data position (the next step; a batch depends only on seed and step),
the seed, and the shape and dtype of every saved array.

Orbax writes a step into a temporary directory and renames it when complete, so a write killed
with SIGKILL never becomes a step; a step past `keep` is renamed into `checkpoints/.deleted`, then
removed, so neither leaves a torn step. A step whose files fail to read (missing, truncated) is
reported with its path and the previous one is used; any other error is raised, not called damage
(readonly.skip_damaged). Shapes and dtypes are compared with the config before reading (Orbax
would cast dtypes silently). Arrays are read straight into the target shardings; when the pipeline
layer order differs (another pp or repeats), the layer axis is permuted on the devices, never
through one host.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jax3d.errors import CheckpointError, ConfigError
from jax3d.parallel import placement
from jax3d.trainer import readonly

SOFT = 'grad_residual'  # train-state entry restored when it matches, else restarted at zero
TRASH = '.deleted'  # old steps are renamed here (atomic), then removed
PyTree = Any  # nested dicts / lists of arrays (or of jax.ShapeDtypeStruct for an abstract state)


def _os_error_code(e: BaseException) -> int | None:
  """The errno of an OSError, or of one that Orbax's storage layer (tensorstore) reports as a
  ValueError ('RESOURCE_EXHAUSTED: ... No space left on device [os_error_code='28']'); else None."""
  if isinstance(e, OSError):
    return e.errno
  found = re.search(r"os_error_code='?(\d+)", str(e)) if isinstance(e, ValueError) else None
  return int(found.group(1)) if found else None


def _write_error(step: int, directory: str, e: BaseException) -> CheckpointError:
  what = 'the disk is full' if _os_error_code(e) == errno.ENOSPC else 'the write failed'
  return CheckpointError(
    f'could not write checkpoint step {step} to {directory}: {what} ({e}); the previous checkpoints '
    'are untouched, free space and run the same command again to resume'
  )


class _QuietWriteErrors(logging.Filter):
  """Orbax logs a failed background save with its traceback from its own thread; the same error
  reaches `Checkpointer.wait` (or the next `save`), which reports it as one line. This drops that
  log record for write errors only (anything else Orbax logs stays)."""

  def filter(self, record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    return exc is None or _os_error_code(exc) is None


_QUIET = _QuietWriteErrors()


def _path_str(path: Sequence[Any]) -> str:
  return '/'.join(str(getattr(k, 'key', getattr(k, 'idx', getattr(k, 'name', k)))) for k in path)


def array_signature(tree: PyTree) -> dict[str, list]:
  """{'params/layers/q/kernel': [[shape...], 'float32'], ...} for every array leaf."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if hasattr(leaf, 'shape'):
      out[_path_str(path)] = [list(leaf.shape), str(jnp.dtype(leaf.dtype))]
  return out


def _is_layer_path(path: Sequence[Any]) -> bool:
  return any(getattr(k, 'key', None) == 'layers' for k in path)


def permute_layers(tree: PyTree, perm: np.ndarray, shardings: PyTree) -> PyTree:
  """Reorders the stacked layer axis of every `layers` leaf (on the devices, under jit)."""
  if np.array_equal(perm, np.arange(perm.size)):
    return tree

  def fn(t: PyTree) -> PyTree:
    return jax.tree_util.tree_map_with_path(
      lambda p, a: a[perm] if _is_layer_path(p) and a.ndim and a.shape[0] == perm.size else a, t
    )

  return jax.jit(fn, out_shardings=shardings)(tree)


class Checkpointer:
  """The checkpoints of one run in `directory`: saved when asked (asynchronously if `async_save`),
  the newest `keep` kept; restoring falls back to the previous step when one is damaged."""

  def __init__(self, directory: str, keep: int, async_save: bool = True):
    if keep < 1:  # Orbax would delete every step, the ones it finds there too (checked: config rules)
      raise ConfigError(f'checkpoint.keep={keep}: must be >= 1 (the newest checkpoints kept)')
    self.directory = os.path.abspath(directory)
    opts = ocp.CheckpointManagerOptions(
      max_to_keep=keep,
      enable_async_checkpointing=async_save,
      cleanup_tmp_directories=True,
      todelete_subdir=TRASH,
    )
    self.manager = ocp.CheckpointManager(self.directory, item_names=('state', 'meta'), options=opts)
    logging.getLogger('absl').addFilter(_QUIET)  # once: a Filter is added to a logger at most once
    self._empty_trash()

  def _empty_trash(self) -> None:  # with no save in flight; never read, so safe to interrupt
    trash = os.path.join(self.directory, TRASH)
    for name in os.listdir(trash) if jax.process_index() == 0 and os.path.isdir(trash) else []:
      shutil.rmtree(os.path.join(trash, name), ignore_errors=True)

  def steps(self) -> list[int]:
    """The saved steps, oldest first."""
    return sorted(self.manager.all_steps())

  def save(self, step: int, state: PyTree, meta: dict, force: bool = False) -> bool:
    """Saves `state` and `meta` (with the array signature added) as `step`, in the background when
    the checkpointer is asynchronous; returns whether Orbax started the save (`force` saves even
    where Orbax's policy would skip the step). Raises CheckpointError, saving nothing, when the
    state holds non-finite values."""
    ok = bool(jax.device_get(_all_finite(state)))
    if not ok:
      raise CheckpointError(f'refusing to save step {step}: the state holds non-finite values')
    meta = dict(meta, arrays=array_signature(state))
    self.wait()  # the previous save's write error, if any, is reported with that save's step
    self._step = step
    try:
      return self.manager.save(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
        force=force,
      )
    except (OSError, ValueError) as e:  # e.g. ENOSPC: Orbax never renamed the temporary folder
      if _os_error_code(e) is None:
        raise
      raise _write_error(step, self.directory, e) from e

  def wait(self) -> None:
    """Waits for an asynchronous save to finish; CheckpointError if its write failed."""
    try:
      self.manager.wait_until_finished()
    except (OSError, ValueError) as e:
      if _os_error_code(e) is None:
        raise
      raise _write_error(getattr(self, '_step', -1), self.directory, e) from e
    self._empty_trash()

  def close(self) -> None:
    """Finishes pending saves and releases the manager."""
    self.wait()
    self.manager.close()

  def read_meta(self, step: int) -> dict:
    """The JSON metadata saved with `step`."""
    return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))['meta']

  def restore_latest(
    self, abstract_state: dict[str, PyTree], layout: dict, warn: Callable[[str], None] = print
  ) -> tuple[dict[str, PyTree] | None, dict | None]:
    """(state, meta) of the newest step that restores cleanly, or (None, None) if there is none.

    The int8 error-feedback residual (`grad_residual`, one per dp rank) is soft state: when the
    checkpoint has none, or one for another dp or model, or this run has none (another
    train.grad_reduce_dtype), the rest is restored and the residual starts at zero (a warning says
    so); every other mismatch is refused."""
    for step in reversed(self.steps()):
      path = os.path.join(self.directory, str(step))
      try:
        meta = self.read_meta(step)
        target = abstract_state
        try:
          check_signature(meta, abstract_state, path)
        except CheckpointError:
          if SOFT not in abstract_state and not _has(meta, SOFT):
            raise
          target = {k: v for k, v in abstract_state.items() if k != SOFT}
          check_signature(meta, target, path, exclude=SOFT + '/')
        if target is abstract_state:
          state = self.manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
          )['state']
        else:
          state = _partial_restore(self.directory, step, target)
      except CheckpointError:
        raise
      except Exception as e:  # damaged or incomplete: fall back to the previous step; else raise
        readonly.skip_damaged(e, path, warn)
        continue
      state = relayout(state, meta, layout, target)
      if target is not abstract_state and SOFT in abstract_state:
        state[SOFT] = _zeros(abstract_state[SOFT])
        why = (
          'has none'
          if not _has(meta, SOFT)
          else f'has one for dp={meta["layout"]["dp"]}'
          if meta['layout']['dp'] != layout.get('dp')
          else 'has one of other shapes'
        )
        warn(f'checkpoint {path} {why}: the int8 gradient residual (error feedback) starts at zero')
      return state, meta
    return None, None


def _zeros(abstract: PyTree) -> PyTree:
  """Zeros with the shapes, dtypes and shardings of `abstract`, made on the devices."""
  return jax.jit(
    lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract),
    out_shardings=jax.tree.map(lambda a: a.sharding, abstract),
  )()


def _partial_restore(directory: str, step: int, item: PyTree) -> PyTree:
  """The entries of `item` from a step that may hold more (through a manager of its own: this
  one's 'state' item stays bound to the standard handler it saves with)."""
  mgr = readonly.manager(directory)
  try:
    return mgr.restore(
      step,
      args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(
          item=item,
          partial_restore=True,
          restore_args=jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding), item),
        )
      ),
    )['state']
  finally:
    mgr.close()


def _has(meta: dict, key: str) -> bool:
  return any(k.startswith(key + '/') for k in meta.get('arrays', {}))


def check_signature(
  meta: dict, abstract_state: PyTree, path: str, only: str | None = None, exclude: str | None = None
) -> None:
  """Refuses a checkpoint whose array shapes or dtypes differ from the config's, listing them
  (only the entries under `only`, none under `exclude`, when given)."""
  saved, want = meta.get('arrays', {}), array_signature(abstract_state)
  if exclude:
    saved = {k: v for k, v in saved.items() if not k.startswith(exclude)}
    want = {k: v for k, v in want.items() if not k.startswith(exclude)}
  if only:
    saved = {k: v for k, v in saved.items() if k.startswith(only)}
    want = {k: v for k, v in want.items() if k.startswith(only)}
  bad = []
  for k in sorted(set(saved) | set(want)):
    if k not in saved:
      bad.append(f'{k}: missing from the checkpoint')
    elif k not in want:
      bad.append(f'{k}: in the checkpoint but not in this model')
    elif saved[k] != want[k]:
      bad.append(
        f'{k}: checkpoint {tuple(saved[k][0])} {saved[k][1]}, config {tuple(want[k][0])} {want[k][1]}'
      )
  if bad:
    # Parameters first; the optimizer state mirrors them, so it is only counted.
    first = [b for b in bad if b.startswith('params/')] or bad
    rest = len(bad) - len(first[:30])
    raise CheckpointError(
      f'checkpoint {path} does not match the config ({len(bad)} mismatched '
      f'entries): '
      + '; '.join(first[:30])
      + (f'; and {rest} more (optimizer state and others)' if rest else '')
    )


def relayout(state: PyTree, meta: dict, layout: dict, abstract_state: PyTree) -> PyTree:
  """Permutes the layer axis from the saved pipeline order into this run's order."""
  saved, n = meta['layout'], layout['n_layers']
  old = placement.layer_order(n, saved['pp'], saved['repeats'])
  new = placement.layer_order(n, layout['pp'], layout['repeats'])
  perm = np.argsort(old)[new]  # new position j <- saved position holding canonical new[j]
  shardings = jax.tree.map(lambda a: a.sharding, abstract_state)
  return permute_layers(state, perm, shardings)


def load_params(
  directory: str, abstract_params: PyTree, layout: dict, source: str, warn: Callable[[str], None] = print
) -> tuple[PyTree, int]:
  """Warm start: (parameters, step) of the newest good step in the checkpoints folder `directory`
  (absolute; `source` names it in messages), checked against this config, in this run's layer order."""
  if not os.path.isdir(directory):
    raise CheckpointError(f'{source}: no checkpoints folder at {directory}')
  mgr = readonly.manager(directory)
  try:
    for step in sorted(mgr.all_steps(), reverse=True):
      step_dir = os.path.join(directory, str(step))
      try:
        meta = mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))['meta']
        check_signature(meta, {'params': abstract_params}, step_dir, only='params/')
        restored = _partial_restore(directory, step, {'params': abstract_params})
      except CheckpointError:
        raise
      except Exception as e:  # damaged or incomplete: fall back to the previous step; else raise
        readonly.skip_damaged(e, step_dir, warn)
        continue
      return relayout(restored, meta, layout, {'params': abstract_params})['params'], step
  finally:
    mgr.close()
  raise CheckpointError(f'{source}: no usable checkpoint in {directory}')


@jax.jit
def _all_finite(tree: PyTree) -> jax.Array:
  leaves = [
    jnp.all(jnp.isfinite(x))
    for x in jax.tree.leaves(tree)
    if hasattr(x, 'dtype') and jnp.issubdtype(x.dtype, jnp.floating)
  ]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)
