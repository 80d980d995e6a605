"""Wan 2.1 and 2.2, text- and image-to-video (diffusers `WanPipeline`, `WanImageToVideoPipeline`; TI2V-5B),
video-to-video, VACE (`WanVACEPipeline`) and Animate (`WanAnimatePipeline`): the family's
`models.family.Family` members, gathered from its parts.

- `declarations`: what the stages' parsers read (its name, pipeline classes, options, media inputs, tiny
  presets), no torch imported; the other members are imported on first use (`models.family.lazy_members`);
- `config`: the pipeline's defaults, one transformer or two experts, request checks, the stock pipeline
  object its stages call;
- `transformer`: the weight rule table, block input layouts, Splash tiles, one expert's guided call, the
  published block the collectives count measures;
- `pipeline`: stage 1's prompt encoding (UMT5) and stage 2's loop over one or two experts;
- `i2v`: image-to-video (CLIP tokens, the first and last frames' VAE latents); `ti2v`: TI2V-5B's
  per-token timesteps and image latents; `v2v`: video-to-video (`--video`, `--strength`); `vace`: VACE
  (`--control_video`, `--mask`, `--reference_images`, `--conditioning_scale`); `animate`: Animate's segments
  and guided call, `animate_inputs`: its stage 1 (`--image`, `--pose_video`, `--face_video`, `--mode`, ...);
- `vae`: stage 3's frame programs (one latent frame per call, the stock decode's cache carried);
  `vae_encode`: whole videos encoded the same way (stage 1's encodes, Animate's VAE between segments);
- `presets`: the tiny random presets' components; `published`: the published checkpoints' configs for `--plan`.
"""

from ..common import fixed_length as frames_from_prompt
from ..common import no_prompt_enhancer as prompt_enhancer
from ..common import no_upsample
from ..common import size_from_request as size_from_inputs  # the pipeline resizes the image to the request's size
from ..common import stage2_as_written as upgrade_stage2
from ..family import lazy_members
from .declarations import MEDIA_INPUTS, NAME, OPTIONS, PIPELINE_CLASSES, PRESETS
from .published import PUBLISHED

upsample, plan_upsample = no_upsample(NAME)
Soundtrack = None  # no soundtrack

# The members kept where every family keeps them (family.SHARED_LAYOUT), and this family's own.
__getattr__, __dir__ = lazy_members(
    __name__,
    {
        "config": ("denoise_steps", "depth_overrides", "transformer_components"),
        "i2v": ("check_inputs",),
        "pipeline": ("Decoder", "latents_normalization", "video_processor"),
        "vae": ("CHUNK_FRAMES", "frame_plan", "frame_programs"),
    },
)
