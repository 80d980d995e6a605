"""LTX-2's tiny presets: random components built in code (Gemma 3 or 4 with a tokenizer that needs no files and
the prompt enhancer's processor: tiny_text.py; the text connectors, the audio-video transformer, the video and
audio VAEs, the vocoder, and the x2 latent upsampler in the subfolder where the published repositories keep it),
deterministic per seed.

Three layouts: LTX-2.0's (one shared text projection, learnable registers, split RoPE in float64), LTX-2.3's
(a text projection per stream, gated attention, prompt modulation, perturbed attention for spatio-temporal
guidance) and LTX-2.5's (2.3's with Gemma 4, the prompt modulation as a fixed table, feed-forwards without
bias, and a duration head), at sizes where every head count divides 8 devices. The scheduler is the
published folders' dynamic-shift FlowMatchEuler (its `mu` follows the video's token count), and the
vocoder upsamples by the audio VAE's hop length, so the waveform lasts as long as the video.
"""

from __future__ import annotations

import torch

from .published import SCHEDULER
from .tiny_text import gemma_tokenizer, tiny_processor, tiny_text_encoder, with_image_tokens


def tiny_transformer(seed: int, version: str = "2.0", num_layers: int = 2) -> torch.nn.Module:
    """A random tiny LTX2VideoTransformer3DModel: video 8 heads x 8, audio 8 heads x 4, 2 blocks (the interval
    cache's test: 4). "2.3" adds gated attention, prompt modulation and perturbed attention, and takes the
    connectors' projections; "2.5" modulates the prompt by a fixed table (use_prompt_adaln_single False: its
    cross-attention keys and values do not change with the step), has no video feed-forward bias and holds a
    keyframe position embedding (which text- and image-to-video never add)."""
    from diffusers import LTX2VideoTransformer3DModel

    later = version != "2.0"
    switches = {"gated_attn": later, "cross_attn_mod": later, "audio_gated_attn": later}
    switches |= {"audio_cross_attn_mod": later, "perturbed_attn": later, "use_prompt_embeddings": not later}
    if version == "2.5":
        switches |= {"ff_bias": False, "use_prompt_adaln_single": False, "use_keyframes_abs_pos_embedding": True}
    torch.manual_seed(seed)
    return LTX2VideoTransformer3DModel(
        in_channels=8,
        out_channels=8,
        num_attention_heads=8,
        attention_head_dim=8,
        cross_attention_dim=64,
        vae_scale_factors=(4, 16, 16),
        audio_in_channels=4,
        audio_out_channels=4,
        audio_num_attention_heads=8,
        audio_attention_head_dim=4,
        audio_cross_attention_dim=32,
        num_layers=num_layers,
        caption_channels=16,
        rope_type="split",
        **switches,
    ).eval()


def tiny_connectors(seed: int, version: str = "2.0") -> torch.nn.Module:
    """Random tiny LTX2TextConnectors. "2.0": one projection of every Gemma layer to Gemma's width for both
    streams; "2.3" and "2.5": a projection per stream to its transformer width, and gated attention. 8
    registers."""
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    later = version != "2.0"
    torch.manual_seed(seed)
    common = {"num_layers": 1, "num_learnable_registers": 8, "gated_attn": later}
    video = {"num_attention_heads": 8 if later else 2, "attention_head_dim": 8, **common}
    audio = {"num_attention_heads": 8 if later else 2, "attention_head_dim": 4 if later else 8, **common}
    widths = {"per_modality_projections": later, "video_hidden_dim": 64, "audio_hidden_dim": 32} if later else {}
    return LTX2TextConnectors(
        caption_channels=16,
        text_proj_in_factor=3,  # Gemma's two layers and its embeddings
        **{
            f"video_connector_{key}" if key != "gated_attn" else "video_gated_attn": value
            for key, value in video.items()
        },
        **{
            f"audio_connector_{key}" if key != "gated_attn" else "audio_gated_attn": value
            for key, value in audio.items()
        },
        connector_rope_base_seq_len=32,
        rope_type="split",
        **widths,
    ).eval()


