"""Where a stage's modules run.

`interface` is the runtime protocol, the eager PyTorch runtime and the step timer (the per-user cache folder
is `cli.folders.cache_root`); it never imports JAX, so stage 1 and stage 3 with `--backend torch` run without
it (the mesh's axis names are the top-level `sharding.py`'s). `mesh` picks the default dp/sp/tp mesh and
checks mesh flags (plain arithmetic); `placement` makes the JAX mesh and places and constrains weights and activations;
`torchax_runtime` runs stock PyTorch modules as JAX programs on that mesh; `programs` builds every device
program (compiled once per input signature, or loaded), keyed by `program_key`, stored by `executables`,
with in-program checks from `tpu_video/program_checks.py`; `sdpa` is the torchax SDPA override that runs
the attention plan's backend (the Splash kernel, XLA or cuDNN attention); `backend` is stages 1 and 3's
`--backend`/`--device`; `distributed` is multi-host stage 2 on JAX's multi-controller runtime.
"""
