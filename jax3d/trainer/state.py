"""The state a run starts from (`Trainer.init_state`), the first of these that applies:

  1. the newest checkpoint in WORKDIR/checkpoints that restores cleanly (a damaged one is passed
     over with a warning; one that does not match the config is CheckpointError), re-laid out if it
     was saved under another layout;
  2. a Hugging Face import (checkpoint.init_from=hf:PATH): the parameters read from the folder;
  3. a warm start (checkpoint.init_from=DIR): the parameters of that run's newest good checkpoint;
  4. a jitted, sharded init from train.seed.

2 and 3 build the state from their parameters (`step_lib.make_init_from_params`: fresh optimizer
moments, step 0) without a random init first.

With LoRA (lora.rank > 0) a checkpoint holds the adapters and their optimizer state only (`saved`),
and its meta where the frozen base came from (`base_source`): a resume reads the adapters and
builds the base again from there (`base_params`: the hf: import, the warm start's run, or the
seed), the same bits every time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jax3d import step as step_lib
from jax3d.config import Config
from jax3d.errors import CheckpointError
from jax3d.hf import weights as hf_weights
from jax3d.model import lora, quant
from jax3d.setup import Setup
from jax3d.trainer import checkpoint as ckpt_lib
from jax3d.trainer.rundir import checkpoint_dir


def initial_state(
  setup: Setup, checkpointer: ckpt_lib.Checkpointer | None, warn: Callable[[str], None]
) -> tuple[dict, str]:
  """The sharded train state (see the module docstring) and one line that says where it came from."""
  if checkpointer and checkpointer.steps():
    restored = _restore(setup, checkpointer, warn)
    if restored is not None:
      return restored
  if setup.hf is not None:
    return _import_hf(setup)
  if setup.cfg.checkpoint.init_from:
    return _warm_start(setup, warn)
  seed = setup.cfg.train.seed
  return step_lib.make_init(setup)(seed), f'initialised from seed {seed}'


def saved(setup: Setup, state: dict) -> dict:
  """What a checkpoint holds of the train state `state` (or of its abstract form): all of it, but
  with LoRA only the adapters of the parameters (the base is rebuilt on resume, `base_params`)."""
  return {**state, 'params': lora.trainable(setup.dims, state['params'])[0]}


def base_source(cfg: Config) -> str:
  """Where a LoRA run's frozen base comes from, as its checkpoints record it."""
  return cfg.checkpoint.init_from or f'seed:{cfg.train.seed}'


def base_params(setup: Setup, warn: Callable[[str], None]) -> Any:
  """LoRA's frozen base, sharded: the hf: import's weights, the warm start's parameters, or the
  seed's initialisation (`base_source`)."""
  if setup.hf is not None:
    return hf_weights.load_base(setup)
  init_from = setup.cfg.checkpoint.init_from
  if init_from:
    abstract = lora.trainable(setup.dims, setup.abstract_state['params'])[1]
    if not setup.dims.base_int8:
      return _warm_params(setup, abstract, warn)[0]
    # an int8 base from a float run: restored in float (the kernels in the base's float dtype), quantized
    as_float = lambda a: jax.ShapeDtypeStruct(a.shape, setup.dims.param_dtype, sharding=a.sharding)
    floats = jax.tree.map(lambda a: as_float(a) if a.dtype == jnp.int8 else a, quant.without_scales(abstract))
    shardings = jax.tree.map(lambda a: a.sharding, abstract)
    fn = step_lib.MeshJit(lambda p: quant.quantized(setup.dims, p), setup.mesh, out_shardings=shardings)
    return fn(_warm_params(setup, floats, warn)[0])
  return lora.trainable(setup.dims, step_lib.make_init(setup)(setup.cfg.train.seed)['params'])[1]


def _warm_params(setup: Setup, abstract: Any, warn: Callable[[str], None]) -> tuple[Any, int]:
  """(parameters shaped like `abstract`, step) of checkpoint.init_from's newest good checkpoint."""
  init_from = setup.cfg.checkpoint.init_from
  directory = checkpoint_dir(init_from)
  return ckpt_lib.load_params(
    directory, abstract, setup.layout, f'checkpoint.init_from={init_from}', warn=warn
  )


def checkpoint_params(setup: Setup, workdir: str, warn: Callable[[str], None]) -> tuple[Any, int]:
  """(parameters, step) of the newest good checkpoint of the run `workdir`, in setup's layout; a
  LoRA run's adapters over its base (`base_params`)."""
  abstract = saved(setup, setup.abstract_state)['params']
  directory = checkpoint_dir(workdir)
  params, step = ckpt_lib.load_params(directory, abstract, setup.layout, f'--workdir={workdir}', warn=warn)
  if setup.dims.lora_rank:
    params = lora.merge(params, base_params(setup, warn))
  return params, step


def _restore(
  setup: Setup, checkpointer: ckpt_lib.Checkpointer, warn: Callable[[str], None]
) -> tuple[dict, str] | None:
  """The newest good checkpoint in this run's workdir; None when none of them can be used."""
  state, meta = checkpointer.restore_latest(saved(setup, setup.abstract_state), setup.layout, warn=warn)
  if state is None:
    return None
  if setup.dims.lora_rank:
    if meta.get('lora_base') != base_source(setup.cfg):
      raise CheckpointError(
        f'checkpoint {checkpointer.directory}/{meta["step"]} holds LoRA adapters of the base '
        f"{meta.get('lora_base')!r}; this run's base is {base_source(setup.cfg)!r} (checkpoint.init_from)"
      )
    state['params'] = lora.merge(state['params'], base_params(setup, warn))
  saved_layout = meta['layout']
  return state, (
    f'resumed from {checkpointer.directory}/{meta["step"]} (saved under dp={saved_layout["dp"]} '
    f'pp={saved_layout["pp"]} cp={saved_layout.get("cp", 1)} tp={saved_layout["tp"]} repeats={saved_layout["repeats"]}), next step {meta["step"]}'
  )


def _import_hf(setup: Setup) -> tuple[dict, str]:
  """The parameters straight from the Hugging Face folder, no random init first."""
  state = step_lib.make_init_from_params(setup)(hf_weights.load_params(setup))
  hf = setup.hf
  return (
    state,
    f'initialised, parameters imported from {hf.path} (Hugging Face {hf.config["architectures"][0]})',
  )


def _warm_start(setup: Setup, warn: Callable[[str], None]) -> tuple[dict, str]:
  """The parameters of checkpoint.init_from's newest good checkpoint, re-laid out to this run's."""
  init_from = setup.cfg.checkpoint.init_from
  if setup.dims.lora_rank:  # the base from the run, fresh adapters from the seed
    base = base_params(setup, warn)
    fresh = step_lib.make_init(setup)(setup.cfg.train.seed)['params']
    state = step_lib.make_init_from_params(setup)(lora.merge(lora.trainable(setup.dims, fresh)[0], base))
    return state, f'initialised, LoRA adapters on the parameters of {init_from}'
  params, step = _warm_params(setup, setup.abstract_state['params'], warn)
  state = step_lib.make_init_from_params(setup)(params)
  return state, f'initialised, parameters warm-started from {init_from} (step {step})'
