"""The pure functions of a run: `init_state`, `train_step`, `eval_step`, jitted with shardings.

Data flow of one step (`loss_fn`):
  tokens [B, T] (batch over dp*pp) -> embed (vocab-parallel) -> micro-batches [m, B/m, T, D]
  -> pipeline over pp (tp and dp inside each stage) -> head (batch over dp*pp, vocab over tp)
  -> vocab-parallel cross-entropy. Gradients of parameters replicated over dp are reduced over dp
  by the compiler. `train.grad_accum` chunks run sequentially in a scan, gradients summed.

Communication options (gradcomm.py, docs/performance.md): `train.grad_reduce_dtype` bfloat16 or
int8 computes the gradients per dp rank inside a `shard_map` manual over dp and reduces them by
hand (16- or 8-bit on the wire); `train.shard_optimizer` (ZeRO-1) shards Adam's moments over dp,
updates on the shard and all-gathers the parameters. The float32, unsharded default is unchanged.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jax3d.model import llama as model_lib
from jax3d.parallel import data_parallel as gradcomm
from jax3d.training import optim
from jax3d.parallel import pipeline
from jax3d.parallel import sharding
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


def loss_sum_fn(params, tokens_bt, targets_bt, s: Setup, manual: bool = False):
  """Sum of token losses of one accumulation chunk. `manual`: traced inside the shard_map of
  `loss_and_grads_explicit` (manual over dp and pp): rows are this dp rank's, the layers this
  stage's, and the sum is this device's share (summed over dp and pp by the caller)."""
  dims, plan = s.dims, s.plan
  scatter = s.rules['batch_all'] == ('dp', 'pp')
  rules = rules_without(s.rules, ('dp', 'pp')) if manual else s.rules
  if manual and scatter and plan.pp > 1:  # this pp rank's slice of every micro-batch's rows
    tokens_bt, targets_bt = _pp_rows(tokens_bt, plan), _pp_rows(targets_bt, plan)
  x_btd = model_lib.embed_apply(dims, params, tokens_bt)
  x_mbtd = sharding.constrain(to_microbatches(x_btd, plan.microbatches),
                              ('micro', 'batch_all', 'seq', 'embed'))
  inner = sharding.stage_rules(rules)

  def layer_fn(p, h):
    with sharding.use_rules(inner):
      return model_lib.block_apply(dims, p, h)

  y_mbtd = pipeline.pipeline(layer_fn, params['layers'], x_mbtd, mesh=s.mesh, pp=plan.pp,
                             repeats=plan.repeats, policy=s.cfg.train.remat, scatter=scatter,
                             manual_outside=manual)
  y_btd = sharding.constrain(from_microbatches(y_mbtd), ('batch_all', 'seq', 'embed'))
  logits_btv = model_lib.head_apply(dims, params, y_btd)
  return model_lib.cross_entropy_sum(logits_btv, targets_bt)


def _pp_rows(x_b, plan):
  """Inside the dp- and pp-manual shard_map: this pp rank's slice of each micro-batch's rows (the
  rows the automatic layout gives it, batch_all = (dp, pp)), in the same [B, ...] row order."""
  x_m = to_microbatches(x_b, plan.microbatches)
  b = x_m.shape[1] // plan.pp
  return from_microbatches(jax.lax.dynamic_slice_in_dim(x_m, jax.lax.axis_index('pp') * b, b, axis=1))


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


def rules_without(rules: dict, axes) -> dict:
  """The logical rules inside a shard_map manual over `axes`: those axes are named nowhere."""
  def strip(v):
    if isinstance(v, tuple):
      rest = tuple(a for a in v if a not in axes)
      return rest[0] if len(rest) == 1 else (rest or None)
    return None if v in axes else v
  return {k: strip(v) for k, v in rules.items()}


def explicit_reduction(s: Setup) -> bool:
  """Whether the dp gradient sum is done by hand (gradcomm) rather than by the compiler: for a
  16-/8-bit wire format, and under ZeRO-1 (XLA:CPU keeps an all-reduce followed by a slice, where
  an explicit reduce-scatter moves half the bytes)."""
  return s.plan.dp > 1 and (s.cfg.train.grad_reduce_dtype != 'float32' or zero1(s))


def zero1(s: Setup) -> bool:
  return bool(s.cfg.train.shard_optimizer) and s.plan.dp > 1


def has_residual(s: Setup) -> bool:
  return s.plan.dp > 1 and s.cfg.train.grad_reduce_dtype == 'int8'


def _manual_spec(spec: P, ndim: int, manual) -> P:
  """A PartitionSpec restricted to the `manual` mesh axes (shard_map specs name no others)."""
  out = []
  for e in tuple(spec) + (None,) * (ndim - len(tuple(spec))):
    names = tuple(a for a in (e if isinstance(e, tuple) else (e,)) if a in manual)
    out.append(names[0] if len(names) == 1 else (names or None))
  while out and out[-1] is None:
    out.pop()
  return P(*out)


def loss_and_grads_explicit(params, batch, residual, s: Setup):
  """`loss_and_grads` with the dp reduction done by hand. The loss and gradients are computed per
  device inside one shard_map manual over dp and pp (tp stays automatic): the parameters are made
  varying over dp before differentiation, so no automatic dp sum is inserted; the pipeline runs
  without a shard_map of its own; the grad_accum chunks are summed locally. `gradcomm.reduce` then
  sums the gradients over dp once per step in train.grad_reduce_dtype, in a shard_map nested over
  tp so each device reduces its own tp block (sums over pp, for the embedding and head, stay
  automatic and fp32). Under ZeRO-1 the gradients come back
  reduce-scattered (each dp rank its zero_dim slice). Returns (loss, grads, new residual or None).
  """
  dp, a, shard = s.plan.dp, s.plan.grad_accum, zero1(s)
  dtype = s.cfg.train.grad_reduce_dtype
  manual = {ax for ax in ('dp', 'pp') if s.mesh.shape[ax] > 1}
  params_sh = param_shardings(s)
  dims = gradcomm.dims_tree(params, params_sh, dp)
  spec_of = lambda x, sh: _manual_spec(sh.spec, x.ndim, manual)
  p_specs = jax.tree.map(spec_of, params, params_sh)
  out_sh = zero_shardings(s) if shard else params_sh
  g_specs = jax.tree.map(spec_of, params, out_sh)
  r_specs = (None if residual is None else
             jax.tree.map(spec_of, residual, gradcomm.residual_shardings(params_sh, s.mesh)))
  n_tokens = batch['inputs'].size  # global
  rules = rules_without(s.rules, ('dp', 'pp'))
  vary = lambda x: jax.lax.pcast(x, ('dp',), to='varying')

  def local(params, batch, residual):
    params = jax.tree.map(vary, params)
    grad_fn = jax.value_and_grad(lambda p, x, y: loss_sum_fn(p, x, y, s, manual=True) / n_tokens)
    with sharding.use_rules(rules):
      if a == 1:
        loss, grads = grad_fn(params, batch['inputs'], batch['targets'])
      else:
        def body(acc, xy):
          return jax.tree.map(lambda u, v: u + v, acc, grad_fn(params, *xy)), None
        zeros = (vary(jnp.zeros((), jnp.float32)), jax.tree.map(jnp.zeros_like, params))
        xs = (chunked(batch['inputs'], a), chunked(batch['targets'], a))
        loss, grads = jax.lax.scan(body, zeros, xs)[0]
    loss = jax.lax.psum(loss, tuple(ax for ax in ('dp', 'pp') if ax in manual and ax in
                                    jax.typeof(loss).manual_axis_type.varying))
    return (loss, *reduce_keep_tp(grads, residual))

  def reduce_keep_tp(grads, residual):
    """gradcomm.reduce on each device's own tp block: in a shard_map nested over tp, so the
    partitioner cannot gather tp-sharded gradients before the dp collectives (it did: the dp
    wire carried full-tp arrays, and tp all-gathers were added)."""
    fn = lambda g, r: gradcomm.reduce(g, r, dims, dtype, dp, shard)
    if s.mesh.shape['tp'] == 1:
      return fn(grads, residual)
    tspec = lambda x, sh: _manual_spec(sh.spec, x.ndim, {'tp'})
    r_tp = (None if residual is None else
            jax.tree.map(tspec, residual, gradcomm.residual_shardings(params_sh, s.mesh)))
    nested = jax.shard_map(fn, in_specs=(jax.tree.map(tspec, params, params_sh), r_tp),
                           out_specs=(jax.tree.map(tspec, params, out_sh), r_tp),
                           axis_names={'tp'}, check_vma=True)
    return nested(grads, residual)

  fn = jax.shard_map(local, mesh=s.mesh, in_specs=(p_specs, P('dp'), r_specs),
                     out_specs=(P(), g_specs, r_specs), axis_names=manual, check_vma=True)
  return fn(params, batch, residual)


# ---------------------------------------------------------------------------------------------
# State, shardings, jitted functions
# ---------------------------------------------------------------------------------------------
def init_state(key, s: Setup):
  params = model_lib.init_params(key, s.dims, s.layer_order)
  state = {'step': jnp.zeros((), jnp.int32), 'params': params, 'opt_state': s.tx.init(params)}
  if has_residual(s):  # int8 error feedback: one residual per dp rank (gradcomm.py)
    state['grad_residual'] = gradcomm.init_residual(params, s.plan.dp)
  return state


def param_shardings(s: Setup):
  return sharding.tree_shardings(model_lib.param_logical_axes(s.dims), s.mesh, s.rules)


def state_shardings(s: Setup):
  params_sh = param_shardings(s)
  replicated = NamedSharding(s.mesh, P())
  abstract = jax.eval_shape(lambda k: init_state(k, s), jax.random.key(0))
  # ZeRO-1: the moments (every params-shaped leaf of the optimizer state) sharded over dp too.
  moments_sh = (gradcomm.zero_shardings(abstract['params'], params_sh, s.mesh, s.plan.dp)
                if zero1(s) else params_sh)
  opt_sh = optax.tree_map_params(s.tx, lambda _, sh: sh, abstract['opt_state'], moments_sh,
                                 transform_non_params=lambda _: replicated)
  out = {'step': replicated, 'params': params_sh, 'opt_state': opt_sh}
  if has_residual(s):
    out['grad_residual'] = gradcomm.residual_shardings(params_sh, s.mesh)
  return out


def zero_shardings(s: Setup):
  """The ZeRO-1 layout of parameter-shaped trees (moments, reduced gradients, the update)."""
  abstract = jax.eval_shape(lambda k: model_lib.init_params(k, s.dims, s.layer_order), jax.random.key(0))
  return gradcomm.zero_shardings(abstract, param_shardings(s), s.mesh, s.plan.dp)


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
  residual = state.get('grad_residual')
  with sharding.use_rules(s.rules):
    if explicit_reduction(s):
      loss, grads, residual = loss_and_grads_explicit(state['params'], batch, residual, s)
    else:
      loss, grads = loss_and_grads(state['params'], batch, s)
  params = state['params']
  if zero1(s):
    # ZeRO-1: gradients in the moments' layout (the dp all-reduce becomes a reduce-scatter, or the
    # explicit path already delivered the slices), the update on each rank's slice only.
    zsh = zero_shardings(s)
    grads = jax.lax.with_sharding_constraint(grads, zsh)
    params = jax.lax.with_sharding_constraint(params, zsh)
  drill = [int(x) for x in str(s.cfg.train.inject_nan_at).split(',') if x.strip()]
  if drill:  # fault drill (train.inject_nan_at): these steps see a NaN loss and NaN gradients
    nan = jnp.where(jnp.isin(state['step'] + 1, jnp.asarray(drill)), jnp.nan, 1.0)
    loss, grads = loss * nan, jax.tree.map(lambda g: g * nan, grads)
  grad_norm = optax.tree.norm(grads)
  updates, opt_state = s.tx.update(grads, state['opt_state'], params)
  new_params = optax.apply_updates(params, updates)
  ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  # apply_if_finite already skipped a non-finite gradient; a non-finite loss with finite
  # gradients (impossible in exact arithmetic, possible in overflowed bf16) is skipped here too.
  keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
  if zero1(s):  # all-gather the updated slices back to the parameters' own layout (then select:
    # selecting first would make XLA gather the old parameters as well)
    new_params = jax.lax.with_sharding_constraint(new_params, param_shardings(s))
  new_params = keep(new_params, state['params'])
  new_state = {'step': state['step'] + 1, 'params': new_params,
               'opt_state': keep(opt_state, state['opt_state'])}
  if residual is not None:
    new_state['grad_residual'] = keep(residual, state['grad_residual'])
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


def benchmark(s: Setup, steps: int, seed: int = 0) -> dict:
  """For the benchmark scripts: compiles the train step for a fresh state and a random batch and
  times `steps` calls (each waits for its loss). Returns the compiled step, compile seconds, the
  per-step seconds and the last metrics."""
  import time
  state = make_init(s)(seed)
  toks = np.random.default_rng(seed).integers(
      0, s.dims.vocab_size, (s.plan.global_batch, s.plan.seq_len + 1)).astype(np.int32)
  sh = batch_sharding(s)
  batch = {'inputs': jax.device_put(toks[:, :-1], sh), 'targets': jax.device_put(toks[:, 1:], sh)}
  t0 = time.perf_counter()
  compiled = make_train_step(s).lower(state, batch).compile()  # donates the state
  compile_s, times = time.perf_counter() - t0, []
  for _ in range(steps):
    t0 = time.perf_counter()
    state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics['loss'])
    times.append(time.perf_counter() - t0)
  return {'compiled': compiled, 'compile_s': compile_s, 'step_times': times, 'metrics': metrics}


def make_eval_step(s: Setup):
  b_sh = {'inputs': batch_sharding(s), 'targets': batch_sharding(s)}
  return MeshJit(lambda p, b: eval_step(p, b, s), s.mesh,
                 in_shardings=(state_shardings(s)['params'], b_sh), out_shardings=NamedSharding(s.mesh, P()))
