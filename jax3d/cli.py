"""The one command-line convention of the jax3d commands (train, plan, inspect, report, sample, eval).

Each command declares its flags as a dict `name -> Flag(type, default, help, check, required)` and
calls `parse(argv, __doc__, FLAGS, config=..., positional=...)`, which understands:

  --config=PATH               the config file, or a name in configs/ (commands that take a config)
  --config.KEY=VALUE          one config override; an unknown key is rejected with the valid ones
                              listed, the value is converted to the type of the key's default
  --name=VALUE, --name VALUE  a declared flag, converted to its type (str, int, float or bool);
                              --a-b and --a_b are the same flag
  --name, --name=true|false   a bool flag (also 1/0, yes/no; --noname sets it false)
  WORD ...                    positional arguments, for a command that declares them (report's WORKDIR)
  -h, --help                  (anywhere) the command's docstring and its flags, exit status 0

Bad input gives one line `error: ...` on stderr that names the flag, its value and what is valid,
and exit status 2, before jax starts: nothing here imports jax, and the config file is loaded and
its overrides checked during parsing.

Every command maps its errors to exit statuses here, by the error's type (jax3d/errors.py: 2 bad
input, 3 the run failed): `run_command(body, parse(...))` runs the command's body and turns a
jax3d error into its one `error:` line and status; `fail(e)` does it for one error or message.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from jax3d import errors
from jax3d.config import ranges

# A flag's range is a jax3d.config.ranges.Range (the vocabulary of the config keys' ranges too):
# `Flag(int, 0, help, NON_NEGATIVE)`; a flag that sets the same thing as a config key takes the
# key's own range (`key_range('sample.temperature')`), so the two never disagree.
POSITIVE = ranges.above(0)
NON_NEGATIVE = ranges.at_least(0)
one_of = functools.partial(ranges.one_of, fold_case=True)  # --distributed=AUTO too


def key_range(key: str) -> ranges.Range:
  """The declared range of config key `key` (jax3d/config/keys.py), for a flag that sets it."""
  from jax3d.config import forms

  return forms.ranges()[key]


def _target_check() -> ranges.Range:
  from jax3d.devices import gpu_target  # no jax: the GPU target descriptions and their form

  return ranges.Range(lambda v: v == '' or gpu_target.is_target(v), gpu_target.FORM)


class Flag(NamedTuple):
  """One declared flag: its type (str, int, float or bool), its default (None: not given), one line
  of help, its range (a jax3d.config.ranges.Range of the converted value; None: any value of
  the type), and whether it must be given."""

  type: type
  default: Any = None
  help: str = ''
  check: ranges.Range | None = None
  required: bool = False


TARGET = Flag(
  str,
  '',
  'compile for GPUs that are not attached: KINDxN, e.g. h100x8, h200x16, a100x8 (needs jax3d[cuda12])',
  _target_check(),
)


@dataclasses.dataclass
class Args:
  """What `parse` read.

  flags: every declared flag's value (its default when not given).
  cfg: the loaded config with the overrides applied (None for a command without a config).
  config_path: --config as given, None when absent (the default config was loaded).
  overrides: the --config.KEY=VALUE pairs as given (strings), already checked against cfg.
  positional: the positional arguments, as many as the command declares.
  given: the flags given on the command line, as written.
  """

  flags: dict[str, Any]
  cfg: Any = None
  config_path: str | None = None
  overrides: dict[str, str] = dataclasses.field(default_factory=dict)
  positional: list[str] = dataclasses.field(default_factory=list)
  given: dict[str, str] = dataclasses.field(default_factory=dict)  # the flags given, as written

  @property
  def config_name(self) -> str:
    """The config's file name without its extension ('tiny' for the default config)."""
    from jax3d import config as config_lib

    path = self.config_path or config_lib.default_config_path()
    return os.path.splitext(os.path.basename(path))[0]


def fail(err: BaseException | str) -> int:
  """Prints `error: err` as one line on stderr; returns the exit status its type means
  (errors.exit_status: 2 bad input, 3 the run failed; a plain message is bad input)."""
  return errors.report(err)


def run_command(body: Callable[[Args], int], args: Args | int, *also: type[Exception]) -> int:
  """A command's exit status: `args` as `parse` returned it (an int: --help or bad flags, returned
  as is), else `body(args)`, where a jax3d error (or one of the types in `also`, e.g. ValueError)
  becomes its one `error:` line on stderr and the exit status of its type (`fail`)."""
  if isinstance(args, int):
    return args
  from jax3d.devices import gpu_target

  gpu_target.hide_unusable_plugin()  # before the body imports jax, which reads JAX_PLATFORMS once
  try:
    return body(args)
  except (errors.Jax3dError, *also) as e:
    return fail(e)


_TRUE, _FALSE = ('1', 'true', 'yes'), ('0', 'false', 'no')
_KIND = {str: 'a string', int: 'an integer', float: 'a number', bool: 'true or false'}


def _convert(name: str, flag: Flag, text: str) -> Any:
  if flag.type is bool:
    if text.lower() in _TRUE + _FALSE:
      return text.lower() in _TRUE
  else:
    try:
      return flag.type(text)
    except ValueError:
      pass
  raise errors.UsageError(
    f'--{name}={text!r} is invalid: expected {_KIND.get(flag.type, flag.type.__name__)}'
  )


