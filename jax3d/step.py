"""The pure functions of a run: `init_state`, `train_step`, `eval_step`, jitted with shardings.

Data flow of one step (`loss_fn`):
  tokens [B, T] (batch over dp*pp) -> embed (vocab-parallel) -> micro-batches [m, B/m, T, D]
  -> pipeline over pp (tp and dp inside each stage) -> head (batch over dp*pp, vocab over tp)
  -> vocab-parallel cross-entropy. Gradients of parameters replicated over dp are reduced over dp
  by the compiler. `train.grad_accum` chunks run sequentially in a scan, gradients summed.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jax3d import model as model_lib
from jax3d import optim, pipeline, sharding
from jax3d.config import RunPlan


@dataclasses.dataclass(frozen=True)
class Setup:
  """Everything the step functions close over: config, plan, mesh, model dims, optimizer."""
  cfg: Any
  plan: RunPlan
  mesh: Any
  dims: model_lib.Dims
  tx: optax.GradientTransformation
  rules: dict

  @staticmethod
  def create(cfg, plan, mesh) -> 'Setup':
    return Setup(cfg=cfg, plan=plan, mesh=mesh, dims=model_lib.Dims.from_config(cfg, plan),
                 tx=optim.make_optimizer(cfg), rules=sharding.logical_rules(plan))

  @property
  def layer_order(self) -> np.ndarray:
    return pipeline.layer_order(self.dims.n_layers, self.plan.pp, self.plan.repeats)


# ---------------------------------------------------------------------------------------------
# Loss
# ---------------------------------------------------------------------------------------------
def to_microbatches(x_b, m):
  """[B, ...] -> [m, B/m, ...], micro-batch i = rows i, i+m, i+2m, ... Rows of one dp shard stay
  on that shard (no communication) whenever B/m is divisible by dp."""
  return x_b.reshape(x_b.shape[0] // m, m, *x_b.shape[1:]).swapaxes(0, 1)


def from_microbatches(x_m):
  return x_m.swapaxes(0, 1).reshape(x_m.shape[0] * x_m.shape[1], *x_m.shape[2:])


def loss_sum_fn(params, tokens_bt, targets_bt, s: Setup):
  """Sum of token losses of one accumulation chunk."""
  dims, plan = s.dims, s.plan
  x_btd = model_lib.embed_apply(dims, params, tokens_bt)
  x_mbtd = sharding.constrain(to_microbatches(x_btd, plan.microbatches),
                              ('micro', 'batch_all', 'seq', 'embed'))
  inner = sharding.stage_rules(s.rules)

  def layer_fn(p, h):
    with sharding.use_rules(inner):
      return model_lib.block_apply(dims, p, h)

  y_mbtd = pipeline.pipeline(layer_fn, params['layers'], x_mbtd, mesh=s.mesh, pp=plan.pp,
                             repeats=plan.repeats, policy=s.cfg.train.remat,
                             scatter=s.rules['batch_all'] == ('dp', 'pp'))
  y_btd = sharding.constrain(from_microbatches(y_mbtd), ('batch_all', 'seq', 'embed'))
  logits_btv = model_lib.head_apply(dims, params, y_btd)
  return model_lib.cross_entropy_sum(logits_btv, targets_bt)


def chunked(x_b, a):
  """[B, ...] -> [a, B/a, ...] accumulation chunks (chunk i = rows i, i+a, ...; local to dp)."""
  return to_microbatches(x_b, a)


def loss_and_grads(params, batch, s: Setup):
  """Mean token loss of the whole global batch and its gradient, over grad_accum chunks."""
  a = s.plan.grad_accum
  n_tokens = batch['inputs'].size
  grad_fn = jax.value_and_grad(lambda p, x, y: loss_sum_fn(p, x, y, s) / n_tokens)
  if a == 1:
    return grad_fn(params, batch['inputs'], batch['targets'])

  def body(acc, xy):
    loss, grads = grad_fn(params, *xy)
    return jax.tree.map(jnp.add, acc, (loss, grads)), None

  zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
  xs = (chunked(batch['inputs'], a), chunked(batch['targets'], a))
  return jax.lax.scan(body, zeros, xs)[0]


# ---------------------------------------------------------------------------------------------
# State, shardings, jitted functions
# ---------------------------------------------------------------------------------------------
def init_state(key, s: Setup):
  params = model_lib.init_params(key, s.dims, s.layer_order)
  return {'step': jnp.zeros((), jnp.int32), 'params': params, 'opt_state': s.tx.init(params)}


def param_shardings(s: Setup):
  return sharding.tree_shardings(model_lib.param_logical_axes(s.dims), s.mesh, s.rules)


def state_shardings(s: Setup):
  params_sh = param_shardings(s)
  replicated = NamedSharding(s.mesh, P())
  abstract = jax.eval_shape(lambda k: init_state(k, s), jax.random.key(0))
  opt_sh = optax.tree_map_params(s.tx, lambda _, sh: sh, abstract['opt_state'], params_sh,
                                 transform_non_params=lambda _: replicated)
  return {'step': replicated, 'params': params_sh, 'opt_state': opt_sh}


def batch_sharding(s: Setup):
  return NamedSharding(s.mesh, P('dp'))


def abstract_state(s: Setup):
  shapes = jax.eval_shape(lambda k: init_state(k, s), jax.random.key(0))
  return jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                      shapes, state_shardings(s))


class MeshJit:
  """A jitted function traced and called with the run's mesh in context (`jax.set_mesh`), so that
  the model's bare PartitionSpec annotations resolve against it, also inside the pipeline."""

  def __init__(self, fn, mesh, **jit_kwargs):
    self.jitted, self.mesh = jax.jit(fn, **jit_kwargs), mesh

  def __call__(self, *args):
    with jax.set_mesh(self.mesh):
      return self.jitted(*args)

  def lower(self, *args):
    with jax.set_mesh(self.mesh):
      return self.jitted.lower(*args)


