"""Parity of an export: the exported folder loaded in transformers gives jax3d's logits.

`python -m jax3d.export --verify` runs it after writing: the run's first held-out batch through
jax3d (the checkpoint's parameters, on this machine's layout) and through
`AutoModelForCausalLM.from_pretrained(out)` in float32 on the CPU; the largest difference relative
to the logits' scale must stay under TOLERANCE, else the export is reported wrong (exit 3). A
LoRA run's PEFT adapter folder is loaded by peft onto its hf: base.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from jax3d.errors import CheckpointError

if TYPE_CHECKING:
  from jax3d.setup import Setup

TOLERANCE = 1e-4


def jax3d_logits(setup: Setup, params: Any, tokens_bt: np.ndarray) -> np.ndarray:
  """fp32 logits [b, t, vocab] (the real vocabulary) of `tokens_bt`, computed as training computes
  them (the run's mesh, logical rules and shardings); b is one accumulation chunk's rows. A mixture
  of experts with a capacity that drops nothing (moe.capacity_factor = E/k): transformers' experts
  take every token."""
  import dataclasses

  import jax

  from jax3d import loss as loss_lib, step as step_lib
  from jax3d.parallel import sharding

  if setup.dims.n_experts:
    dropless = dataclasses.replace(setup.dims, capacity_factor=setup.dims.n_experts / setup.dims.top_k)
    setup = dataclasses.replace(setup, dims=dropless)

  def fn(params, tokens_bt):
    with sharding.use_rules(setup.rules):
      return loss_lib.logits(params, tokens_bt, setup)

  jitted = step_lib.MeshJit(fn, setup.mesh, in_shardings=(setup.param_shardings, setup.batch_sharding))
  out = jitted(params, jax.device_put(np.asarray(tokens_bt, np.int32), setup.batch_sharding))
  return np.asarray(jax.device_get(out))[..., : setup.dims.vocab_size]


def transformers_logits(folder: str, tokens_bt: np.ndarray, adapter: str | None = None) -> np.ndarray:
  """fp32 logits of `tokens_bt` from the Hugging Face folder, loaded by transformers on the CPU
  (with the PEFT adapter folder `adapter` loaded onto it by peft, when given)."""
  try:
    import torch
    import transformers

    if adapter is not None:
      import peft
  except ImportError as e:
    raise CheckpointError(
      f'--verify needs transformers, torch and peft ({e}); pip install jax3d[test]'
    ) from None
  model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
  if adapter is not None:
    model = peft.PeftModel.from_pretrained(model, adapter).eval()
  with torch.no_grad():
    return model(torch.as_tensor(np.asarray(tokens_bt), dtype=torch.long)).logits.float().numpy()


def relative_difference(ours: np.ndarray, theirs: np.ndarray) -> float:
  """max |ours - theirs| / max |theirs|: the difference relative to the logits' scale."""
  return float(np.max(np.abs(ours - theirs)) / max(float(np.max(np.abs(theirs))), 1e-30))


def verify(
  setup: Setup,
  params: Any,
  folder: str,
  tokens_bt: np.ndarray,
  name: str | None = None,
  adapter: str | None = None,
) -> float:
  """The relative difference of the export at `folder` (called `name` in the error; with the PEFT
  adapter folder `adapter` on it, for a LoRA run's adapter export) from jax3d on `tokens_bt`;
  CheckpointError (exit 3) above TOLERANCE."""
  theirs = transformers_logits(folder, tokens_bt, adapter)
  diff = relative_difference(jax3d_logits(setup, params, tokens_bt), theirs)
  if not diff <= TOLERANCE:
    raise CheckpointError(
      f"--verify: the export at {name or folder} gives logits {diff:.3g} off jax3d's (relative, largest), "
      f'above {TOLERANCE:g}: transformers does not compute the model jax3d trained'
    )
  return diff


def held_out_tokens(setup: Setup) -> np.ndarray:
  """The run's first held-out batch of inputs (one accumulation chunk's rows), as evaluation reads it;
  the first training batch's where the data has no held-out split."""
  from jax3d.data import corpus as corpus_lib, mixture as mixture_lib, tokenizer as tokenizer_lib

  cfg, plan = setup.cfg, setup.plan
  corpus = mixture_lib.for_config(cfg, tokenizer_lib.load(cfg.data.tokenizer))
  if not corpus.evaluable:
    return corpus_lib.batch_at(corpus, cfg.train.seed, 0, plan.chunk_batch, plan.seq_len)['inputs']
  return mixture_lib.eval_batches(corpus, cfg.train.seed, 1, plan.chunk_batch, plan.seq_len)[0][1]['inputs']


def verify_export(setup: Setup, params: Any, folder: str, name: str, adapter: str | None = None) -> None:
  """`verify` on the run's first held-out batch (held_out_tokens), with one line saying so for the
  export `name` (written at `folder`, where it is loaded from, or a PEFT adapter written at
  `adapter` for the base `folder`); CheckpointError above TOLERANCE."""
  tokens = held_out_tokens(setup)
  diff = verify(setup, params, folder, tokens, name, adapter)
  print(
    f"verified {name}: transformers gives jax3d's logits on {tokens.shape[0]}x{tokens.shape[1]} "
    f'held-out tokens within {diff:.2e} (relative, largest; tolerance {TOLERANCE:g})'
  )
