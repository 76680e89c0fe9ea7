"""`python -m jax3d.eval --workdir=RUN --tasks=NAMES [--include_path=DIR] [--limit=N]
[--num_fewshot=K] [--batch_rows=N] [--out=FILE] [--config.KEY=VALUE ...]`
`python -m jax3d.eval --config.checkpoint.init_from=hf:PATH --tasks=NAMES ...`

Scores a training run's newest good checkpoint, or a Hugging Face folder, on lm-evaluation-harness
tasks (docs/evaluation.md), on this machine's devices in any layout (--config.mesh.*): jax3d is
lm-eval's model (jax3d/harness/model.py). Log-likelihood requests are packed several to a row
(segment ids and positions) and scored by the held-out evaluation's step program, --batch_rows
rows of train.seq_len per step (default: the run's batch, one accumulation chunk); generation
runs the KV-cache decoder, greedy unless the task samples.

Tasks are lm-eval's names (comma list), found in --include_path (a folder of task YAML files)
first. Offline: nothing is downloaded; a task whose data is not on this machine exits 2 with what
to do (a task YAML over local files: `dataset_path: json` and `dataset_kwargs: {data_files:
{test: /abs/path.jsonl}}`).

Prints lm-eval's results table and writes lm-eval's results JSON to --out (default:
WORKDIR/eval/<checkpoint step>.json; an hf: folder without --out is only printed).

Exit status: 0 evaluated; 2 bad flags, a bad config, an unknown task or one that needs the
network, lm-eval not installed (pip install 'jax3d[eval]'), no checkpoint in the workdir; 3 a
checkpoint that does not match the config.
"""

from __future__ import annotations

import sys

from jax3d import cli, errors

FLAGS = {
  'workdir': cli.Flag(
    str,
    None,
    "a training run's workdir, holding checkpoints/ (or --config.checkpoint.init_from=hf:PATH)",
    cli.ranges.FOLDER,
  ),
  'tasks': cli.Flag(str, None, "lm-eval task names, a comma list (e.g. 'my_mc,my_gen')", required=True),
  'include_path': cli.Flag(str, None, 'a folder of task YAML files, searched first'),
  'limit': cli.Flag(int, None, 'at most this many documents per task', cli.POSITIVE),
  'num_fewshot': cli.Flag(
    int, None, "few-shot examples per prompt (default: the task's own)", cli.NON_NEGATIVE
  ),
  'batch_rows': cli.Flag(int, None, 'rows per score step (default: the run batch)', cli.POSITIVE),
  'max_length': cli.Flag(int, None, 'tokens a request keeps (default: train.seq_len)', cli.POSITIVE),
  'out': cli.Flag(str, None, 'the results JSON (default: WORKDIR/eval/<step>.json)'),
}


def main(argv: list[str] | None = None) -> int:
  """Runs `python -m jax3d.eval` with argv (default sys.argv[1:]); returns the exit status."""
  return cli.run_command(_eval, cli.parse(sys.argv[1:] if argv is None else argv, __doc__, FLAGS))


def _eval(args: cli.Args) -> int:
  f = args.flags
  source, overrides = cli.model_source(args)
  from jax3d.harness import offline_tasks

  names = offline_tasks.split_names(f['tasks'])
  if not names:
    raise errors.UsageError(f'--tasks={f["tasks"]!r}: no task name')
  offline_tasks.require_lm_eval()
  offline_tasks.go_offline()
  cli.prepare_devices()  # before jax starts: 8 fake CPU devices unless XLA_FLAGS is set
  from jax3d.harness.model import JaxLM
  from jax3d.trainer import task_eval

  loaded = offline_tasks.load(names, f['include_path'])  # exit 2 here, before anything compiles
  overrides |= task_eval.batch_overrides(f['batch_rows'])
  setup, params, step = task_eval.load(source, overrides, config=args.config_path)
  lm = JaxLM(setup, params, f['max_length'])
  results = offline_tasks.evaluate(lm, loaded, f['limit'], f['num_fewshot'])
  print(offline_tasks.table(results))
  out = f['out'] or (task_eval.json_path(f['workdir'], step) if f['workdir'] else None)
  if out:
    extra = {'source': source, 'step': step, 'layout': setup.layout, 'packing': lm.stats}
    print(f'wrote {offline_tasks.write_json(results, out, extra)}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
