"""The pure functions of a run: `init_state`, `train_step`, `eval_step`, and their jitted forms.
The loss and its gradients over the run's layout, which the steps call: jax3d/loss.py.

Every function takes the run's `Setup` (jax3d/assemble.py), which holds the config, plan, mesh, model
dims, optimizer, logical rules and the shardings, computed once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jax3d import optim
from jax3d.data import global_batch
from jax3d.loss import loss_and_grads, loss_sum, router_metrics, weight_sum
from jax3d.model import llama, lora
from jax3d.parallel import data_parallel, sharding

if TYPE_CHECKING:
  from jax3d.setup import Setup

State = dict[str, Any]
Batch = dict[str, jax.Array]


# --- state and steps --------------------------------------------------------------------------
def init_state(key: jax.Array, s: Setup) -> State:
  """A fresh train state: parameters from `key`, step 0, the optimizer's initial state."""
  return state_from_params(llama.init_params(key, s.dims, s.layer_order), s)


def state_from_params(params: Any, s: Setup) -> State:
  """The train state at step 0 around given parameters (an import, a warm start, or a seed's)."""
  train = lora.trainable(s.dims, params)[0]
  state = {'step': jnp.zeros((), jnp.int32), 'params': params, 'opt_state': s.tx.init(train)}
  if s.has_residual:  # int8 error feedback: one residual per dp rank (jax3d/parallel/data_parallel.py)
    state['grad_residual'] = data_parallel.init_residual(train, s.plan.dp * s.plan.cp)
  return state


def _fault_drill(step: jax.Array, loss: jax.Array, grads: Any, steps: tuple[int, ...]) -> tuple:
  """train.inject_nan_at: these steps see a NaN loss and NaN gradients (tests the skip path)."""
  nan = jnp.where(jnp.isin(step, jnp.asarray(steps)), jnp.nan, 1.0)
  return loss * nan, jax.tree.map(lambda g: g * nan, grads)


def train_step(state: State, batch: Batch, s: Setup) -> tuple[State, dict]:
  global_batch.check_batch(
    batch, s.plan.global_batch, s.plan.seq_len, 'train step (train.global_batch_size x train.seq_len)'
  )
  if s.dims.lora_dropout:  # each token's dropout word of this step, from the seed and the step
    words = lora.noise_words(s.cfg.train.seed, state['step'], batch['inputs'].shape)
    batch = {**batch, lora.NOISE: jax.lax.with_sharding_constraint(words, s.batch_sharding)}
  with sharding.use_rules(s.rules):
    loss, grads, residual = loss_and_grads(state['params'], batch, state.get('grad_residual'), s)
  grads, router = router_metrics(grads, s)  # mixture of experts: the probe's gradient, read and zeroed
  params, frozen = lora.trainable(s.dims, state['params'])  # the base (LoRA) passes through unchanged
  if s.zero1:  # ZeRO-1: gradients in the moments' layout, the update on each rank's slice only
    zero = lora.trainable(s.dims, s.zero_shardings)[0]  # (the explicit path delivered the slices)
    grads, params = jax.lax.with_sharding_constraint((grads, params), (zero, zero))
  if s.plan.nan_steps:
    loss, grads = _fault_drill(state['step'] + 1, loss, grads, s.plan.nan_steps)
  grad_norm = optax.tree.norm(grads)
  # A step whose loss or gradients are not finite leaves the state as it was (the norm is non-finite
  # iff some gradient is; a non-finite loss with finite gradients happens in overflowed bf16). One
  # cond around the update: skipped work is not done, no select over the state trees.
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
    new_params = jax.lax.with_sharding_constraint(new_params, lora.trainable(s.dims, s.param_shardings)[0])
  new_state = {'step': state['step'] + 1, 'params': lora.merge(new_params, frozen), 'opt_state': opt_state}
  if residual is not None:
    new_state['grad_residual'] = residual
  # The rate the optimizer used: its schedule count (frozen on skipped steps), not the step counter.
  lr = s.lr_schedule(optim.lr_schedule_count(state['opt_state'], default=state['step']))
  metrics = {'loss': loss, 'grad_norm': grad_norm, 'lr': lr, 'finite': ok} | router
  return new_state, metrics


def eval_step(params: Any, batch: Batch, s: Setup) -> jax.Array:
  """The weighted mean loss of one chunk of held-out rows (evaluation weights it by the chunk's
  weight sum, so the held-out loss is the weighted mean over all of its batches)."""
  global_batch.check_batch(
    batch, s.plan.chunk_batch, s.plan.seq_len, 'eval step (one accumulation chunk x train.seq_len)'
  )
  with sharding.use_rules(s.rules):
    return loss_sum(params, batch, s) / weight_sum(batch)


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