def abstract_inputs(s: Setup):
  """(abstract state, abstract batch) with their shardings: for ahead-of-time compilation."""
  batch = {k: jax.ShapeDtypeStruct((s.plan.global_batch, s.plan.seq_len), jnp.int32,
                                   sharding=batch_sharding(s)) for k in ('inputs', 'targets')}
  return abstract_state(s), batch


def make_init(s: Setup):
  """jit(init) with out_shardings: every array is created already sharded."""
  def init(seed):
    with sharding.use_rules(s.rules):
      return init_state(jax.random.key(seed), s)
  return MeshJit(init, s.mesh, out_shardings=state_shardings(s))


def train_step(state, batch, s: Setup):
  with sharding.use_rules(s.rules):
    loss, grads = loss_and_grads(state['params'], batch, s)
  drill = [int(x) for x in str(s.cfg.train.inject_nan_at).split(',') if x.strip()]
  if drill:  # fault drill (train.inject_nan_at): these steps see a NaN loss and NaN gradients
    nan = jnp.where(jnp.isin(state['step'] + 1, jnp.asarray(drill)), jnp.nan, 1.0)
    loss, grads = loss * nan, jax.tree.map(lambda g: g * nan, grads)
  grad_norm = optax.tree.norm(grads)
  updates, opt_state = s.tx.update(grads, state['opt_state'], state['params'])
  params = optax.apply_updates(state['params'], updates)
  ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  # apply_if_finite already skipped a non-finite gradient; a non-finite loss with finite
  # gradients (impossible in exact arithmetic, possible in overflowed bf16) is skipped here too.
  keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
  new_state = {'step': state['step'] + 1, 'params': keep(params, state['params']),
               'opt_state': keep(opt_state, state['opt_state'])}
  metrics = {'loss': loss, 'grad_norm': grad_norm, 'lr': optim.schedule(s.cfg)(state['step']),
             'finite': ok}
  return new_state, metrics


def eval_step(params, batch, s: Setup):
  with sharding.use_rules(s.rules):
    return loss_sum_fn(params, batch['inputs'], batch['targets'], s) / batch['inputs'].size


def make_train_step(s: Setup):
  st_sh = state_shardings(s)
  b_sh = {'inputs': batch_sharding(s), 'targets': batch_sharding(s)}
  rep = NamedSharding(s.mesh, P())
  return MeshJit(lambda st, b: train_step(st, b, s), s.mesh, in_shardings=(st_sh, b_sh),
                 out_shardings=(st_sh, rep), donate_argnums=(0,))


def make_eval_step(s: Setup):
  b_sh = {'inputs': batch_sharding(s), 'targets': batch_sharding(s)}
  return MeshJit(lambda p, b: eval_step(p, b, s), s.mesh,
                 in_shardings=(state_shardings(s)['params'], b_sh), out_shardings=NamedSharding(s.mesh, P()))