def help_text(
  doc: str | None,
  flags: Mapping[str, Flag] | None = None,
  config: bool = True,
  positional: Mapping[str, str] | None = None,
) -> str:
  """The command's docstring, then its arguments and flags with their types and defaults."""
  rows = list((positional or {}).items())
  if config:
    rows += [
      ('--config=PATH', 'config file, or a name in configs/ (default: configs/tiny.py)'),
      ('--config.KEY=VALUE', 'override one config key (e.g. --config.mesh.tp=4)'),
    ]
  for name, f in (flags or {}).items():
    default = '' if f.default is None or f.type is bool else f' (default: {f.default})'
    spec = f'--{name}' if f.type is bool else f'--{name}={f.type.__name__.upper()}'
    rows.append((spec, f.help + (' (required)' if f.required else default)))
  rows.append(('-h, --help', 'this text'))
  width = max(len(spec) for spec, _ in rows) + 2
  return '\n'.join(
    [(doc or '').strip(), '', 'Arguments and flags:']
    + [f'  {spec:<{width}}{what}'.rstrip() for spec, what in rows]
  )


def parse(
  argv: Sequence[str],
  doc: str | None,
  flags: Mapping[str, Flag] | None = None,
  *,
  config: bool = True,
  positional: Mapping[str, str] | None = None,
) -> Args | int:
  """Reads a command's arguments (see the module docstring). Returns Args, or an exit status after
  printing: 0 for --help (the help on stdout), 2 for bad input (one `error:` line on stderr).

  `doc` is the command's module docstring (printed by --help); `flags` its declared flags;
  `config` whether it takes --config and --config.KEY=VALUE (the config is then loaded, so a bad
  path, key or value fails here); `positional` its positional arguments, all required, as
  name -> help.
  """
  flags, positional = dict(flags or {}), dict(positional or {})
  if any(arg in ('-h', '-help', '--help') for arg in argv):
    print(help_text(doc, flags, config, positional))
    return 0
  try:
    args = _scan(list(argv), flags, config, positional)
    if config:
      from jax3d import config as config_lib

      args.cfg = config_lib.load_config(args.config_path, args.overrides)  # set_key converts the types
      config_lib.check_ranges(args.cfg)  # every key in its range, for every command (batch too)
    for key, value in args.given.items():  # each given flag in its declared range
      check = flags[key].check
      if check is not None and not check.ok(args.flags[key]):
        raise errors.UsageError(f'--{key}={value} is invalid: {check.words(flags[key].type)}')
  except (errors.UsageError, errors.ConfigError) as e:
    return fail(e)
  return args


def _scan(argv: list[str], flags: dict[str, Flag], config: bool, positional: dict[str, str]) -> Args:
  args = Args({name: f.default for name, f in flags.items()})
  valid = ['--config=PATH', '--config.KEY=VALUE'] if config else []
  valid += [f'--{name}' for name in flags] + ['--help']
  usage = f'; valid: {", ".join(valid)}' + (f'; arguments: {" ".join(positional)}' if positional else '')
  while argv:
    arg = argv.pop(0)
    if not arg.startswith('-') or arg == '-':
      args.positional.append(arg)
      continue
    name, eq, value = arg[2 if arg.startswith('--') else 1 :].partition('=')
    is_config = config and (name == 'config' or name.startswith('config.'))
    key = name if is_config else name.replace('-', '_')
    flag = None if is_config else flags.get(key)
    if flag is None and not is_config:
      negated = flags.get(key[2:]) if key.startswith('no') else None
      if negated is None or negated.type is not bool or eq:
        raise errors.UsageError(f'unknown flag {arg}{usage}')
      args.flags[key[2:]] = False
      continue
    if not eq and flag is not None and flag.type is bool:
      value = 'true'
    elif not eq:  # --name VALUE
      if not argv or argv[0].startswith('--'):
        raise errors.UsageError(f'--{name} needs a value: --{name}=VALUE')
      value = argv.pop(0)
    if name == 'config' and is_config:
      args.config_path = value
    elif is_config:
      args.overrides[name[len('config.') :]] = value
    else:
      args.flags[key] = _convert(key, flag, value)
      args.given[key] = value
  for name, f in flags.items():
    if f.required and args.flags[name] in (None, ''):
      raise errors.UsageError(f'--{name} is required: {f.help}')
  if len(args.positional) != len(positional):
    if not positional:
      raise errors.UsageError(f'unexpected argument {args.positional[0]!r}{usage}')
    raise errors.UsageError(
      f'expected {" ".join(positional)}, got {len(args.positional)} argument(s) {args.positional!r}{usage}'
    )
  return args


def prepare_devices(n: int = 8) -> None:
  """Call before jax starts its backend. On a machine without an accelerator, exposes n fake CPU
  devices unless XLA_FLAGS is set; on a GPU machine, adds the communication-overlap XLA flags
  (jax3d/devices/gpu_flags.py; JAX3D_NO_GPU_FLAGS=1: off)."""
  from jax3d.devices import gpu_flags, gpu_target
  from jax3d.parallel.mesh import use_fake_cpu_devices

  gpu_target.hide_unusable_plugin()  # a CUDA plugin without a GPU: its start-up check would print a traceback
  use_fake_cpu_devices(n)
  gpu_flags.apply_gpu_flags()


def model_source(args: Args) -> tuple[str, dict[str, Any]]:
  """(the model a reading command runs: --workdir or --config.checkpoint.init_from=hf:PATH, the
  other --config overrides). UsageError where neither or both are given."""
  f = args.flags
  init_from = args.overrides.get('checkpoint.init_from', '')
  if not f['workdir'] and not init_from.startswith('hf:'):
    raise errors.UsageError('give --workdir=DIR (a training run) or --config.checkpoint.init_from=hf:PATH')
  if f['workdir'] and init_from:
    raise errors.UsageError('give --workdir or --config.checkpoint.init_from, not both')
  return f['workdir'] or init_from, {k: v for k, v in args.overrides.items() if k != 'checkpoint.init_from'}
