"""The devices a run is on, described: XLA flags for NVIDIA GPUs (gpu_flags.py), GPUs that are not
attached for compile-only targets (gpu_target.py, their descriptions in gpu_specs/), and the C
heap's tuning for XLA:CPU runs (cpu_heap.py)."""
