"""The one table from logical axis names (what the model speaks) to mesh axes (dp, pp, tp).

  batch      micro-batch rows inside the pipeline          -> dp
  batch_all  batch rows outside the pipeline (embed, head) -> dp and pp, so every device works
  seq, embed, head_dim, norm, qkv, gate_up                 -> replicated
  heads, kv_heads    attention heads (Megatron column/row)  -> tp
  mlp        feed-forward hidden units (column/row)         -> tp
  vocab      vocabulary-parallel embedding and head         -> tp
  layers     the stacked layer axis                         -> pp (one slab of layers per stage)
"""
from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from jax3d.config import RunPlan


def logical_rules(plan: RunPlan) -> dict[str, object]:
  # The batch outside the pipeline is split over dp*pp when each micro-batch allows it, else dp.
  batch_all = ('dp', 'pp') if plan.micro_batch % (plan.dp * plan.pp) == 0 else 'dp'
  return {
      'batch': 'dp', 'batch_all': batch_all, 'seq': None, 'embed': None, 'head_dim': None,
      'norm': None, 'heads': 'tp', 'kv_heads': 'tp', 'mlp': 'tp', 'vocab': 'tp', 'layers': 'pp',
      'micro': None, 'qkv': None, 'gate_up': None,
  }


_RULES: dict[str, object] | None = None


class use_rules:
  """Context: the rules that `constrain` and `spec` read while a step is traced."""

  def __init__(self, rules):
    self.rules = rules

  def __enter__(self):
    global _RULES
    self.prev, _RULES = _RULES, self.rules
    return self.rules

  def __exit__(self, *exc):
    global _RULES
    _RULES = self.prev


def stage_rules(rules: dict) -> dict:
  """Rules inside the pipeline loop, which is manual over dp: rows are already local there."""
  return dict(rules, batch=None)


def spec(logical: tuple, rules: dict | None = None) -> P:
  rules = rules if rules is not None else _RULES
  if rules is None:
    return P(*([None] * len(logical)))
  return P(*(rules[name] if name is not None else None for name in logical))


def constrain(x: jax.Array, logical: tuple) -> jax.Array:
  """Sharding annotation on an activation, in logical names (a no-op outside `use_rules`)."""
  if _RULES is None:
    return x
  return jax.lax.with_sharding_constraint(x, spec(logical))


def tree_shardings(logical_tree, mesh, rules) -> object:
  """A pytree of logical-axis tuples -> the matching pytree of NamedShardings."""
  return jax.tree.map(lambda names: NamedSharding(mesh, spec(names, rules)), logical_tree,
                      is_leaf=lambda x: isinstance(x, tuple))
