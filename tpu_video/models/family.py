"""The family interface: what one model-family package (`tpu_video/models/<family>/`) provides to the stages.

A family package fills in `Family` with the names its `__init__` gathers; `tests/test_layout.py` checks
every registered family has each of them. What all families share lives in the engine modules beside
it: the denoising loop (`denoise`) and its guard (`guard`), guidance (`guidance`), batches (`batching`,
`batch_folders`), step caches, LoRA (`lora`, `lora_files`), meta-device facts (`meta`), stage 1's
encoders (`encoders`), stage 3's decode (`decode`), and the request (`utils.Request`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # annotations only
    import torch

    from tpu_video.cli.options import Option
    from tpu_video.engine.denoise import DenoiseLoop
    from tpu_video.engine.inputs import MediaInput
    from tpu_video.runtime.interface import Runtime
    from utils import Request


@dataclass(frozen=True)
class Preset:
    """A built-in tiny model: random components built in code (`build` returns the diffusers pipeline)
    and the request defaults that keep it fast on a CPU. `pipeline_attributes`: values for attributes the
    pipeline's constructor fixes rather than reads from a config (HunyuanVideo-1.5's padded text lengths),
    set on every pipeline the family builds for the preset; the test suite's reference pipelines get them too."""

    family: str
    build: Callable[[], Any]
    defaults: dict[str, Any] = field(default_factory=dict)
    pipeline_attributes: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PublishedBlock:
    """One block of a published transformer at its real width, for the collectives count
    (tpu_video/planning/hlo.py: measure): `model` is the transformer with one block on the meta device, patched
    as stage 2 runs it; `blocks` names its attribute holding the blocks; `inputs` are the block's positional
    inputs, laid out as stage 2 lays them; `returns_text`: a block also returns the text tokens."""

    name: str  # the checkpoint it measures, e.g. "wan2.1-14b"
    model: Any
    blocks: str
    inputs: list[Any]
    returns_text: bool


# Where a family's components come from: a models.ModelSource (not imported: models imports this module).
ModelSource = Any


