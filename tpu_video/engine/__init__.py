"""What every family runs, once; nothing here names a family, reads the registry or reads parsed flags
(tpu_video.models calls it with each family's own pieces; tpu_video.stages with the settings).

Stage 2: `denoise` (the loop: load, place, compile, step), `guard` (its NaN checks, checkpoints and
`--resume`), `guidance` (the CFG batch), `batching` (several videos as one batch) and `batch_folders` (many
videos per run on disk), `passes` (a denoise that starts from an earlier pass's latents), `segments` (a video
denoised as several loops in order, each built from the one before), the step caches
(`cache_schedule`, `step_cache`, `cached_blocks`, `mag_ratios`), `scanned_blocks` (identical blocks as one
scan), `quantize` (int8 and fp8 weights), `lora` and `lora_files` (adapters fused before placement),
`direct_load` (weights read from their files straight to the devices) and `meta` (models on the meta device
and the facts the mesh choice needs); `settings` holds the choices and settings of stage 2's flags that the
stages' parsers read with no torch imported. Stage 1: `encoders` (text, image and
VAE encoders on a runtime), `inputs` (the media inputs families declare: checked, read, recorded),
`images` and `videos` (the image and video inputs' readers) and `lora_stage1` (an adapter's text-connector
share).
Stage 3: `decode`, and `media` (the mp4 with its soundtrack, the WAV, the preview PNG).
"""
