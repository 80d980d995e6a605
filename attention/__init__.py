"""Attention backends other than Splash and the sequence-parallel schemes they share.

`masks` turns diffusers' attention masks into per-key validity and pads sequences; `xla` is plain softmax
attention in JAX (the CPU reference and the fallback anywhere); `cudnn` is JAX's fused cuDNN attention
for NVIDIA GPUs; `sequence_parallel` holds Ulysses and ring attention over the mesh's `sp` axis. The
Splash kernel and the choice among backends stay in the top-level `splash_attention.py`.
"""
