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


def over_ep() -> bool:
  """Whether the mesh in context has an 'ep' axis not manual yet (the experts are split over it)."""
  mesh = jax.sharding.get_abstract_mesh()
  return not mesh.empty and EP in mesh.axis_names and EP not in mesh.manual_axes


def exchange(
  experts: Callable[[jax.Array, jax.Array, jax.Array], jax.Array],
  buf_becd: jax.Array,
  gu_Ed2f: jax.Array,
  down_Efd: jax.Array,
) -> jax.Array:
  """`experts(slots, gate_up, down)` on every expert's slots: directly without an ep axis, else on
  each ep rank's own experts, the slots all-to-all'ed there and back."""
  if not over_ep():
    return experts(buf_becd, gu_Ed2f, down_Efd)

  def local(buf, gu, down):
    buf = jax.lax.all_to_all(buf, EP, 1, 0, tiled=True)  # [ep*b, E/ep, C, d]: all rows, own experts
    return jax.lax.all_to_all(experts(buf, gu, down), EP, 0, 1, tiled=True)  # own rows, all experts

  return sharding.manual_over(local, (SLOTS, *WEIGHTS), SLOTS, EP)(buf_becd, gu_Ed2f, down_Efd)
