"""Pipeline parallelism: micro-batching, stage placement, and the `shard_map` around the stages' loop.

The package: chunk.py (a chunk of layers, its forward with VJP residuals and its backward: both
schedules' one), gpipe.py (the GPipe/circular loop on one stage), run_gpipe.py (its entry points
`apply`/`run`), timetable.py (the 1F1B timetable, numpy only), one_f_one_b.py (the 1F1B loop on one
stage, the head and the loss inside), run_1f1b.py (its entry points `loss`/`run_loss`), stages.py
(the `shard_map` over the stages both share, and `skips_bubbles`). This module re-exports the entry
points, each loaded on first use: importing the package (and so timetable.py) imports no jax.

The stacked layers are split into `pp` stages. `apply` takes the embedded batch [B, T, D], forms
m micro-batches, runs them through every layer pipelined over `pp`, and returns [B, T, D].
Inside `jax.shard_map(..., axis_names={'pp', 'dp'})` each device sees its own stage's layers and
its dp shard of the micro-batches; `tp` stays under the compiler's automatic sharding, so tensor
parallelism keeps working inside a stage.

Micro-batches and the batch outside the loop: jax3d/parallel/microbatch.py (`batch_axes`).

Schedule (GPipe, and circular when `repeats` v > 1). The loop runs v*m + p - 1 iterations. At
iteration t, stage s works on u = t - s: micro-batch u mod m, on its layer chunk u // m. Every
stage sends its output to stage s+1 (mod p) with one `ppermute`. What arrives at stage 0 from the
last stage goes back into the stage-0 queue (the next pass round the ring) or, on the last pass,
into the outputs. Bubble iterations (u outside [0, v*m)) write nothing, to outputs or gradients
(on CPU they skip their layers: `skips_bubbles`). The loop itself, one stage's scan over the
iterations, and its backward pass (written out under remat 'full' and 'stage'):
jax3d/parallel/pipeline/gpipe.py.

Stage placement. With v chunks per stage, chunk c = r*p + s (r = 0..v-1) runs on stage s, so the
stacked weights are stored stage-major: position j holds canonical layer `layer_order(...)[j]`,
and a plain P('pp') sharding of the layer axis gives each stage exactly its chunks.

Gradients over dp (and cp), and the loop inside a caller's shard_map: stages.py.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# What the names below resolve to, for readers, type checkers and tests/test_architecture.py.
if TYPE_CHECKING:
  from jax3d.parallel.pipeline.run_1f1b import loss as loss, run_loss as run_loss
  from jax3d.parallel.pipeline.run_gpipe import apply as apply, run as run
  from jax3d.parallel.pipeline.stages import (
    COND_FORWARDS_OPERANDS as COND_FORWARDS_OPERANDS,
    skips_bubbles as skips_bubbles,
  )
  from jax3d.parallel.pipeline.timetable import in_loop_loss as in_loop_loss

# The re-exported names and the module that holds each.
_EXPORTS = {
  'apply': 'run_gpipe',
  'run': 'run_gpipe',
  'in_loop_loss': 'timetable',
  'loss': 'run_1f1b',
  'run_loss': 'run_1f1b',
  'skips_bubbles': 'stages',
  'COND_FORWARDS_OPERANDS': 'stages',
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
  if name in _EXPORTS:
    return getattr(importlib.import_module(f'{__name__}.{_EXPORTS[name]}'), name)
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
