"""HunyuanVideo-1.5, text- and image-to-video (diffusers `HunyuanVideo15Pipeline`,
`HunyuanVideo15ImageToVideoPipeline`): the family's `models.family.Family` members, gathered from its parts.

- `config`: which pipelines are this family, documented defaults, request checks;
- `transformer`: the forward made traceable, the key-mask attention processor, the weight rule table,
  Splash tiles, the guided call;
- `pipeline`: stage 1's prompt encoding (Qwen2.5-VL and ByT5) and stage 2's flow-matching loop;
- `i2v`: image-to-video (SigLIP image embeddings, the first frame's VAE latents);
- `vae`: the VAE made traceable and stage 3's frame programs (chunks of any length);
- `presets`: the tiny random presets; `published`: the published checkpoints' configs for `--plan`.
"""

from ..common import no_image_checks as check_inputs
from ..common import no_start_from, no_upsample
from ..common import one_transformer as transformer_components
from ..common import stage2_as_written as upgrade_stage2
from ..common import vae_scaling_factor as latents_normalization
from .config import (
    LORA_LOADER,
    NAME,
    OPTIONS,
    PIPELINE_CLASSES,
    STEP_CACHES,
    activations,
    guidance_branches,
    request_defaults,
    validate_request,
)
from .i2v import MEDIA_INPUTS, encode_inputs, inputs_on_runtime, media_inputs, size_from_inputs
from .pipeline import denoise_loop, planning_embeds, prompt_encoder
from .presets import PRESETS
from .published import PUBLISHED
from .transformer import SPLASH_BLOCK_SIZES, transformer_rules
from .vae import CHUNK_FRAMES, Decoder, frame_plan, frame_programs, video_processor

Soundtrack = None  # no soundtrack
start_from = no_start_from(NAME)  # --start_latents: not yet
upsample = no_upsample(NAME)
