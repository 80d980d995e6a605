"""LTX-2 (2.0, 2.3 and 2.5), text- and image-to-video with its soundtrack, and conditions (diffusers `LTX2Pipeline`,
`LTX2ImageToVideoPipeline`, `LTX2ConditionPipeline`):
the family's `models.family.Family` members, gathered from its parts.

- `declarations`: what the stages' parsers read (its name, pipeline classes, options, media inputs, tiny
  presets), no torch imported; the other members are imported on first use (`models.family.lazy_members`);
- `config`: the pipeline's defaults, request checks (sizes, releases);
- `guidance`: the guidance passes a step runs (CFG, spatio-temporal, modality) and their scales;
- `transformer`: the jit-safe audio-video transformer, its rule table, Splash tiles and guided call;
- `i2v`: stage 1's image conditioning (the H.264 round trip, the VAE encode) and the first-frame mask;
- `conditions`: images and clips at given latent frames (keyframes): stage 1's encodes, stage 2's first latents;
- `crf`: the H.264 round trip of a conditioning image (PyAV);
- `duration`: LTX-2.5's duration head, which picks the frame count in stage 1 where none is given;
- `enhance`: the prompt enhancer, which rewrites the prompt in stage 1 (`--enhance_prompt`);
- `pipeline`: stage 1's Gemma encoding and connectors, stage 2's loop over both streams;
- `latents`: the VAEs' statistics, stage 2's de-normalisation and its record, the upgrade of older folders,
  stage 3's video decode;
- `connectors`: stage 1's text connectors on the runtime (their float64 rotary tables from the host);
- `audio`: stage 3's soundtrack (audio VAE and vocoder, one module);
- `presets`: the tiny random presets' components (`tiny_text`: their tokenizer, Gemma and enhancer processor);
- `upsampler`: the x2 latent upsampler between the two-stage pipeline's passes (stage 2's `--upsample`);
- `published`: Lightricks/LTX-2's configs, for --plan.
"""

from ..common import every_step as denoise_steps
from ..common import num_layers_only as depth_overrides
from ..common import size_from_request as size_from_inputs  # the pipeline resizes the image to the request's size
from ..family import lazy_members
from .declarations import MEDIA_INPUTS, NAME, OPTIONS, PIPELINE_CLASSES, PRESETS
from .published import PUBLISHED

# Stage 3 on torchax decodes the video as one program: LTX-2's decoder is not causal in time (both published
# VAEs set decoder_causal False: every temporal conv pads with the first and the last frame on both sides), so
# each frame depends on the latent frames after it and no state can be carried from one chunk to the next.
CHUNK_FRAMES: tuple[int, ...] = ()
frame_programs = frame_plan = None
# No block inputs are written for the collectives count of LTX-2's two streams (planning/hlo.py): `--plan`
# reports its per-block collectives from the whole step.
published_block = None

# The members kept where every family keeps them (family.SHARED_LAYOUT), and this family's own.
__getattr__, __dir__ = lazy_members(
    __name__,
    {
        "audio": ("Soundtrack",),
        "config": ("transformer_components",),
        "duration": ("frames_from_prompt",),
        "enhance": ("prompt_enhancer",),
        "i2v": ("check_inputs",),
        "latents": ("Decoder", "latents_normalization", "upgrade_stage2", "video_processor"),
        "upsampler": ("plan_upsample", "upsample"),
    },
)
