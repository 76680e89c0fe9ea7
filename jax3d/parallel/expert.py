"""Expert parallelism: the experts of a mixture-of-experts layer (jax3d/model/moe.py) split over
the 'ep' mesh axis (present only when mesh.ep > 1), whose devices are data parallelism outside the
layer (the rows split over dp and ep).

`exchange` runs the experts on their dispatched slots [b, E, C, d] (this device's rows, every
expert's slots) inside a shard_map manual over ep alone: one all-to-all sends each expert's slots
to the ep rank that holds it ([ep*b, E/ep, C, d]: every rank's rows, this rank's experts), the
experts run, a second all-to-all brings their outputs back. tp (and dp, pp where not manual yet)
stay as they are: the experts' hidden size stays split over tp. Bytes per layer and device, each
way: b*E*C*d*(ep-1)/ep elements (docs/formulas.md).
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from jax3d.parallel import sharding
from jax3d.parallel.sharding import EP

SLOTS = ('batch', 'expert_slots', 'capacity', 'embed')  # rows over dp and ep, every expert's slots
WEIGHTS = (('experts', 'embed', 'gate_up', 'mlp'), ('experts', 'mlp', 'embed'))  # experts over ep


def over_ep(rows: int) -> bool:
  """Whether the mesh in context has an 'ep' axis not manual yet (the experts are split over it)
  that divides `rows` (the initialisation's one-row trace, or decoding one sequence, runs the
  experts under the compiler's partitioning instead: the same numbers, the weights gathered)."""
  mesh = jax.sharding.get_abstract_mesh()
  on = not mesh.empty and EP in mesh.axis_names and EP not in mesh.manual_axes
  return on and rows % mesh.shape[EP] == 0


def exchange(
  experts: Callable[[jax.Array, jax.Array, jax.Array], jax.Array],
  experts_vjp: Callable[..., tuple[jax.Array, jax.Array, jax.Array]],
  buf_becd: jax.Array,
  gu_Ed2f: jax.Array,
  down_Efd: jax.Array,
) -> jax.Array:
  """`experts(slots, gate_up, down)` on every expert's slots: directly without an ep axis, else on
  each ep rank's own experts, the slots all-to-all'ed there and back. `experts_vjp(slots, gate_up,
  down, g)`: the gradients of its three operands (the backward region runs it: see below)."""
  if not over_ep(buf_becd.shape[0]):
    return experts(buf_becd, gu_Ed2f, down_Efd)

  there = lambda a: jax.lax.all_to_all(a, EP, 1, 0, tiled=True)  # [b, E] -> [ep*b, E/ep]: own experts
  back = lambda a: jax.lax.all_to_all(a, EP, 0, 1, tiled=True)  # [ep*b, E/ep] -> [b, E]: own rows

  def local(buf, gu, down):
    return back(experts(there(buf), gu, down))

  def local_vjp(buf, gu, down, g):  # the transpose of an all-to-all is the one back
    d_buf, d_gu, d_down = experts_vjp(there(buf), gu, down, there(g))
    return back(d_buf), d_gu, d_down

  # Forward and backward as two regions without shard_map's check (one region differentiated inside
  # the pipeline's shard_map gets residuals that name dp before ep, an order Shardy rejects:
  # sharding.device_local_vjp), with the backward written out (experts_vjp).
  region = sharding.device_local_vjp(local, (SLOTS, *WEIGHTS), SLOTS, 0, local_vjp, axes={EP})
  return region(buf_becd, gu_Ed2f, down_Efd)
