"""tpu-video's library: everything the three stage scripts call, apart from the six top-level modules
(the stages, the Splash kernel for torchax, the JAX-free sharding rule tables and the stage-file contract).

Subpackages and modules, from the bottom layer up (docs/architecture.md draws them):

- `cli`: the stage CLIs' conventions (user errors, stop lines, log lines, dtypes by name);
- `workarounds`: one module per upstream library with a bug we work around;
- `program_checks`: checks of values inside compiled programs, returned as outputs (the attention
  kernels and the runtime's programs use them);
- `attention`: the attention plan, its backends and the sequence-parallel schemes;
- `runtime`: where programs run (the JAX-free runtime interface, the default mesh, the torchax runtime with
  its SDPA override, placement, programs and saved executables, multi-host);
- `engine`: what every family runs (the denoise loop with its guard and guidance, batching, step caching,
  the block scan, quantization, LoRA fusion, direct loading, meta facts, the encoders, decode, media inputs, passes);
- `models`: the families (the registry and `--model` resolution, the `Family` interface, one subpackage
  per family with its presets and published configs);
- `planning`: `--plan`, the programs compiled for a TPU topology by libtpu;
- `stages`: what the stage scripts call (their parsers, checked inputs and runs);
- `api`: the three stages from Python, in one process (encode, denoise, decode).

It imports nothing itself, so importing one subpackage loads only what that one needs.
"""
