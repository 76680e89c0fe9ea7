"""The state a run starts from (`Trainer.init_state`), the first of these that applies:

  1. the newest checkpoint in WORKDIR/checkpoints that restores cleanly (a damaged one is passed
     over with a warning; one that does not match the config is CheckpointError), re-laid out if it
     was saved under another layout;
  2. a Hugging Face import (checkpoint.init_from=hf:PATH): the parameters read from the folder;
  3. a warm start (checkpoint.init_from=DIR): the parameters of that run's newest good checkpoint;
  4. a jitted, sharded init from train.seed.

2 and 3 build the state from their parameters (`step_lib.make_init_from_params`: fresh optimizer
moments, step 0) without a random init first.
"""

from __future__ import annotations

from collections.abc import Callable

from jax3d.hf import weights as hf_weights
from jax3d.record import Setup
from jax3d.trainer import checkpoint as ckpt_lib, workdir as workdir_lib
from jax3d.training import step as step_lib


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


def _restore(
  setup: Setup, checkpointer: ckpt_lib.Checkpointer, warn: Callable[[str], None]
) -> tuple[dict, str] | None:
  """The newest good checkpoint in this run's workdir; None when none of them can be used."""
  state, meta = checkpointer.restore_latest(setup.abstract_state, setup.layout, warn=warn)
  if state is None:
    return None
  saved = meta['layout']
  return state, (
    f'resumed from {checkpointer.directory}/{meta["step"]} (saved under dp={saved["dp"]} '
    f'pp={saved["pp"]} tp={saved["tp"]} repeats={saved["repeats"]}), next step {meta["step"]}'
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
  params, step = ckpt_lib.load_params(
    workdir_lib.checkpoint_dir(init_from),
    setup.abstract_state['params'],
    setup.layout,
    f'checkpoint.init_from={init_from}',
    warn=warn,
  )
  state = step_lib.make_init_from_params(setup)(params)
  return state, f'initialised, parameters warm-started from {init_from} (step {step})'
