"""Tensor parallelism and the one table from logical axis names (what the model speaks) to mesh axes.

  batch      micro-batch rows inside the pipeline          -> dp (dp and ep with mesh.ep > 1)
  rows       a layer's flattened rows b*t (outside SP)      -> dp, and with context parallelism
             (mesh.cp > 1) cp and dp: cp-major rows (context.rows), each device's own tokens;
             dp and ep with expert parallelism (mesh.ep > 1); cp, dp and ep with both
  experts    a mixture's experts (jax3d/model/moe.py)       -> ep (replicated without it)
  router, expert_slots, capacity                          -> replicated (the router's experts,
             the dispatched slots' expert and capacity axes: jax3d/parallel/expert.py)
  seq        the sequence                                   -> replicated, or cp when mesh.cp > 1
  batch_all  batch rows outside the pipeline (embed, head) -> dp and pp, so every device works
             (microbatch.batch_axes decides: dp alone when a micro-batch does not split over dp*pp)
  embed, head_dim, norm, qkv, gate_up, lora               -> replicated (lora: an adapter's rank)
  micro      the micro-batch axis outside the pipeline's loop -> replicated, or pp where whole
             micro-batches are split over it (microbatch.micro_axes)
  heads, kv_heads    attention heads (Megatron column/row)  -> tp
  mlp        feed-forward hidden units (column/row)         -> tp
  vocab      vocabulary-parallel embedding and head         -> tp
  layers     the stacked layer axis                         -> pp (one slab of layers per stage)
  rows_sp    the flattened rows b*t of a layer's residual stream (x, the RMSNorms, the residual
             adds) -> dp and, with sequence parallelism (Megatron-SP, train.sequence_parallel),
             tp (cp-major rows split over cp, dp, tp with mesh.cp > 1: each cp rank's tokens
             split over tp): inside the pipeline the rows are local, so they split over tp alone; the
             all-reduce after attention and after the MLP becomes a reduce-scatter, and an
             all-gather brings the rows back before the next column-parallel matmul

Tensor parallelism is nothing but this table: the model annotates its weights and activations in
logical names (Megatron's column- and row-parallel layout), and XLA inserts the collectives.
The rules are in flax's format and resolved by flax (`nn.logical_to_mesh_axes`,
`nn.with_logical_constraint(..., rules=...)`); inside a `shard_map` manual over some mesh axes the
rules name none of those (`without`). The rules in force while a step is traced are held in a
context variable (`use_rules`), not in flax's own `nn.logical_axis_rules` context: that one also
turns on constraints inside flax's boxed parameters, and `nn.DenseGeneral` creates a
multi-dimensional kernel flat before reshaping it (also under `eval_shape` during `apply`, to check
shapes), so the kernel's logical names would be applied to an array of the wrong rank.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DP, PP, TP = 'dp', 'pp', 'tp'  # the mesh axes (jax3d/parallel/mesh.py builds the mesh with them)
CP = 'cp'  # the context-parallel axis: in the mesh only when mesh.cp > 1 (jax3d/parallel/context.py)
EP = 'ep'  # the expert-parallel axis: in the mesh only when mesh.ep > 1 (jax3d/model/moe.py)

Rules = tuple[tuple[str, Any], ...]  # flax logical axis rules: (logical name, mesh axes or None)


def logical_rules(
  batch_all: str | tuple[str, ...],
  sequence_parallel: bool = False,
  micro: str | None = None,
  context: bool = False,
  expert: bool = False,
) -> Rules:
  """The table above; `batch_all` and `micro` are the pipeline's choice for the batch outside its
  loop; `context`: mesh.cp > 1 (the sequence over the 'cp' axis); `expert`: mesh.ep > 1 (the
  experts over 'ep')."""
  rows = (CP, DP) if context else (DP, EP) if expert else DP  # cp-major rows (context.rows)
  rows = (CP, DP, EP) if context and expert else rows
  return (
    ('batch', (DP, EP) if expert else DP),
    ('rows', rows),
    ('rows_sp', ((CP, DP, TP) if context else (DP, TP)) if sequence_parallel else rows),
    ('batch_all', batch_all),
    ('seq', CP if context else None),
    ('embed', None),
    ('head_dim', None),
    ('norm', None),
    ('heads', TP),
    ('kv_heads', TP),
    ('mlp', TP),
    ('vocab', TP),
    ('layers', PP),
    ('micro', micro),
    ('qkv', None),
    ('gate_up', None),
    ('lora', None),
    ('experts', EP if expert else None),
    ('router', None),
    ('expert_slots', None),
    ('capacity', None),
  )


def rule(rules: Rules, name: str) -> Any:
  """The mesh axes the rules give logical axis `name`."""
  return dict(rules)[name]


def without(rules: Rules, axes: Iterable[str]) -> Rules:
  """The rules inside a shard_map manual over `axes`: those mesh axes are named nowhere."""
  axes = set(axes)

  def strip(v):
    if isinstance(v, tuple):
      rest = tuple(a for a in v if a not in axes)
      return rest[0] if len(rest) == 1 else (rest or None)
    return None if v in axes else v

  return tuple((k, strip(v)) for k, v in rules)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Token batches [rows, seq]: rows split over dp, the rest replicated."""
  return NamedSharding(mesh, P(DP))


