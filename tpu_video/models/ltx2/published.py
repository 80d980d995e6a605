"""LTX-2's published checkpoints (`Lightricks/LTX-2`, the 19B LTX-2.0 dev model in diffusers' layout, and
`Lightricks/LTX-2.3`), their configs kept in code for `--plan` (offline, architecture only): the values
diffusers' conversion script (scripts/convert_ltx2_to_diffusers.py, versions "2.0" and "2.3") writes. Each
entry maps a component to (library, class, config.json values); the classes' own defaults fill the rest."""

from __future__ import annotations

from typing import Any

# The published LTX-2 scheduler config's shift settings (scheduler/scheduler_config.json).
SCHEDULER = {
    "base_image_seq_len": 1024,
    "max_image_seq_len": 4096,
    "base_shift": 0.95,
    "max_shift": 2.05,
    "shift_terminal": 0.1,
    "use_dynamic_shifting": True,
    "time_shift_type": "exponential",
}

# 48 blocks; video 32 heads x 128 (width 4096), audio 32 heads x 64 (width 2048); Gemma's width 3840 in.
LTX2_TRANSFORMER = {
    "in_channels": 128,
    "num_attention_heads": 32,
    "attention_head_dim": 128,
    "cross_attention_dim": 4096,
    "audio_in_channels": 128,
    "audio_num_attention_heads": 32,
    "audio_attention_head_dim": 64,
    "audio_cross_attention_dim": 2048,
    "num_layers": 48,
    "caption_channels": 3840,
    "rope_type": "split",
    "rope_double_precision": True,
}
# Every Gemma 3 12B hidden state (48 layers and the embeddings: 49) projected to 3840, two 2-layer connectors.
LTX2_CONNECTORS = {"caption_channels": 3840, "text_proj_in_factor": 49, "rope_type": "split"}
# 32x spatial, 8x temporal, 128 latent channels.
LTX2_VAE = {
    "latent_channels": 128,
    "block_out_channels": [256, 512, 1024, 2048],
    "decoder_block_out_channels": [256, 512, 1024],
    "layers_per_block": [4, 6, 6, 2, 2],
    "decoder_layers_per_block": [5, 5, 5, 5],
    "spatio_temporal_scaling": [True, True, True, True],
    "decoder_spatio_temporal_scaling": [True, True, True],
    "decoder_inject_noise": [False, False, False, False],
    "downsample_type": ["spatial", "temporal", "spatiotemporal", "spatiotemporal"],
    "upsample_residual": [True, True, True],
    "upsample_factor": [2, 2, 2],
    "timestep_conditioning": False,
    "decoder_causal": False,  # the class default is True
    "decoder_spatial_padding_mode": "reflect",
    "spatial_compression_ratio": 32,
    "temporal_compression_ratio": 8,
}
# 16 kHz mel (64 bins, hop 160) to 8 latent channels, 4x in time and mel.
LTX2_AUDIO_VAE = {
    "base_channels": 128,
    "ch_mult": [1, 2, 4],
    "num_res_blocks": 2,
    "resolution": 256,
    "latent_channels": 8,
    "norm_type": "pixel",
    "causality_axis": "height",
    "mid_block_add_attention": False,
    "sample_rate": 16000,
    "mel_hop_length": 160,
    "is_causal": True,
    "mel_bins": 64,
}
LTX2_VOCODER = {"in_channels": 128, "hidden_channels": 1024, "output_sampling_rate": 24000}

