"""What a compiled step costs: memory, FLOPs and collectives read from XLA, per-device memory, plots."""
