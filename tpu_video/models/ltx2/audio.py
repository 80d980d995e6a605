"""Stage 3's soundtrack: the audio VAE's decode of stage 2's audio latents to a mel spectrogram and the
vocoder's waveform, as LTX2Pipeline computes them (`audio_vae.decode`, then `vocoder`), as one module.

Stage 3 runs it on the host in PyTorch with `--backend torchax` (on TPU, the compiler took 20 minutes for
LTX-2.0's; docs/ltx2.md) and on the torch device with `--backend torch`. On our 2-core host, LTX-2.3's vocoder
(with its bandwidth extension to 48 kHz) took 20 s in fp32 for 5 s of sound (benchmarks/ltx2_audio_decode.py).
"""

from __future__ import annotations

import torch


class Soundtrack(torch.nn.Module):
    """audio latents (B, C, T, mel) -> waveform (B, channels, samples) in [-1, 1] at `sample_rate`."""

    COMPONENTS = ("audio_vae", "vocoder")  # the pipeline components it is built from, in __init__'s order

    def __init__(self, audio_vae: torch.nn.Module, vocoder: torch.nn.Module) -> None:
        super().__init__()
        self.audio_vae = audio_vae
        self.vocoder = vocoder
        self.sample_rate = int(vocoder.config.output_sampling_rate)

    def forward(self, audio_latents: torch.Tensor) -> torch.Tensor:
        mel = self.audio_vae.decode(audio_latents.to(self.audio_vae.dtype), return_dict=False)[0]
        return self.vocoder(mel)