# LTX-2.3 (version "2.3" of the same script): gated attention, cross-attention modulation and perturbed
# attention on, the prompt projected per stream in the connectors (8 layers each), a wider decoder, and a
# vocoder with bandwidth extension to 48 kHz. The audio VAE and the text encoder are LTX-2.0's.
LTX23_TRANSFORMER = {
    **LTX2_TRANSFORMER,
    "gated_attn": True,
    "cross_attn_mod": True,
    "audio_gated_attn": True,
    "audio_cross_attn_mod": True,
    "use_prompt_embeddings": False,
    "perturbed_attn": True,
}
LTX23_CONNECTORS = {
    **LTX2_CONNECTORS,
    "video_connector_num_attention_heads": 32,
    "video_connector_num_layers": 8,
    "video_gated_attn": True,
    "audio_connector_num_attention_heads": 32,
    "audio_connector_attention_head_dim": 64,
    "audio_connector_num_layers": 8,
    "audio_gated_attn": True,
    "per_modality_projections": True,
    "video_hidden_dim": 4096,
    "audio_hidden_dim": 2048,
    "proj_bias": True,
}
LTX23_VAE = {
    **LTX2_VAE,
    "block_out_channels": [256, 512, 1024, 1024],
    "decoder_block_out_channels": [256, 512, 512, 1024],
    "layers_per_block": [4, 6, 4, 2, 2],
    "decoder_layers_per_block": [4, 6, 4, 2, 2],
    "decoder_spatio_temporal_scaling": [True, True, True, True],
    "decoder_inject_noise": [False, False, False, False, False],
    "upsample_type": ["spatiotemporal", "spatiotemporal", "temporal", "spatial"],
    "upsample_residual": [False, False, False, False],
    "upsample_factor": [2, 2, 1, 2],
    "decoder_spatial_padding_mode": "zeros",
}
LTX23_VOCODER = {
    "in_channels": 128,
    "hidden_channels": 1536,
    "upsample_kernel_sizes": [11, 4, 4, 4, 4, 4],
    "upsample_factors": [5, 2, 2, 2, 2, 2],
    "act_fn": "snakebeta",
    "antialias": True,
    "antialias_ratio": 2,
    "antialias_kernel_size": 12,
    "final_act_fn": None,
    "final_bias": False,
    "bwe_in_channels": 128,
    "bwe_hidden_channels": 512,
    "bwe_out_channels": 2,
    "bwe_upsample_kernel_sizes": [12, 11, 4, 4, 4],
    "bwe_upsample_factors": [6, 5, 2, 2, 2],
    "bwe_resnet_kernel_sizes": [3, 7, 11],
    "bwe_resnet_dilations": [[1, 3, 5], [1, 3, 5], [1, 3, 5]],
    "bwe_act_fn": "snakebeta",
    "bwe_leaky_relu_negative_slope": 0.1,
    "bwe_antialias": True,
    "bwe_antialias_ratio": 2,
    "bwe_antialias_kernel_size": 12,
    "bwe_final_act_fn": None,
    "bwe_final_bias": False,
    "filter_length": 512,
    "hop_length": 80,
    "window_length": 512,
    "num_mel_channels": 64,
    "input_sampling_rate": 16000,
    "output_sampling_rate": 48000,
}
# Gemma 3 12B (Gemma3Config kwargs): the text model stage 1 runs, and the vision tower it never runs.
GEMMA3_12B = {
    "text_config": {
        "hidden_size": 3840,
        "intermediate_size": 15360,
        "num_hidden_layers": 48,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "sliding_window": 1024,
        "vocab_size": 262208,
    },
    "vision_config": {
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "num_hidden_layers": 27,
        "num_attention_heads": 16,
        "image_size": 896,
        "patch_size": 14,
        "vision_use_head": False,
    },
}

# The x2 spatial latent upsampler (the `latent_upsampler` subfolder beside the pipeline: LTX2LatentUpsamplerModel
# kwargs), as the conversion script's get_ltx2_spatial_latent_upsampler_config writes it and loads the published
# weights into with strict=True: 1024 middle channels (the class default; ports of the original code default to
# 512); LTX-2.0's rational resampler at scale 2, LTX-2.3's plain pixel shuffle.
LTX2_UPSAMPLER = {
    "in_channels": 128,
    "mid_channels": 1024,
    "num_blocks_per_stage": 4,
    "dims": 3,
    "spatial_upsample": True,
    "temporal_upsample": False,
    "rational_spatial_scale": 2.0,
    "use_rational_resampler": True,
}
LTX23_UPSAMPLER = {**LTX2_UPSAMPLER, "use_rational_resampler": False}

PUBLISHED: dict[str, dict[str, Any]] = {
    "Lightricks/LTX-2": {
        "_class_name": ("diffusers", "LTX2Pipeline"),
        "transformer": ("diffusers", "LTX2VideoTransformer3DModel", LTX2_TRANSFORMER),
        "connectors": ("ltx2", "LTX2TextConnectors", LTX2_CONNECTORS),
        "vae": ("diffusers", "AutoencoderKLLTX2Video", LTX2_VAE),
        "audio_vae": ("diffusers", "AutoencoderKLLTX2Audio", LTX2_AUDIO_VAE),
        "vocoder": ("ltx2", "LTX2Vocoder", LTX2_VOCODER),
        "text_encoder": ("transformers", "Gemma3ForConditionalGeneration", GEMMA3_12B),
        "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler", SCHEDULER),
        "_subfolders": {"latent_upsampler": ("ltx2", "LTX2LatentUpsamplerModel", LTX2_UPSAMPLER)},
    },
}
PUBLISHED["Lightricks/LTX-2.3"] = {  # LTX-2.0's audio VAE, text encoder and scheduler
    **PUBLISHED["Lightricks/LTX-2"],
    "transformer": ("diffusers", "LTX2VideoTransformer3DModel", LTX23_TRANSFORMER),
    "connectors": ("ltx2", "LTX2TextConnectors", LTX23_CONNECTORS),
    "vae": ("diffusers", "AutoencoderKLLTX2Video", LTX23_VAE),
    "vocoder": ("ltx2", "LTX2VocoderWithBWE", LTX23_VOCODER),
    "_subfolders": {"latent_upsampler": ("ltx2", "LTX2LatentUpsamplerModel", LTX23_UPSAMPLER)},
}