def with_latent_statistics(vae: torch.nn.Module) -> torch.nn.Module:
    """`vae` (eval mode) with random per-channel `latents_mean` in [-0.5, 0.5] and `latents_std` in [0.5, 2]
    (its persistent buffers, which the class leaves at 0 and 1 and every published checkpoint sets), drawn
    from the seeded generator that built it: with 0 and 1 de-normalising is the identity and a decode that
    skips it looks right."""
    with torch.no_grad():
        vae.latents_mean.uniform_(-0.5, 0.5)
        vae.latents_std.uniform_(0.5, 2.0)
    return vae.eval()


def tiny_vae(seed: int, version: str = "2.0") -> torch.nn.Module:
    """A random tiny AutoencoderKLLTX2Video: 8 latent channels, 16x spatial (4x4 patches, two 2x2x2 downs)
    and 4x temporal compression; latent statistics and a scaling factor that are not the identity. The decoder
    pads as the release's does (LTX-2.0 reflects, LTX-2.3 pads zeros)."""
    from diffusers import AutoencoderKLLTX2Video

    torch.manual_seed(seed)
    vae = AutoencoderKLLTX2Video(
        in_channels=3,
        out_channels=3,
        latent_channels=8,
        block_out_channels=(8, 8),
        decoder_block_out_channels=(8, 8),
        layers_per_block=(1, 1),
        decoder_layers_per_block=(1, 1, 1),
        spatio_temporal_scaling=(True, True),
        decoder_spatio_temporal_scaling=(True, True),
        decoder_inject_noise=(False, False, False),
        downsample_type=("spatiotemporal", "spatiotemporal"),  # as the decoder upsamples: 16x, 4x
        upsample_residual=(False, False),
        upsample_factor=(1, 1),
        timestep_conditioning=False,
        patch_size=4,
        patch_size_t=1,
        encoder_causal=True,
        decoder_causal=False,
        decoder_spatial_padding_mode="reflect" if version == "2.0" else "zeros",
        scaling_factor=0.8,  # published: 1.0; not 1 here, so a missing scaling step shows
    )
    return with_latent_statistics(vae)


def tiny_audio_vae(seed: int) -> torch.nn.Module:
    """A random tiny AutoencoderKLLTX2Audio: 8 mel bins, 2 latent channels, 4x time and mel compression; latent
    statistics (per packed feature: channels x latent mel bins) that are not the identity."""
    from diffusers import AutoencoderKLLTX2Audio

    torch.manual_seed(seed)
    vae = AutoencoderKLLTX2Audio(
        base_channels=4,
        output_channels=2,
        ch_mult=(1,),
        num_res_blocks=1,
        attn_resolutions=None,
        in_channels=2,
        resolution=32,
        latent_channels=2,
        norm_type="pixel",
        causality_axis="height",
        dropout=0.0,
        mid_block_add_attention=False,
        sample_rate=16000,
        mel_hop_length=160,
        is_causal=True,
        mel_bins=8,
    )
    return with_latent_statistics(vae)


def tiny_vocoder(seed: int) -> torch.nn.Module:
    """A random tiny LTX2Vocoder: stereo mel (2 x 8 bins) to a stereo waveform, upsampling 8 x 5 x 4 = 160
    (the audio VAE's hop length), so one mel frame is one hop of samples."""
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    torch.manual_seed(seed)
    return LTX2Vocoder(
        in_channels=16,
        hidden_channels=32,
        out_channels=2,
        upsample_kernel_sizes=[16, 10, 8],
        upsample_factors=[8, 5, 4],
        resnet_kernel_sizes=[3],
        resnet_dilations=[[1, 3, 5]],
        leaky_relu_negative_slope=0.1,
        output_sampling_rate=16000,
    ).eval()


