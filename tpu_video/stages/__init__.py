"""What the stage scripts call: each script parses its flags, calls these, and leaves the rest here.

`request` (the request and media-input flags, built from the shared and the families' declarations); `feature_flags`
(the engine features' flags, read into the settings the engine takes: below this package no code reads parsed
flags); stage 1: `stage1_flags` (its parser) and `stage1_run` (one video checked, encoded and written); stage 2:
`stage2_flags` (its parser, and where a profiler trace goes), `stage2_inputs` (each folder's inputs read and
checked, before anything loads), `stage2_attention` (the attention plan from its flags, and where a model that does
not fit would fit), `stage2_upsample` (`--upsample`: the step between two passes, a folder of its own) and
`stage2_run` (the runtime, one folder's or a group's denoise, the section written); stage 3: `stage3_flags` (its
parser) and `stage3_run` (one folder checked, decoded and written)."""
