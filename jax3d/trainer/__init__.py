"""A run's lifecycle: the Trainer, its loop, checkpoints, metrics, multi-host set-up, a finished
run's workdir."""