def tiny_bwe_vocoder(seed: int) -> torch.nn.Module:
    """A random tiny LTX2VocoderWithBWE (LTX-2.3's class): the tiny vocoder's layout with LTX-2.3's anti-aliased
    SnakeBeta activations, to 16 kHz (upsampling exactly 160, as the extender's residual needs); then the causal
    mel STFT of its output (32-sample window, hop 16, 8 mel bins) and a bandwidth extender upsampling 16 x 3 = 48
    to 48 kHz. The STFT's bases are persistent buffers the class leaves at zero (the checkpoint holds them): here the
    forward one is the Hann-windowed DFT and the mel filterbank random and positive (the inverse one, which no
    forward reads, stays zero)."""
    from diffusers.pipelines.ltx2.vocoder import LTX2VocoderWithBWE

    torch.manual_seed(seed)
    vocoder = LTX2VocoderWithBWE(
        in_channels=16,
        hidden_channels=32,
        upsample_kernel_sizes=[16, 11, 8],  # kernel - factor even: each upsampler multiplies the length exactly
        upsample_factors=[8, 5, 4],
        resnet_kernel_sizes=[3],
        resnet_dilations=[[1, 3, 5]],
        bwe_in_channels=16,
        bwe_hidden_channels=16,
        bwe_upsample_kernel_sizes=[8, 8, 5],
        bwe_upsample_factors=[4, 4, 3],
        bwe_resnet_kernel_sizes=[3],
        bwe_resnet_dilations=[[1, 3, 5]],
        filter_length=32,
        hop_length=16,
        window_length=32,
        num_mel_channels=8,
        input_sampling_rate=16000,
        output_sampling_rate=48000,
    )
    stft = vocoder.mel_stft.stft_fn
    length = stft.forward_basis.shape[-1]
    frequencies = torch.arange(length // 2 + 1, dtype=torch.float64)[:, None]
    angles = 2 * torch.pi * frequencies * torch.arange(length, dtype=torch.float64) / length
    window = torch.hann_window(length, periodic=True, dtype=torch.float64)
    basis = torch.cat([torch.cos(angles), -torch.sin(angles)]) * window
    with torch.no_grad():
        stft.forward_basis.copy_(basis[:, None].float())
        vocoder.mel_stft.mel_basis.uniform_(0.0, 0.2)
    return vocoder.eval()


def tiny_duration_head(seed: int) -> torch.nn.Module:
    """A random tiny LTX2DurationHead on the tiny connectors' widths (video 64, audio 32), its output bias set so
    it predicts about 1.2 s (inside the pipeline's default 1 to 20 s, so the prediction is not clamped)."""
    import math

    from diffusers.pipelines.ltx2.duration_head import LTX2DurationHead

    torch.manual_seed(seed)
    head = LTX2DurationHead(64, 32, pooler_hidden_dim=16, num_pooler_heads=2, mlp_hidden_dim=16)
    with torch.no_grad():
        head.mlp_out.bias.fill_(math.log(1.2))
    return head.eval()


def tiny_upsampler(seed: int = 5) -> torch.nn.Module:
    """A random x2 latent upsampler for the tiny VAE's 8 latent channels."""
    from diffusers.pipelines.ltx2.latent_upsampler import LTX2LatentUpsamplerModel

    torch.manual_seed(seed)
    return LTX2LatentUpsamplerModel(in_channels=8, mid_channels=32, num_blocks_per_stage=1).eval()


def tiny_pipeline(version: str = "2.0", seed: int = 0, image_to_video: bool = False):
    """LTX2Pipeline (or LTX2ImageToVideoPipeline: the same components) with random tiny components of
    LTX-2.0's, LTX-2.3's or LTX-2.5's layout, deterministic per seed."""
    from diffusers import FlowMatchEulerDiscreteScheduler, LTX2ImageToVideoPipeline, LTX2Pipeline

    tokenizer = gemma_tokenizer()
    # Through LTX-2.3 the text encoder is the prompt enhancer (--enhance_prompt), with the processor's chat template;
    # LTX-2.5's is a model of its own, with Gemma 4's processor (not built here: tiny_processor).
    text_encoder = tiny_text_encoder(tokenizer, seed, version)
    if version == "2.5":
        extra = {"duration_head": tiny_duration_head(seed + 6)}
    else:
        extra = {"processor": tiny_processor()}
        with_image_tokens(text_encoder, extra["processor"])
    pipe = (LTX2ImageToVideoPipeline if image_to_video else LTX2Pipeline)(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=tiny_vae(seed + 1, version),
        audio_vae=tiny_audio_vae(seed + 2),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        connectors=tiny_connectors(seed + 3, version),
        transformer=tiny_transformer(seed + 4, version),
        vocoder=(tiny_vocoder if version == "2.0" else tiny_bwe_vocoder)(seed + 5),
        **extra,
    )
    pipe.preset_extras = {"latent_upsampler": tiny_upsampler(seed + 7)}  # the two-stage pipeline's, for --upsample
    return pipe
