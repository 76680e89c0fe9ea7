"""`python -m jax3d.sample --workdir=DIR [--prompt="def "] [--tokens=200] [--temperature=0.8]
[--top_k=40] [--seed=0] [--greedy] [--config=PATH] [--config.KEY=VALUE ...]`
`python -m jax3d.sample --config.checkpoint.init_from=hf:PATH --prompt=... [--config.mesh.tp=8 ...]`

Text from a Hugging Face folder (its weights and its tokenizer, imported onto this machine's
devices in the layout --config.mesh.* sets; no training run, no Orbax), or from the newest good
checkpoint of a training run, on this machine's devices, in any layout: the run's config is read
from the checkpoint (unless --config is given) and --config.mesh.* picks the layout to generate
under (for example --config.mesh.dp=1 --config.mesh.pp=1 --config.mesh.tp=8). Only the parameters
are read, straight into the new layout's shardings, with the layer axis permuted from the saved
pipeline order.

Decoding (jax3d/model/generate.py) runs the layers in canonical order with a KV cache: one forward pass over
the prompt, then one token per step. Greedy with --greedy (or --temperature=0), else temperature
with top-k. On a machine without an accelerator 8 fake CPU devices are used (unless XLA_FLAGS
is set).

Exit status: 0 printed the text; 2 bad flags, a bad config, a folder that does not load or no
checkpoint in the workdir (one line on stderr); 3 a checkpoint that does not match the config.

In Python, `jax3d.sample(trainer_or_workdir, prompt, ...)` does the same: this module is callable
(it forwards to `jax3d.trainer.workdir.sample`, see `_CallableModule`).
"""

from __future__ import annotations

import sys
import types

from jax3d import cli
from jax3d.trainer.workdir import sample_hf, sample_workdir

FLAGS = {
  'workdir': cli.Flag(
    str,
    None,
    "a training run's workdir, holding checkpoints/ (or --config.checkpoint.init_from=hf:PATH)",
    cli.ranges.FOLDER,
  ),
  'prompt': cli.Flag(str, None, "the text to continue (default: the config's sample.prompt)"),
  # The ranges of the config keys these flags set (jax3d/config/keys.py).
  'tokens': cli.Flag(
    int, None, 'tokens to generate (default: sample.tokens)', cli.key_range('sample.tokens')
  ),
  'temperature': cli.Flag(
    float,
    None,
    'sampling temperature, 0 = greedy (default: sample.temperature)',
    cli.key_range('sample.temperature'),
  ),
  'top_k': cli.Flag(
    int,
    None,
    'sample among the k likeliest tokens, 0 = all (default: sample.top_k)',
    cli.key_range('sample.top_k'),
  ),
  'seed': cli.Flag(int, 0, 'random seed of the sampling', cli.ranges.SEED),
  'greedy': cli.Flag(bool, False, 'always the likeliest byte (same as --temperature=0)'),
}


def main(argv: list[str] | None = None) -> int:
  """Runs `python -m jax3d.sample` with argv (default sys.argv[1:]); returns the exit status.

  The --config.KEY=VALUE overrides are checked against the default config's keys and types here,
  then applied to the config the text is generated with (the checkpoint's, unless --config)."""
  return cli.run_command(_sample, cli.parse(sys.argv[1:] if argv is None else argv, __doc__, FLAGS))


def _sample(args: cli.Args) -> int:
  f = args.flags
  source, overrides = cli.model_source(args)
  cli.prepare_devices()  # before jax starts: 8 fake CPU devices unless XLA_FLAGS is set
  sampler = sample_workdir if f['workdir'] else sample_hf
  text = sampler(
    source,
    f['prompt'],
    f['tokens'],
    0.0 if f['greedy'] else f['temperature'],
    f['top_k'],
    f['seed'],
    config=args.config_path,
    overrides=overrides,
  )
  print(text)
  return 0


class _CallableModule(types.ModuleType):
  """Why this class: `jax3d.sample` must be both this command's module (so that
  `python -m jax3d.sample` and `import jax3d.sample` work) and the API function
  `jax3d.sample(trainer_or_workdir, prompt, ...)`. A package attribute cannot be both a function
  and a submodule, so the module's class is replaced by this one, whose calls forward to the
  function `jax3d.trainer.workdir.sample` (which `jax3d.api` re-exports as `api.sample`)."""

  def __call__(self, *args, **kwargs):
    from jax3d.trainer import workdir as sampling

    return sampling.sample(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == '__main__':
  sys.exit(main())