def without_dp_pp(rules: Rules) -> Rules:
  """The rules inside a shard_map manual over dp and pp (the pipeline's loop, data_parallel's
  explicit reduction): each device holds its own rows and its own stage, and only tp (and an
  automatic cp) is named; nor is any other axis manual where this is called (cp in the explicit
  reduction: each device holds its own tokens)."""
  mesh = jax.sharding.get_abstract_mesh()
  return without(rules, {DP, PP, *(() if mesh.empty else mesh.manual_axes)})


_RULES: contextvars.ContextVar[Rules | None] = contextvars.ContextVar('jax3d_logical_rules', default=None)


@contextlib.contextmanager
def use_rules(rules: Rules) -> Iterator[Rules]:
  """Context: the rules that `constrain` reads while a step is traced."""
  token = _RULES.set(rules)
  try:
    yield rules
  finally:
    _RULES.reset(token)


def constrain(x: jax.Array, logical: tuple) -> jax.Array:
  """Sharding annotation on an activation, in logical names (a no-op outside `use_rules`)."""
  rules = _RULES.get()
  return x if rules is None else nn.with_logical_constraint(x, logical, rules=rules)


def vary(a: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  """Marks `a` as varying over the manual `axes` it is not yet varying over (shard_map's vma):
  inside a shard_map, a value that differs per rank; its transpose sums the gradient over them.
  Sorted: a caller's axes may come from a set, whose order follows the hash seed (issue 44)."""
  missing = tuple(sorted(ax for ax in axes if ax not in jax.typeof(a).manual_axis_type.varying))
  return jax.lax.pcast(a, missing, to='varying') if missing else a


def vary_like(a: jax.Array, x: jax.Array) -> jax.Array:
  """`a` marked varying over the manual axes `x` varies over (`vary`): a value a region without the
  vma check (or a Pallas kernel) returned, typed as the operand it stands for."""
  return vary(a, tuple(jax.typeof(x).manual_axis_type.varying))


def tp_local(fn: Any, in_logical: tuple[tuple, ...], out_logical: tuple) -> Any:
  """`fn` on each tp rank's own blocks: a shard_map manual over tp (and over cp where the mesh
  has it automatic: the rows of sequence parallelism are split over cp, then tp), nested in the
  context (the step is traced under `jax.set_mesh`; dp and pp may be manual already), its specs the
  logical names resolved by the rules in force. For collectives the compiler would not choose
  itself: XLA:CPU keeps an all-reduce and a slice where a reduce-scatter is meant."""
  mesh = jax.sharding.get_abstract_mesh()
  cp = CP in mesh.axis_names and CP not in mesh.manual_axes
  return _manual(fn, in_logical, out_logical, {TP, CP} if cp else {TP})


def device_local(
  fn: Any,
  in_logical: tuple[tuple, ...],
  out_logical: tuple,
  check_vma: bool = True,
  axes: set[str] | None = None,
) -> Any:
  """`fn` on each device's own blocks: a shard_map manual over every mesh axis not manual yet
  (nested in the pipeline's or the explicit reduction's shard_map, or at the top), its specs the
  logical names resolved by the rules in force; an axis a spec does not name is replicated. For a
  kernel whose custom partitioner cannot take the layouts GSPMD gives it (cuDNN attention): inside,
  nothing is left to partition. `check_vma=False` for a region that jax may split (partial
  evaluation, e.g. a scan hoisting its loop-invariant part): jax 0.10 then gives the residuals the
  newly manual axes alone, where with the check it names the enclosing shard_map's too (dp), an
  order Shardy rejects. `axes`: manual over these alone (ep: the experts' all-to-all), the others
  left as they are."""
  mesh = jax.sharding.get_abstract_mesh()
  axes = (set(mesh.axis_names) - set(mesh.manual_axes)) if axes is None else axes
  return _manual(fn, in_logical, out_logical, axes, check_vma) if axes else fn


def device_local_vjp(
  fn: Any,
  in_logical: tuple[tuple, ...],
  out_logical: tuple,
  n_nondiff: int,
  backward: Any = None,
  saved: tuple[tuple, ...] = (),
  axes: set[str] | None = None,
) -> Any:
  """`fn` run on each device's own blocks (`device_local`; manual over `axes` alone where given)
  with a custom VJP: forward and backward as two separate per-device regions. Differentiating one
  region instead makes the kernel's internal residuals (cuDNN's softmax statistics, the bias, a
  logsumexp) outputs of a shard_map nested in the pipeline's, which jax 0.10 gives the wrong global
  shape or an invalid sharding, or split over a free axis (dp) before a manual one, which Shardy
  rejects (BUILD_NOTES.md).

  The forward region keeps its inputs; the backward region returns the inputs' cotangents (zeros
  for the last `n_nondiff`, made from integers). Without `backward` it runs `jax.vjp` of `fn` (its
  forward once more, then its backward). `backward(*inputs, g)`, where given, replaces it (a
  Pallas kernel's: its calls' outputs carry no manual-axis types, so both regions run without
  shard_map's check of them). With `saved` (the logical names of more outputs of `fn`: its
  residuals, e.g. a logsumexp), `fn` returns (out, *residuals), which the forward keeps and the
  backward takes: `backward(*inputs, out, *residuals, g)`."""
  check = backward is None
  fwd_region = device_local(fn, in_logical, (out_logical, *saved) if saved else out_logical, check, axes)

  def bwd_local(*args):
    *primals, g = args
    grads = backward(*primals, g) if backward else jax.vjp(fn, *primals)[1](g)
    return tuple(grads[: len(in_logical) - n_nondiff])

  n_diff = len(in_logical) - n_nondiff
  bwd_in = in_logical + ((out_logical, *saved) if saved else ()) + (out_logical,)
  bwd_region = device_local(bwd_local, bwd_in, in_logical[:n_diff], check, axes)

  # A region without the check returns values typed invariant over the enclosing shard_map's manual
  # axes (the pipeline's): typed back as varying like the operands (out: the first's; each
  # gradient: its input's).
  def forward(*operands):
    out, *kept = fwd_region(*operands) if saved else (fwd_region(*operands),)
    return vary_like(out, operands[0]), (out, *kept)

  run = jax.custom_vjp(lambda *operands: forward(*operands)[0])

  def run_fwd(*operands):
    out, kept = forward(*operands)
    return out, (operands, kept if saved else ())

  def run_bwd(res, g):
    operands, kept = res
    grads = bwd_region(*operands, *kept, g)
    return tuple(map(vary_like, grads, operands)) + tuple(jnp.zeros_like(x) for x in operands[n_diff:])

  run.defvjp(run_fwd, run_bwd)
  return run


def _manual(
  fn: Any, in_logical: tuple[tuple, ...], out_logical: tuple, axes: set[str], check_vma: bool = True
) -> Any:
  """A shard_map manual over `axes`; `out_logical` is one output's names or a tuple of them."""
  mesh = jax.sharding.get_abstract_mesh()
  rules = without(_RULES.get(), set(mesh.axis_names) - axes)  # specs name the manual axes alone
  several = bool(out_logical) and all(isinstance(n, tuple) for n in out_logical)
  return jax.shard_map(
    fn,
    in_specs=tuple(spec(names, rules) for names in in_logical),
    out_specs=tuple(spec(n, rules) for n in out_logical) if several else spec(out_logical, rules),
    axis_names=axes,
    check_vma=check_vma,
  )


def spec(logical: tuple, rules: Rules) -> P:
  return nn.logical_to_mesh_axes(logical, rules)


def tree_shardings(logical_tree: Any, mesh: Mesh, rules: Rules) -> Any:
  """A pytree of logical-axis tuples -> the matching pytree of NamedShardings."""
  return jax.tree.map(
    lambda names: NamedSharding(mesh, spec(names, rules)),
    logical_tree,
    is_leaf=lambda x: isinstance(x, tuple),
  )
