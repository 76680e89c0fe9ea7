"""The cluster an estimate prices (`Hardware`), and the byte sizes it counts in."""

from __future__ import annotations

import dataclasses

GB = 1e9
BYTES = {'float32': 4, 'bfloat16': 2, 'int8': 1}  # bytes per element of each dtype a config names


@dataclasses.dataclass(frozen=True)
class Hardware:
  """One cluster. Defaults: an H100/H200 SXM node (dense bf16 peak, NVLink 4, 400 Gb/s NIC per GPU)."""

  nodes: int = 1
  gpus_per_node: int = 8
  memory_gb: float = 80.0
  peak_tflops: float = 989.0  # dense bf16 per GPU; float32 compute runs at half (TF32)
  efficiency: float = 0.55  # achievable share of peak for the model's matmuls
  intra_gbps: float = 450.0  # GB/s per GPU per direction inside a node (NVLink)
  inter_gbps: float = 50.0  # GB/s per GPU across nodes (400 Gb/s InfiniBand)
  overlap: float = 0.5  # share of the backward pass the dp gradient all-reduce can hide behind
  flash_attention: bool = True  # cuDNN fused attention (bf16 on GPU) keeps no s x s scores
  attention: str = ''  # the kernel priced ('xla' | 'cudnn' | 'blockwise'); '' = by flash_attention
  gpu: bool = (
    True  # XLA:GPU's program (its optimizer update's peak, memory_model._update_peak); False: XLA:CPU's
  )

  @property
  def kernel(self) -> str:
    """The attention kernel priced: `attention`, or cuDNN's / XLA's by `flash_attention`."""
    return self.attention or ('cudnn' if self.flash_attention else 'xla')

  @property
  def n_devices(self) -> int:
    return self.nodes * self.gpus_per_node
