"""The pure functions of a run: `init_state`, `train_step`, `eval_step`, and their jitted forms.

Data flow of one step (`loss_sum`):
  tokens [B, T] (batch over dp*pp) -> embed (vocab-parallel) -> pipeline.apply: micro-batches
  through the stages over pp (tp inside each stage) -> head (batch over dp*pp, vocab over tp)
  -> vocab-parallel cross-entropy. The gradients are summed over dp by the compiler, or by hand
  (jax3d/parallel/data_parallel.py) for ZeRO-1 and 16-/8-bit reductions. `train.grad_accum` chunks run
  sequentially in a scan, their gradients summed.

Every function takes the run's `Setup` (jax3d/assemble.py), which holds the config, plan, mesh, model
dims, optimizer, logical rules and the shardings, computed once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import chex
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jax3d.model import llama
from jax3d.parallel import data_parallel, microbatch, pipeline, sharding
from jax3d.training import optim

if TYPE_CHECKING:
  from jax3d.record import Setup

State = dict[str, Any]
Batch = dict[str, jax.Array]


# --- loss and gradients ---------------------------------------------------------------------
def loss_sum(
  params: Any, tokens_bt: jax.Array, targets_bt: jax.Array, s: Setup, manual: bool = False
) -> jax.Array:
  """Sum of token losses of one accumulation chunk. `manual`: traced inside data_parallel's
  shard_map (manual over dp and pp): the rows are this device's, the layers this stage's, and
  the sum is this device's share (summed over dp and pp by the caller)."""
  if manual:
    tokens_bt, targets_bt = (
      microbatch.local_rows(tokens_bt, s.plan),
      microbatch.local_rows(targets_bt, s.plan),
    )
  if pipeline.in_loop_loss(s.cfg.pipeline.schedule, s.plan):  # 1F1B: the head and loss in the loop
    return _pipelined_loss_sum(params, tokens_bt, {'targets': targets_bt}, s, manual)
  return llama.cross_entropy_sum(logits(params, tokens_bt, s, manual), targets_bt)


def _pipelined_loss_sum(
  params: Any, tokens_bt: jax.Array, side_bt: Batch, s: Setup, manual: bool
) -> jax.Array:
  """embed -> the 1F1B pipeline, whose last stage computes the head and the loss of each
  micro-batch from its per-row side inputs (`side_bt`: [B, T] arrays, micro-batched as the rows)."""
  head = {k: v for k, v in params.items() if k != 'layers'}  # what llama.head_apply may read

  def micro_loss(head, y_btd, side):
    return llama.cross_entropy_sum(llama.head_apply(s.dims, head, y_btd), side['targets'])

  x_btd = llama.embed_apply(s.dims, params, tokens_bt)
  return pipeline.loss(
    _block_fn(s, tokens_bt.shape[1]),
    params['layers'],
    head,
    x_btd,
    side_bt,
    micro_loss,
    mesh=s.mesh,
    plan=s.plan,
    rules=s.rules,
    policy=s.cfg.train.remat,
    manual=manual,
  )


def _block_fn(s: Setup, seq_len: int) -> Callable:
  """One layer as the pipeline runs it: (layer params, x) -> x (rows [b*t, d] under SP)."""
  return lambda p, h: llama.block_apply(s.dims, p, h, seq_len=seq_len if s.plan.sequence_parallel else None)


def logits(params: Any, tokens_bt: jax.Array, s: Setup, manual: bool = False) -> jax.Array:
  """fp32 logits [b, t, v_padded] (vocab over tp): embed -> the pipeline -> head, as training
  computes them (the loss is their cross-entropy)."""
  x_btd = llama.embed_apply(s.dims, params, tokens_bt)
  y_btd = pipeline.apply(
    _block_fn(s, tokens_bt.shape[1]),
    params['layers'],
    x_btd,
    mesh=s.mesh,
    plan=s.plan,
    rules=s.rules,
    policy=s.cfg.train.remat,
    manual=manual,
  )
  return llama.head_apply(s.dims, params, y_btd)


