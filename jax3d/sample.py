"""`python -m jax3d.sample --workdir=DIR [--prompt="def "] [--tokens=200] [--temperature=0.8]
[--top_k=40] [--seed=0] [--greedy] [--config=PATH] [--config.KEY=VALUE ...]`

Text from the newest good checkpoint of a training run, on this machine's devices, in any
layout: the run's config is read from the checkpoint (unless --config is given) and
--config.mesh.* picks the layout to generate under (for example --config.mesh.dp=1
--config.mesh.pp=1 --config.mesh.tp=8). Only the parameters are read, straight into the new
layout's shardings, with the layer axis permuted from the saved pipeline order.

Decoding (generate.py) runs the layers in canonical order with a KV cache: one forward pass over
the prompt, then one token per step. Greedy with --greedy (or --temperature=0), else temperature
with top-k. On a machine without an accelerator 8 fake CPU devices are used (unless XLA_FLAGS
is set).

Exit status: 0 printed the text; 2 bad flags, a bad config or no checkpoint in the workdir
(one line on stderr); 3 a checkpoint that does not match the config.

In Python, `jax3d.sample(trainer_or_workdir, prompt, ...)` does the same: this module is callable.
"""
from __future__ import annotations

import sys
import types

from jax3d.tools.sampling import NoCheckpoint, sample_workdir

FLAGS = {'workdir': None, 'prompt': None, 'tokens': None, 'temperature': None, 'top_k': None,
         'seed': '0', 'greedy': False}

def parse(argv: list[str]):
  """(flags, config_path, overrides), or an exit status after printing one line."""
  from jax3d import cli
  flags, config_path, overrides = dict(FLAGS), None, {}
  for arg in argv:
    if not arg.startswith('--'):
      return cli.fail(f'unexpected argument {arg!r} (flags are --name=value)')
    key, eq, value = arg[2:].partition('=')
    key = key if key.startswith('config.') else key.replace('-', '_')
    if key in ('help', 'h'):
      print(__doc__)
      return 0
    if key == 'config':
      config_path = value
    elif key.startswith('config.') and eq:
      overrides[key[len('config.'):]] = value
    elif key == 'greedy':
      flags['greedy'] = (value.lower() in ('1', 'true', 'yes')) if eq else True
    elif key in flags and eq:
      flags[key] = value
    else:
      return cli.fail(f'unknown flag or missing value: {arg!r}; valid: ' + ', '.join(
          f'--{k}' for k in FLAGS) + ', --config=PATH, --config.KEY=VALUE')
  if not flags['workdir']:
    return cli.fail('--workdir=DIR is required (a training run\'s workdir, holding checkpoints/)')
  for key, kind in (('tokens', int), ('temperature', float), ('top_k', int), ('seed', int)):
    if flags[key] is not None:
      try:
        flags[key] = kind(flags[key])
      except ValueError:
        return cli.fail(f'--{key}={flags[key]!r} is invalid: {kind.__name__} expected')
  if flags['tokens'] is not None and flags['tokens'] < 0:
    return cli.fail(f'--tokens={flags["tokens"]} is invalid: must be >= 0')
  return flags, config_path, overrides


def main(argv=None) -> int:
  args = parse(sys.argv[1:] if argv is None else argv)
  if isinstance(args, int):
    return args
  flags, config_path, overrides = args
  from jax3d import cli
  cli.prepare_devices()  # before jax starts: 8 fake CPU devices unless XLA_FLAGS is set
  from jax3d import config as config_lib
  from jax3d.training import checkpoint as ckpt_lib
  try:
    text = sample_workdir(flags['workdir'], flags['prompt'], flags['tokens'],
                          0.0 if flags['greedy'] else flags['temperature'], flags['top_k'], flags['seed'],
                          config=config_path, overrides=overrides)
  except (NoCheckpoint, config_lib.ConfigError) as e:
    return cli.fail(e)
  except ckpt_lib.CheckpointError as e:
    print(f'error: {e}', file=sys.stderr)
    return 3
  print(text)
  return 0


class _CallableModule(types.ModuleType):
  """`jax3d.sample` is this module (so `python -m jax3d.sample` and `import jax3d.sample` work)
  and also the API function `jax3d.sample(trainer_or_workdir, prompt, ...)`: a package attribute
  cannot be both a function and a submodule, so the module forwards calls to `api.sample`."""

  def __call__(self, *args, **kwargs):
    from jax3d import api
    return api.sample(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == '__main__':
  sys.exit(main())
