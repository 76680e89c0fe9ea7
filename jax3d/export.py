"""`python -m jax3d.export --workdir=DIR --out=HF_DIR [--max_shard_mb=2048] [--config.KEY=VALUE ...]`

Writes the newest good checkpoint of a training run as a Hugging Face Llama folder: config.json,
generation_config.json, safetensors weights (split into files of at most --max_shard_mb, with an
index) and the run's tokenizer files, so that

  transformers.AutoModelForCausalLM.from_pretrained(HF_DIR)
  tokenizers.Tokenizer.from_file(HF_DIR + '/tokenizer.json')

load it. Any layout the run was trained on; --config.mesh.* reads it onto another one (this
machine's devices). One tensor at a time goes through the host (jax3d/hf/writer.py). The folder is
the architecture the run imported (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM) or the one its features need, tied where the run's embeddings are.

--verify (needs transformers and torch) loads the written folder in transformers and compares its
logits with jax3d's on the run's first held-out batch: it prints the largest relative difference
and exits 3 above 1e-4.

A LoRA run (lora.rank > 0) is written as a PEFT adapter folder (adapter_config.json,
adapter_model.safetensors) for its hf: base, which `peft.PeftModel.from_pretrained(base_model, DIR)`
loads (--verify: through peft); --merge writes the whole model with the adapters merged instead.

--out is written whole or not at all (jax3d/hf/outdir.py): into a temporary folder beside it,
verified there, then renamed into place, so no file of an earlier export remains. It may not be
a folder the run reads (its workdir, the model it was imported from, its tokenizer or data), nor
a file; a non-empty folder that is not an earlier jax3d export is replaced only with --overwrite.

Exit status: 0 written (and verified); 2 bad flags, an --out refused as above, or no checkpoint in
the workdir (one line on stderr); 3 a checkpoint that does not match its config, or an export that
fails --verify (--out left as it was).
"""

from __future__ import annotations

import sys

from jax3d import cli

FLAGS = {
  'workdir': cli.Flag(str, None, "a training run's workdir, holding checkpoints/", required=True),
  'out': cli.Flag(str, None, 'the Hugging Face folder to write', required=True),
  'max_shard_mb': cli.Flag(int, 2048, 'largest safetensors file, in MiB', cli.POSITIVE),
  'verify': cli.Flag(bool, False, "load the export in transformers and compare its logits with jax3d's"),
  'merge': cli.Flag(bool, False, 'a LoRA run: the whole model with the adapters merged, not a PEFT adapter'),
  'overwrite': cli.Flag(bool, False, 'replace a non-empty --out that is not an earlier jax3d export'),
}


def main(argv: list[str] | None = None) -> int:
  """Runs `python -m jax3d.export` with argv (default sys.argv[1:]); returns the exit status."""
  return cli.run_command(_export, cli.parse(sys.argv[1:] if argv is None else argv, __doc__, FLAGS))


def _export(args: cli.Args) -> int:
  cli.prepare_devices()
  from jax3d.trainer.workdir import export_workdir

  f = args.flags
  files = export_workdir(
    f['workdir'],
    f['out'],
    args.overrides,
    max_shard_bytes=f['max_shard_mb'] << 20,
    verify=f['verify'],
    merge=f['merge'],
    overwrite=f['overwrite'],
  )
  print(f'wrote {f["out"]}: {", ".join(files)}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