def accumulate(
  grad_fn: Callable, params: Any, batch: Batch, a: int, first_outside: bool = False
) -> tuple[jax.Array, Any]:
  """(loss, grads) of `grad_fn` summed over `a` accumulation chunks of the batch, in a scan (chunk
  i = rows i, i+a, ...: local to each dp shard). The sum starts from zeros, or with
  `first_outside` from chunk 0 computed before the scan: inside a shard_map the accumulator must
  vary over the same manual axes as the loss, which depends on the layout (the same sum: 0 + x = x)."""
  if a == 1:
    return grad_fn(params, batch['inputs'], batch['targets'])

  def body(acc, xy):
    return jax.tree.map(jnp.add, acc, grad_fn(params, *xy)), None

  xs = (microbatch.microbatches(batch['inputs'], a), microbatch.microbatches(batch['targets'], a))
  if first_outside:
    return jax.lax.scan(body, grad_fn(params, xs[0][0], xs[1][0]), (xs[0][1:], xs[1][1:]))[0]
  zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
  return jax.lax.scan(body, zeros, xs)[0]


def loss_and_grads(params: Any, batch: Batch, residual: Any, s: Setup) -> tuple[jax.Array, Any, Any]:
  """Mean token loss of the global batch, its gradient summed over dp, and the new int8 residual."""
  n_tokens = batch['inputs'].size  # global
  if not s.explicit_dp:
    grad_fn = jax.value_and_grad(lambda p, x, y: loss_sum(p, x, y, s) / n_tokens)
    return (*accumulate(grad_fn, params, batch, s.plan.grad_accum), residual)

  def local_grads(params, batch):  # one device's rows: the mesh axes dp and pp are manual here
    grad_fn = jax.value_and_grad(lambda p, x, y: loss_sum(p, x, y, s, manual=True) / n_tokens)
    with sharding.use_rules(sharding.without_dp_pp(s.rules)):
      return accumulate(grad_fn, params, batch, s.plan.grad_accum, first_outside=True)

  return data_parallel.value_and_grad(
    local_grads,
    params,
    batch,
    residual,
    mesh=s.mesh,
    params_sh=s.param_shardings,
    grads_sh=s.zero_shardings if s.zero1 else s.param_shardings,
    dtype=s.cfg.train.grad_reduce_dtype,
    shard=s.zero1,
  )


# --- state and steps --------------------------------------------------------------------------
def init_state(key: jax.Array, s: Setup) -> State:
  """A fresh train state: parameters from `key`, step 0, the optimizer's initial state."""
  return state_from_params(llama.init_params(key, s.dims, s.layer_order), s)


def state_from_params(params: Any, s: Setup) -> State:
  """The train state at step 0 around given parameters (an import, a warm start, or a seed's)."""
  state = {'step': jnp.zeros((), jnp.int32), 'params': params, 'opt_state': s.tx.init(params)}
  if s.has_residual:  # int8 error feedback: one residual per dp rank (jax3d/parallel/data_parallel.py)
    state['grad_residual'] = data_parallel.init_residual(params, s.plan.dp)
  return state


def _fault_drill(step: jax.Array, loss: jax.Array, grads: Any, steps: tuple[int, ...]) -> tuple:
  """train.inject_nan_at: these steps see a NaN loss and NaN gradients (tests the skip path)."""
  nan = jnp.where(jnp.isin(step, jnp.asarray(steps)), jnp.nan, 1.0)
  return loss * nan, jax.tree.map(lambda g: g * nan, grads)


def check_batch(batch: Batch, rows: int, seq_len: int, what: str) -> None:
  """The batch at a step's boundary, checked when the step is traced (chex; nothing runs per
  step): `inputs` and `targets` are integer token ids of shape [rows, seq_len]. Another shape would
  otherwise be split into micro-batches of the wrong size, or fail deep inside the pipeline."""
  arrays, msg = (
    [batch['inputs'], batch['targets']],
    f'{what}: batch inputs and targets must be [{rows}, {seq_len}]',
  )
  chex.assert_rank(arrays, 2, custom_message=msg)
  chex.assert_shape(arrays, (rows, seq_len), custom_message=msg)
  chex.assert_type(arrays, int, custom_message=msg)


