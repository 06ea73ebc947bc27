"""Triton GPU kernels, drop-in replacements (same signatures) for the torch references in `kernels.torch_ref`."""
