"""Tables of a built run for people: where every parameter lives, and a fixed-width text table.

Nothing heavy is imported at module level (the API imports this module; `import jax3d` must not
start jax).
"""

from __future__ import annotations

from typing import Any


def _path(path: tuple) -> str:
  return '/'.join(str(getattr(k, 'key', getattr(k, 'idx', k))) for k in path)


def sharding_table(trainer: Any) -> list[dict]:
  """Every parameter with its global shape, logical axes, PartitionSpec and per-device shape.

  Rows are dicts: param ('layers/qkv/kernel'), shape, dtype, logical (the model's axis names),
  spec (the PartitionSpec the logical rules give on this mesh), per_device (the shard one device
  holds) and bytes_per_device. They are read from the shardings the train step is compiled with,
  so the table is what runs, not a description of it. `trainer` is a Trainer or its `setup`.
  """
  import jax
  import numpy as np

  from jax3d.model import llama

  s = getattr(trainer, 'setup', trainer)
  rows = []
  flat_shapes = jax.tree_util.tree_flatten_with_path(s.abstract_state['params'])[0]
  flat_names = jax.tree.leaves(llama.param_logical_axes(s.dims), is_leaf=lambda x: isinstance(x, tuple))
  for (path, a), names in zip(flat_shapes, flat_names, strict=True):
    sh = a.sharding
    local = tuple(sh.shard_shape(a.shape))
    rows.append(
      {
        'param': _path(path),
        'shape': tuple(a.shape),
        'dtype': str(a.dtype),
        'logical': tuple(names),
        'spec': sh.spec,
        'per_device': local,
        'bytes_per_device': int(np.prod(local)) * a.dtype.itemsize,
      }
    )
  return rows


def format_table(rows: list[dict], columns: list[str] | None = None) -> str:
  """Rows of dicts as a fixed-width text table (for `print`; no pandas needed)."""
  if not rows:
    return '(empty)'
  columns = columns or list(rows[0])
  fmt = lambda v: (
    f'{v:.4g}'
    if isinstance(v, float)
    else 'x'.join(map(str, v))
    if isinstance(v, tuple) and all(isinstance(i, int) for i in v)
    else str(v)
  )
  cells = [[fmt(r.get(c, '')) for c in columns] for r in rows]
  widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
  line = lambda vals: '  '.join(v.ljust(w) for v, w in zip(vals, widths, strict=True)).rstrip()
  return '\n'.join([line(columns), line(['-' * w for w in widths])] + [line(r) for r in cells])
