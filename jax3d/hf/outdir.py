"""Where an export is written: never over what it did not write, never anything stale left.

`check(out, reads, overwrite)` runs before anything is read: `out` may not be, hold or lie inside
a folder or file the run reads (its workdir, the model it was imported or warm-started from, its
tokenizer, its data, a LoRA run's starting PEFT adapter; `reads`), even with --overwrite; it may
not be a file; a non-empty folder is replaced only when it is an earlier jax3d export (it holds
MARKER and only the files MARKER lists) or with --overwrite. UsageError (exit 2), one line naming --out.

`staged(out)` gives a fresh folder beside `out` (`.NAME.partial`) to write into; on success it
writes MARKER there (the files written) and renames it into place (the old `out`, if any, is
renamed to `.NAME.old` first and then removed), so `out` only ever holds a whole export and no
file of an earlier one; on failure (--verify among them) `out` is left as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from jax3d.errors import UsageError

MARKER = 'jax3d_export.json'  # the files an export wrote: a folder of only those may be replaced


def reads_of(cfg: Mapping[str, Any], workdir: str | None) -> list[tuple[str, str]]:
  """(what, path) of everything a run reads, from its config (`Config.to_dict()` or the saved JSON,
  with its checkpoint.init_from) and its workdir."""
  out = [("the run's workdir", workdir)] if workdir else []
  init, tok, data = cfg['checkpoint']['init_from'], cfg['data']['tokenizer'], cfg['data']['path']
  if init:
    hf = init.startswith('hf:')
    out.append(
      ('the model the run was imported from' if hf else 'the run it warm-started from', init[3 * hf :])
    )
  if tok and tok != 'bytes':
    out.append(("the run's tokenizer", tok))
  if cfg.get('lora', {}).get('init_from'):  # a LoRA run's starting adapter (older runs: no lora)
    out.append(('the PEFT adapter the run started from', cfg['lora']['init_from']))
  return out + ([("the run's data", data)] if data else [])


def _listed(out: str) -> set[str] | None:
  """The files MARKER in `out` lists, None when there is no readable MARKER."""
  try:
    with open(os.path.join(out, MARKER)) as f:
      files = json.load(f)['files']
    return {str(n) for n in files}
  except (OSError, ValueError, KeyError, TypeError):
    return None


def check(out: str, reads: Sequence[tuple[str, str]], overwrite: bool) -> None:
  """Refuses `out` as the module docstring says (UsageError, exit 2)."""
  real = os.path.realpath(out)
  inside = lambda a, b: a.startswith(b.rstrip(os.sep) + os.sep)  # a lies in folder b
  for what, path in reads:
    p = os.path.realpath(path)
    if p == real or inside(p, real) or inside(real, p):
      verb = 'is' if p == real else 'holds' if inside(p, real) else 'lies inside'
      raise UsageError(
        f'--out={out} {verb} {what} ({path}): an export never replaces what the run reads; '
        'choose another folder'
      )
  if os.path.exists(out) and not os.path.isdir(out):
    raise UsageError(f'--out={out} is a file: give a folder (new, empty, or an earlier jax3d export)')
  if overwrite or not os.path.isdir(out):
    return
  others = sorted(set(os.listdir(out)) - (_listed(out) or set()) - {MARKER})
  if others:
    more = f' and {len(others) - 1} more' if len(others) > 1 else ''
    raise UsageError(
      f'--out={out} is a folder that is not an earlier jax3d export (it holds {others[0]}{more}, not '
      'written by jax3d.export): give --overwrite to replace all of it, or a new or empty folder'
    )


@contextlib.contextmanager
def staged(out: str) -> Iterator[str]:
  """A fresh folder to write the export into, renamed into place as `out` when the block succeeds
  (see the module docstring); removed, `out` untouched, when it raises."""
  parent, name = os.path.split(os.path.abspath(out))
  tmp, old = os.path.join(parent, f'.{name}.partial'), os.path.join(parent, f'.{name}.old')
  os.makedirs(parent, exist_ok=True)
  shutil.rmtree(tmp, ignore_errors=True)  # a killed export's
  os.mkdir(tmp)
  try:
    yield tmp
    files = sorted(os.listdir(tmp))
    with open(os.path.join(tmp, MARKER), 'w') as f:
      json.dump({'files': files}, f, indent=2)
    shutil.rmtree(old, ignore_errors=True)
    if os.path.lexists(out):
      os.rename(out, old)
    os.rename(tmp, out)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    if os.path.lexists(old) and not os.path.lexists(out):  # the second rename failed: put it back
      os.rename(old, out)
    raise
  shutil.rmtree(old, ignore_errors=True)
