"""Attention: the run's attention plan and every backend but the Splash kernel itself.

`plan` resolves the flags, platform and model into one AttentionPlan (no JAX); `sp_modes` holds the
sequence-parallel schemes a run may ask for and the one it runs for its heads (plain Python); `calls` says
what a call's shapes cannot (the cross-attention modules a family marks; no JAX); `masks` turns diffusers'
attention masks into per-key validity and pads sequences; `xla` is plain softmax attention in JAX (the CPU
reference and the fallback anywhere); `cudnn` is JAX's fused cuDNN attention for NVIDIA GPUs;
`sequence_parallel` holds Ulysses and ring attention over the mesh's `sp` axis; `reference` is float64 NumPy
attention for tests and benchmarks. The Splash kernel is the top-level `splash_attention.py`; the torchax
SDPA override that runs the plan's backend is `tpu_video/runtime/sdpa.py`, above both (this package imports
neither).
"""
