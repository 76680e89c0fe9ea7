"""lm-evaluation-harness tasks on a run: after training (`python -m jax3d.eval`: a run's newest
checkpoint or an hf: folder, in any layout) and during it (`eval.tasks`, every
`eval.tasks_every` steps and at the end: scores in metrics.jsonl, TensorBoard and the report).

The model is jax3d/harness/model.py's `JaxLM` over the run's Setup and parameters; the tasks come
from local files only (jax3d/harness/offline_tasks.py). Results: lm-eval's table, and its JSON in
WORKDIR/eval/<step>.json.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from jax3d.harness import offline_tasks

if TYPE_CHECKING:
  import jax

  from jax3d.config import Config
  from jax3d.setup import Setup


def json_path(workdir: str, step: int) -> str:
  """Where the results of the checkpoint (or training step) `step` go: WORKDIR/eval/<step>.json."""
  return os.path.join(workdir, 'eval', f'{step}.json')


def batch_overrides(batch_rows: int | None) -> dict:
  """The config overrides of --batch_rows: rows per score step (one chunk: no accumulation)."""
  return {'train.global_batch_size': batch_rows, 'train.grad_accum': 1} if batch_rows else {}


def load(
  source: str,
  overrides: Mapping[str, Any] | None = None,
  config: str | None = None,
  devices: Sequence[jax.Device] | None = None,
) -> tuple[Setup, Any, int | None]:
  """(setup, params, step) to evaluate: a run's workdir (its newest good checkpoint, its saved
  config unless `config`; step: the checkpoint's) or 'hf:PATH' (a Hugging Face folder imported
  with its tokenizer; step None), in the layout `overrides` sets (mesh.*) on these devices."""
  import jax

  from jax3d import assemble, config as config_lib
  from jax3d.hf import weights
  from jax3d.trainer import workdir as workdir_lib

  devices = list(devices if devices is not None else jax.devices())
  overrides = dict(overrides or {})
  if source.startswith('hf:'):
    cfg = config_lib.load_config(config or 'tiny', {**overrides, 'checkpoint.init_from': source})
    cfg = workdir_lib.sampling_config(assemble.resolve(cfg), len(devices), overrides)
    dp, pp, tp = config_lib.resolve_mesh(cfg.mesh.dp, cfg.mesh.pp, cfg.mesh.tp, len(devices))
    setup = assemble.build(cfg, devices[: dp * pp * tp])
    return setup, weights.load_params(setup), None
  workdir_lib.checkpoint_steps(source)
  cfg = config_lib.load_config(config) if config else workdir_lib.saved_config(source)
  cfg = workdir_lib.sampling_config(cfg, len(devices), overrides)
  dp, pp, tp = config_lib.resolve_mesh(cfg.mesh.dp, cfg.mesh.pp, cfg.mesh.tp, len(devices))
  return workdir_lib.load_params(source, cfg, devices[: dp * pp * tp], saved=not config)


def check(cfg: Config) -> None:
  """eval.tasks of a training config, before anything compiles: lm-eval installed, every task
  found and its data read locally (UsageError, exit 2, naming the task otherwise)."""
  if cfg.eval.tasks:
    offline_tasks.load(offline_tasks.split_names(cfg.eval.tasks), cfg.eval.tasks_include_path or None)


class TaskEvaluator:
  """The tasks of `eval.tasks` on a training run's current parameters: one JaxLM (its compiled
  score step kept between evaluations), lm-eval's results, their flat scores."""

  def __init__(self, setup: Setup) -> None:
    from jax3d.harness.model import JaxLM

    self.cfg = setup.cfg
    self.lm = JaxLM(setup, None)

  def __call__(self, params: Any) -> dict:
    """lm-eval's results dict of the tasks on `params`."""
    e = self.cfg.eval
    self.lm.params = params
    loaded = offline_tasks.load(offline_tasks.split_names(e.tasks), e.tasks_include_path or None)
    limit, shots = e.tasks_limit or None, None if e.tasks_num_fewshot < 0 else e.tasks_num_fewshot
    return offline_tasks.evaluate(self.lm, loaded, limit, shots, bootstrap_iters=0)
