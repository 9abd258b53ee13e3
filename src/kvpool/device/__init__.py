"""KV cache tensors <-> pool values on any device: the block layout and the two copy paths.

This layer knows torch but not vLLM, so the device check (benchmarks/device.py) runs it on an
accelerator machine that has torch alone.
"""
