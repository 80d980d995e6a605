"""Where a stage's modules run.

`interface` is the runtime protocol, the mesh axis names, the eager PyTorch runtime and the step timer;
it never imports JAX, so stage 1 and stage 3 with `--backend torch` run without it. `torchax_runtime`
runs stock PyTorch modules as JAX programs on a dp/sp/tp mesh; `distributed` is multi-host stage 2 on
JAX's multi-controller runtime.
"""
