"""Stage 1's encoders on a runtime, for every family: a transformers text encoder, an image encoder or a
VAE encoder compiled on the runtime (torchax: weights placed by the encoder's rule table) and called as the
pipeline calls the stock module, returning what the stock module returns.
"""

from __future__ import annotations

from typing import Any

import torch

from sharding import TP
from tpu_video.cli import UserError
from tpu_video.runtime.interface import Runtime


def text_encoder_rules(config) -> Any:
    """A function of the mesh's axis sizes giving the encoder's rule table (called only where a mesh
    exists, so plain-torch stage 1 never imports JAX)."""

    def rules(mesh_shape: dict[str, int]):
        import sharding

        try:
            table = sharding.text_encoder_rules(config, mesh_shape[TP])
        except ValueError as err:
            raise UserError(f"{err}; run stage 1 with --backend torch") from None
        return table.nested("encoder.")

    return rules


class _EncoderOutputs(torch.nn.Module):
    """The jitted side: plain tensors out (jax.jit returns no ModelOutput or cache objects)."""

    def __init__(self, encoder: torch.nn.Module, hidden_states: bool) -> None:
        super().__init__()
        self.encoder = encoder
        self.hidden_states = hidden_states

    def forward(self, input_ids, attention_mask):
        if not self.hidden_states:
            return (self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state,)
        output = self.encoder(
            input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False
        )
        return (output.last_hidden_state, *output.hidden_states)


class StandIn(torch.nn.Module):
    """A stand-in for a pipeline component whose work runs compiled on a runtime: it has the component's
    `config` and `dtype`, and says its `device` is the host, where the pipelines put its inputs (they ask
    the module, diffusers' get_module_execution_device, which would otherwise find the weights' 'jax' device)."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.config = module.config
        self.module_dtype = module.dtype

    @property
    def dtype(self) -> torch.dtype:
        return self.module_dtype

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")


class OnRuntime(StandIn):
    """A StandIn whose work is one module compiled on a runtime (`jitted`)."""

    def __init__(self, module: torch.nn.Module, runtime: Runtime, jitted_side: torch.nn.Module, rules=None) -> None:
        super().__init__(module)
        self.runtime = runtime
        self.jitted = runtime.compile(jitted_side, rules)


class DeviceTextEncoder(OnRuntime):
    """A text encoder on a runtime, called as diffusers pipelines call one on the host: CPU token ids in,
    a CPU `BaseModelOutput` out (`[0]` and, if built with `hidden_states`, every layer's
    `.hidden_states`). On a JAX mesh its weights are split over `tp` by the encoder's rule table and
    it compiles once per input shape (the pipelines pad to a fixed length)."""

    def __init__(self, encoder: torch.nn.Module, runtime: Runtime, hidden_states: bool = False) -> None:
        jitted_side = _EncoderOutputs(encoder, hidden_states)
        super().__init__(encoder, runtime, jitted_side, text_encoder_rules(encoder.config))

    def forward(self, input_ids, attention_mask=None, output_hidden_states=None):
        from transformers.modeling_outputs import BaseModelOutput

        outputs = self.jitted(*self.runtime.to_device((input_ids, attention_mask)))
        last, *layers = (self.runtime.to_host(output) for output in outputs)
        if output_hidden_states and not layers:
            raise ValueError("this DeviceTextEncoder was built without hidden_states")
        return BaseModelOutput(last_hidden_state=last, hidden_states=tuple(layers) or None)


class _ImageEncoderOutputs(torch.nn.Module):
    """The jitted side of an image encoder: the last hidden state and every layer's, as plain tensors."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, pixel_values):
        output = self.encoder(pixel_values=pixel_values, output_hidden_states=True)
        return (output.last_hidden_state, *output.hidden_states)


class DeviceImageEncoder(OnRuntime):
    """An image encoder (CLIP, SigLIP) on a runtime, called as the pipelines call one on the host: CPU pixel
    values in, a CPU `BaseModelOutput` out (`last_hidden_state` and every layer's `hidden_states`). Its
    weights are replicated (a few hundred million parameters); it compiles once per image size."""

    def __init__(self, encoder: torch.nn.Module, runtime: Runtime) -> None:
        super().__init__(encoder, runtime, _ImageEncoderOutputs(encoder))

    def forward(self, pixel_values, output_hidden_states=None, **_):
        from transformers.modeling_outputs import BaseModelOutput

        outputs = self.jitted(*self.runtime.to_device((pixel_values,)))
        last, *layers = (self.runtime.to_host(output) for output in outputs)
        return BaseModelOutput(last_hidden_state=last, hidden_states=tuple(layers))


class _Moments(torch.nn.Module):
    """The jitted side of a VAE encode: the posterior's parameters (mean and log-variance)."""

    def __init__(self, vae: torch.nn.Module) -> None:
        super().__init__()
        self.vae = vae

    def forward(self, pixels):
        return (self.vae.encode(pixels).latent_dist.parameters,)


class DeviceVAEEncoder(OnRuntime):
    """A VAE whose `encode` runs on a runtime, for the pipelines' single-image encodes: CPU pixels in, the
    posterior out on the host, as `vae.encode(x)` returns it (`.latent_dist`). Weights replicated."""

    def __init__(self, vae: torch.nn.Module, runtime: Runtime) -> None:
        super().__init__(vae, runtime, _Moments(vae))

    def encode(self, pixels, return_dict: bool = True):
        (parameters,) = self.jitted(*self.runtime.to_device((pixels,)))
        return vae_output(self.runtime.to_host(parameters), return_dict)


def vae_output(parameters: torch.Tensor, return_dict: bool = True):
    """What a diffusers VAE's `encode` returns for its posterior's parameters (mean and log-variance)."""
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
    from diffusers.models.modeling_outputs import AutoencoderKLOutput

    posterior = DiagonalGaussianDistribution(parameters)
    return AutoencoderKLOutput(latent_dist=posterior) if return_dict else (posterior,)


def t5_prompt_encoder(pipe, max_sequence_length: int, runtime, dtype: torch.dtype):
    """Stage 1 of the T5 families (CogVideoX's T5, Wan's UMT5): per request the pipeline's own
    `encode_prompt` (its cleaning, padding to `max_sequence_length` and trimming) of the prompt and the
    negative prompt. The negative is always encoded: stage 2 may turn CFG on."""

    def encode(request) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            prompt_embeds, negative_prompt_embeds = pipe.encode_prompt(
                prompt=request.prompt,
                negative_prompt=request.negative_prompt,
                do_classifier_free_guidance=True,
                max_sequence_length=max_sequence_length,
                device=runtime.device,
                dtype=dtype,
            )
        return {"prompt_embeds": prompt_embeds.cpu(), "negative_prompt_embeds": negative_prompt_embeds.cpu()}

    return encode
