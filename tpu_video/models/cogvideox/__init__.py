"""CogVideoX 1.0 and 1.5, text- and image-to-video (diffusers `CogVideoXPipeline`,
`CogVideoXImageToVideoPipeline`): the family's `models.family.Family` members, gathered from its parts.

- `declarations`: what the stages' parsers read (its name, pipeline classes, media inputs, tiny presets), no
  torch imported; the other members are imported on first use (`models.family.lazy_members`);
- `config`: documented defaults, request checks;
- `transformer`: the jit-safe attention processor, the weight rule table, Splash tiles, the guided call, the
  published block the collectives count measures;
- `pipeline`: the three stage bodies (prompt encoding, the denoising loop, the decoder);
- `i2v`: image-to-video (the recorded VAE posterior of the first frame);
- `vae`: stage 3's frame programs on torchax (the stock decode's frame batches);
- `presets`: the tiny random presets' components; `published`: the published checkpoints' configs for `--plan`.
"""

from ..common import every_step as denoise_steps
from ..common import fixed_length as frames_from_prompt
from ..common import no_image_checks as check_inputs
from ..common import no_prompt_enhancer as prompt_enhancer
from ..common import no_upsample
from ..common import num_layers_only as depth_overrides
from ..common import one_transformer as transformer_components
from ..common import size_from_request as size_from_inputs  # the pipeline resizes the image to the request's size
from ..common import stage2_as_written as upgrade_stage2
from ..common import vae_scaling_factor as latents_normalization
from ..family import lazy_members
from .declarations import MEDIA_INPUTS, NAME, OPTIONS, PIPELINE_CLASSES, PRESETS
from .published import PUBLISHED

upsample, plan_upsample = no_upsample(NAME)
Soundtrack = None  # no soundtrack

# The members kept where every family keeps them (family.SHARED_LAYOUT), and this family's own.
__getattr__, __dir__ = lazy_members(
    __name__,
    {
        "pipeline": ("Decoder", "video_processor"),
        "vae": ("CHUNK_FRAMES", "frame_plan", "frame_programs"),
    },
)