def train_step(state: State, batch: Batch, s: Setup) -> tuple[State, dict]:
  check_batch(
    batch, s.plan.global_batch, s.plan.seq_len, 'train step (train.global_batch_size x train.seq_len)'
  )
  with sharding.use_rules(s.rules):
    loss, grads, residual = loss_and_grads(state['params'], batch, state.get('grad_residual'), s)
  params = state['params']
  if s.zero1:
    # ZeRO-1: gradients in the moments' layout (the explicit path already delivered the slices),
    # the update on each rank's slice only.
    grads = jax.lax.with_sharding_constraint(grads, s.zero_shardings)
    params = jax.lax.with_sharding_constraint(params, s.zero_shardings)
  if s.plan.nan_steps:
    loss, grads = _fault_drill(state['step'] + 1, loss, grads, s.plan.nan_steps)
  grad_norm = optax.tree.norm(grads)
  # A step whose loss or gradients are not finite leaves the state as it was (the norm is
  # non-finite iff some gradient is; a non-finite loss with finite gradients is possible in
  # overflowed bf16). One cond around the whole update: skipped work is not done, and no select
  # over the state trees (nor optax.apply_if_finite's per-leaf is-finite pass).
  ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

  def update(operands):
    grads, opt_state, params, _, new_residual = operands
    updates, opt_state = s.tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, new_residual

  def skip(operands):
    _, opt_state, params, old_residual, _ = operands
    return params, opt_state, old_residual

  new_params, opt_state, residual = jax.lax.cond(
    ok, update, skip, (grads, state['opt_state'], params, state.get('grad_residual'), residual)
  )
  if s.zero1:  # all-gather the updated slices back to the parameters' own layout
    new_params = jax.lax.with_sharding_constraint(new_params, s.param_shardings)
  new_state = {'step': state['step'] + 1, 'params': new_params, 'opt_state': opt_state}
  if residual is not None:
    new_state['grad_residual'] = residual
  # The rate the optimizer used: its schedule count (frozen on skipped steps), not the step counter.
  lr = s.schedule(optim.schedule_count(state['opt_state'], default=state['step']))
  metrics = {'loss': loss, 'grad_norm': grad_norm, 'lr': lr, 'finite': ok}
  return new_state, metrics


def eval_step(params: Any, batch: Batch, s: Setup) -> jax.Array:
  check_batch(batch, s.plan.chunk_batch, s.plan.seq_len, 'eval step (one accumulation chunk x train.seq_len)')
  with sharding.use_rules(s.rules):
    return loss_sum(params, batch['inputs'], batch['targets'], s) / batch['inputs'].size


# --- jitted forms -----------------------------------------------------------------------------
class MeshJit:
  """A jitted function traced and called with the run's mesh in context (`jax.set_mesh`), so that
  the model's bare PartitionSpec annotations resolve against it, also inside the pipeline."""

  def __init__(self, fn: Callable, mesh: jax.sharding.Mesh, **jit_kwargs: Any):
    self.jitted, self.mesh = jax.jit(fn, **jit_kwargs), mesh

  def __call__(self, *args: Any) -> Any:
    with jax.set_mesh(self.mesh):
      return self.jitted(*args)

  def lower(self, *args: Any) -> jax.stages.Lowered:
    with jax.set_mesh(self.mesh):
      return self.jitted.lower(*args)


def make_init(s: Setup) -> MeshJit:
  """jit(init) with out_shardings: every array is created already sharded."""

  def init(seed):
    with sharding.use_rules(s.rules):
      return init_state(jax.random.key(seed), s)

  return MeshJit(init, s.mesh, out_shardings=s.state_shardings)


def make_init_from_params(s: Setup) -> MeshJit:
  """jit(state_from_params) with out_shardings; the parameters (in their shardings) are donated,
  so an import or a warm start never holds them twice."""

  def init(params):
    with sharding.use_rules(s.rules):
      return state_from_params(params, s)

  return MeshJit(
    init, s.mesh, in_shardings=(s.param_shardings,), out_shardings=s.state_shardings, donate_argnums=(0,)
  )


def make_train_step(s: Setup) -> MeshJit:
  return MeshJit(
    lambda st, b: train_step(st, b, s),
    s.mesh,
    in_shardings=(s.state_shardings, s.batch_shardings),
    out_shardings=(s.state_shardings, NamedSharding(s.mesh, P())),
    donate_argnums=(0,),
  )


def make_eval_step(s: Setup) -> MeshJit:
  return MeshJit(
    lambda p, b: eval_step(p, b, s),
    s.mesh,
    in_shardings=(s.param_shardings, s.batch_shardings),
    out_shardings=NamedSharding(s.mesh, P()),
  )