class Family(Protocol):
    """One diffusers pipeline's staged implementation."""

    NAME: str  # recorded as `model_family`
    PIPELINE_CLASSES: tuple[str, ...]  # model_index.json `_class_name`s this family runs
    PRESETS: dict[str, Preset]  # tiny presets by `--model` name
    # Published hub ids: components' (library, class, config) for --plan; `_subfolders`: the same for folders kept
    # beside the pipeline and not in its index (LTX-2's latent upsampler).
    PUBLISHED: dict[str, dict[str, Any]]
    SPLASH_BLOCK_SIZES: dict[str, int]  # default Splash tiles (block_q, block_kv, block_kv_compute)
    # Every media input it may take (tpu_video.engine.inputs.MediaInput): stage 1's input flags; which of
    # them a checkpoint takes is media_inputs(source).
    MEDIA_INPUTS: tuple[MediaInput, ...]
    # Its own request options (tpu_video.cli.options.Option): stage 1's flags, later stages' overrides,
    # stored beside the shared request keys; `Request.option(name)` reads one. Other families refuse them.
    OPTIONS: tuple[Option, ...]
    LORA_LOADER: (
        str | None
    )  # the diffusers.loaders class whose lora_state_dict reads adapters (tpu_video/engine/lora.py)
    STEP_CACHES: tuple[str, ...]  # the --cache kinds it runs ("magcache", "interval"; tpu_video/engine/step_cache.py)
    # Stage 3 on torchax: the latent frames per call its frame programs decode exactly (the first is the
    # default; empty: one program). frame_programs(source, decoder, latents_shape, runtime, layout,
    # chunk_frames): the programs placed, as a function of the latents giving the video on the host;
    # frame_plan(same arguments): --plan's view: their module, each program's (tensor, layout) inputs and how
    # often the video calls it. None where CHUNK_FRAMES is empty.
    CHUNK_FRAMES: Sequence[int]
    frame_programs: Callable[..., Callable] | None
    frame_plan: Callable[..., tuple[torch.nn.Module, dict, dict]] | None
    # The collectives count at real width (tpu_video/planning/hlo.py: measure): published_block(video_tokens,
    # batch, make) gives one block of the family's largest published transformer and its inputs for `batch`
    # samples of `video_tokens` video tokens, each input `make(shape, torch dtype, layout)`. None where the
    # family writes none (LTX-2: `--plan` reports its per-block collectives from the whole step).
    published_block: Callable[[int, int, Callable], PublishedBlock] | None
    # Decoder(vae, normalization): undoes the latents' recorded normalisation and decodes stage-2 latents
    # to pixels in [-1, 1], as one graph.
    Decoder: type[torch.nn.Module]
    # Families whose videos carry sound (LTX-2): Soundtrack(*components named in Soundtrack.COMPONENTS), a
    # module from stage 2's `audio_latents` to the waveform (B, channels, samples) in [-1, 1] at its
    # `sample_rate`; None for silent families.
    Soundtrack: type[torch.nn.Module] | None

    def request_defaults(self, source: ModelSource) -> dict[str, Any]:
        """Request values for keys the user did not give (documented per-checkpoint defaults)."""

    def validate_request(self, source: ModelSource, request: Request) -> None:
        """Raise UserError for what the model cannot take (geometry, family extras), before any weights load."""

    def guidance_branches(self, source: ModelSource, request: Request) -> int:
        """The samples one step of one video runs as one batch: 2 where the pipeline runs classifier-free
        guidance at this request's scale, else 1; LTX-2 up to 4 (the default mesh's `dp` takes them)."""

    def denoise_steps(self, source: ModelSource, request: Request, task: str) -> int:
        """How many steps stage 2's loop runs for a request of this stage-1 `task` (Wan's video-to-video: the end
        of the schedule); the step cache's window is checked against them before any weights load."""

    def activations(self, source: ModelSource, request: Request, dtype: torch.dtype) -> Any:
        """One sample's activation estimate (runtime.mesh.Activations: its video tokens and the family's
        copies fitted to the TPU compiler), which the default mesh adds to the weights."""

    def transformer_rules(self, tp_mode: str) -> Any:
        """The transformer's sharding.RuleTable."""

    def transformer_components(self, source: ModelSource) -> tuple[str, ...]:
        """The pipeline's transformer components stage 2 loads (Wan 2.2: two experts)."""

    def depth_overrides(self, source: ModelSource, component: str, num_layers: int) -> dict[str, Any]:
        """The config overrides that build transformer `component` at `num_layers` blocks (--plan's per-block
        copies, LoRA's key probe): the depth, and whatever indexes blocks (Wan VACE's hint layers)."""

    def latents_normalization(self, source: ModelSource) -> dict[str, Any]:
        """How stage 2's latents relate to the VAE's (recorded by stage 2, undone by stage 3)."""

    def upgrade_stage2(
        self, source: ModelSource, tensors: dict[str, torch.Tensor], normalization: dict[str, Any]
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Stage 3: a folder's stage-2 tensors and recorded normalisation as this stage 3 decodes them (an
        older stage 2's layout brought up to date, logged; unchanged for folders this version writes)."""

    def prompt_encoder(self, source: ModelSource, dtype: torch.dtype, runtime: Runtime) -> Callable[[Request], dict]:
        """Stage 1: the text encoders loaded once; a function of a request giving the pipeline's own prompt
        encoding, tensors named as the pipeline's arguments."""

    def frames_from_prompt(self, source: ModelSource) -> Callable[[Request, dict], int] | None:
        """Checkpoints that pick the video's length from the prompt (LTX-2.5's duration head): a function of a
        request and its stage-1 tensors giving the frame count, which stage 1 records where --num_frames is not
        given; None for the others."""

    def prompt_enhancer(
        self, source: ModelSource, dtype: torch.dtype, runtime: Runtime
    ) -> Callable[[Request, dict], str | None] | None:
        """Pipelines that can rewrite the prompt before encoding it (LTX-2's prompt enhancer): a function of a
        request and its media inputs giving the prompt stage 1 encodes and records (None where the request does
        not ask), loading its model on first use and freeing it when dropped; None for the others."""

    def media_inputs(self, source: ModelSource) -> tuple[MediaInput, ...]:
        """Those of MEDIA_INPUTS this model takes (none for text-to-video), the ones it requires marked
        (`MediaInput.required_here`: an image-to-video pipeline's first frame)."""

    def size_from_inputs(self, source: ModelSource, inputs: dict[str, Any]) -> tuple[int, int] | None:
        """The (height, width) an image-to-video pipeline derives from the image, or None where it resizes the
        image to the requested size (stage 1 then refuses --height/--width and records the derived size)."""

    def check_inputs(self, source: ModelSource, request: Request, inputs: dict[str, Any]) -> None:
        """Stage 1, before any weights load, with the inputs given (perhaps none): refuse what encode_inputs
        would refuse only after the text encoders ran (a host tool the image conditioning needs, an image it
        cannot take, inputs that do not fit together, a model that needs some); UserError."""

    def encode_inputs(self, source: ModelSource, request: Request, inputs: dict[str, Any], runtime: Runtime) -> dict:
        """Stage 1 with media inputs (by name, as their readers gave them): the pipeline's conditioning (image
        embeddings, VAE latents of the conditioning frames), computed as the pipeline computes it; tensors
        named as stage 2 reads them."""

    def plans_inputs(self, source: ModelSource) -> bool:
        """Whether stage 1's `--plan` runs encode_inputs and compiles its programs: every model it uses runs on
        the runtime in programs the planning runtime compiles; False otherwise (the report says so)."""

    def denoise_loop(
        self,
        source: ModelSource,
        request: Request,
        embeds: dict[str, torch.Tensor],
        dtype: torch.dtype,
        transformers: dict[str, torch.nn.Module],
        runtime: Runtime,
        tp_mode: str,
        *,
        planning: bool,
    ) -> tuple[DenoiseLoop, Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, Any]]]]:
        """Stage 2: the loop for `transformers` (by component name; loaded, or on the meta device for --plan),
        and the function turning its final latents into stage 2's tensors by name (`latents`, (B, C, F, H,
        W); LTX-2 adds `audio_latents`) and the facts stage 3 needs. `planning` (True for --plan, where only
        shapes count and no checkpoint value may be read; False for a run) is always given, never inferred
        from the modules."""

    def start_from(
        self, source: ModelSource, request: Request, tensors: dict[str, torch.Tensor], embeds: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """A later pass (stage 2's `--start_latents`): the loop's first latents from an earlier pass's stage-2
        `tensors`, as the pipeline takes them when called with `latents=` (with this video's stage-1 `embeds`:
        LTX-2's conditions are applied to them); UserError where the family cannot (checked before any weights
        load)."""

    def upsample(
        self, source: ModelSource, location: str | None, tensors: dict[str, torch.Tensor], runtime, timer, *filters
    ) -> tuple[dict[str, torch.Tensor], int, dict[str, Any]]:
        """The step between two passes (stage 2's `--upsample`): the family's latent upsampler (from `location`,
        else the model's own) on stage-2 tensors: (the tensors, the spatial scale, the record); `filters`: the
        pipeline's AdaIN factor and tone-map ratio. UserError where the family has none."""

    def plan_upsample(self, source: ModelSource, request: Request, location: str | None, runtime, *filters) -> dict:
        """`--upsample --plan`: the upsampler's programs called on a planning runtime for the first pass of
        `request` (a meta model from its config, zero latents); what the step would record. UserError as
        `upsample`."""

    def planning_embeds(self, source: ModelSource, request: Request, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Zero stage-1 tensors of the shapes stage 1 would write (to plan before encoding)."""

    def video_processor(self, source: ModelSource) -> Any:
        """The pipeline's post-processor (pixels in [-1, 1] to frames in [0, 1])."""


# The members every built-in family keeps in the same module (the shape of a family package:
# docs/architecture.md#adding-a-family); each family's call of lazy_members adds its own.
SHARED_LAYOUT = {
    "config": (
        "LORA_LOADER",
        "STEP_CACHES",
        "activations",
        "guidance_branches",
        "request_defaults",
        "validate_request",
    ),
    "i2v": ("encode_inputs", "plans_inputs", "media_inputs"),
    "pipeline": ("denoise_loop", "planning_embeds", "prompt_encoder", "start_from"),
    "transformer": ("SPLASH_BLOCK_SIZES", "published_block", "transformer_rules"),
}


def lazy_members(package: str, modules: dict[str, tuple[str, ...]]) -> tuple[Callable[[str], Any], Callable[[], list]]:
    """A family package's module `__getattr__` and `__dir__` (PEP 562): each name of SHARED_LAYOUT and of
    `modules` (the family's own, by module) is imported from that module of `package` on first use and then kept
    in the package (a test that patches a member module after that patches the module, not the package's copy);
    the package's modules are its attributes as before. The stages' parsers read only a family's declarations
    (its name, pipeline classes, options, media inputs, presets and published configs, from modules that import
    no torch), so `--help` and a flag's error come before torch loads."""
    where = {name: module for layout in (SHARED_LAYOUT, modules) for module, names in layout.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name in where:
            value = getattr(importlib.import_module(f"{package}.{where[name]}"), name)
        elif importlib.util.find_spec(f"{package}.{name}") is not None:  # a module of the package
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *where})

    return __getattr__, __dir__


def _build_preset(module: str, function: str, *args: Any, **kwargs: Any) -> Any:
    return getattr(importlib.import_module(module), function)(*args, **kwargs)


def preset_builder(module: str, function: str, *args: Any, **kwargs: Any) -> Callable[[], Any]:
    """A Preset's `build`: `module.function(*args, **kwargs)`, the module (which needs torch) imported only when
    a preset is built, not when the presets are listed."""
    return functools.partial(_build_preset, module, function, *args, **kwargs)


def family_members() -> list[str]:
    """Names every family module must define (the protocol's attributes and methods)."""
    names = set(Family.__annotations__)
    names |= {name for name, value in vars(Family).items() if callable(value) and not name.startswith("_")}
    return sorted(names)
