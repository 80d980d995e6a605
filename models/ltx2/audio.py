"""Stage 3's soundtrack: the audio VAE's decode of stage 2's audio latents to a mel spectrogram and the
vocoder's waveform, as LTX2Pipeline computes them (`audio_vae.decode`, then `vocoder`). They run on the
host in PyTorch with either stage-3 backend (small models next to the video VAE; docs/ltx2.md)."""

from __future__ import annotations

import torch


def decode_audio(source, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """The waveform (channels, samples) float32 in [-1, 1] and its sample rate (the vocoder's output rate)."""
    audio_vae = source.load("audio_vae", dtype=dtype).eval()
    vocoder = source.load("vocoder", dtype=dtype).eval()
    with torch.no_grad():
        mel = audio_vae.decode(tensors["audio_latents"].to(audio_vae.dtype), return_dict=False)[0]
        waveform = vocoder(mel)
    return waveform[0].float(), int(vocoder.config.output_sampling_rate)
