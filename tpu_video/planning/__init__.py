"""Planning for TPUs on a host without one: the real TPU compiler (libtpu) run over abstract weights.

`tpus` knows the TPU generations and topologies; `flags` reads the target, request and store a plan is
asked for; `plan` compiles stage 2 or stage 3 for a target and reads memory, FLOPs and collectives;
`between_loops` the work between a video's loops (Wan Animate's VAE between segments); `encoders` compiles
stage 1's encoders the same way, and `upsample` stage 2's `--upsample` step; `report` prints and writes the
plan; `hlo` counts collectives in compiled HLO at real widths and reads how quantized weights are loaded.
"""
