# Fresh machine: Python 3.11 + pip + the local torch 2.13.0 CPU wheel. Everything else comes from PyPI.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
OUT ?= stage_outputs
MODEL ?= tiny-cogvideox
PROMPT ?= A panda playing a guitar in a bamboo forest
# An image-to-video preset (MODEL=tiny-wan2.1-i2v, ...) animates a colour gradient the demo draws itself.
DEMO_IMAGE := $(OUT)/demo_first_frame.png
IMAGE_FLAGS := $(if $(findstring i2v,$(MODEL)),--image $(DEMO_IMAGE))
DRAW_IMAGE := import numpy as np; from PIL import Image; y, x = np.mgrid[0:240, 0:360]; rgb = [x * 255 // 359, y * 255 // 239, np.full_like(x, 96)]; Image.fromarray(np.stack(rgb, -1).astype(np.uint8)).save('$(DEMO_IMAGE)')

# The quantization tests' reference (tests/test_quantize.py), kept off the import path: diffusers imports
# any installed torchao at start-up.
TORCHAO_VERSION := 0.18.0
UV_VERSION := 0.13.9
# Where this kind of machine keeps its local torch wheel (pip's find-links).
WHEELS ?= /opt/wheels

.PHONY: install demo test test-fast lint clean

# The interpreter is checked first: pip would refuse 3.13 only after installing torch.
$(BIN)/python:
	@$(PYTHON) -c "import sys; v = sys.version_info[:2]; sys.exit(0 if (3, 11) <= v <= (3, 12) else 'error: $(PYTHON) is Python %d.%d; this project runs on 3.11 or 3.12 (make PYTHON=python3.11 ...)' % v)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q uv==$(UV_VERSION)

# uv installs into the venv what pip would: `make install` took 45 s instead of 87 s from an empty cache
# (2026-11-28, docs/performance.md); --compile-bytecode as pip does, since every test subprocess imports
# these packages. torch first and pinned, from the local CPU wheel in $(WHEELS) (uv reads no pip.conf),
# so that nothing takes a CUDA build from the index. `plan` adds libtpu (~700 MB): the TPU compiler that
# --plan and its tests use on this CPU host; `crf` adds PyAV for LTX-2 image-to-video (GPL x264 inside its
# wheels: an opt-in extra elsewhere).
UV_INSTALL = $(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(UV_INSTALL) $(if $(wildcard $(WHEELS)),--find-links $(WHEELS)) torch==2.13.0
	$(UV_INSTALL) -e ".[cpu,plan,crf,dev]"
	$(UV_INSTALL) --no-deps --target $(VENV)/torchao-reference torchao==$(TORCHAO_VERSION)
	touch $@

install: $(VENV)/.installed

demo: install
	$(if $(IMAGE_FLAGS),mkdir -p $(OUT) && $(BIN)/python -c "$(DRAW_IMAGE)")
	$(BIN)/python stage1_text_encoder.py --model $(MODEL) --prompt "$(PROMPT)" --output_dir $(OUT) $(IMAGE_FLAGS)
	$(BIN)/python stage2_transformer.py --input_dir $(OUT)
	$(BIN)/python stage3_vae_decoder.py --input_dir $(OUT)

# Every core (pytest-xdist); the slow tests are scheduled first (tests/conftest.py).
test: install
	$(BIN)/python -m pytest -q -n auto --dist loadscope --durations=15

# A quick local loop (under 3 minutes on 2 cores): the file contract, CLI errors, CogVideoX's parity with
# its diffusers pipeline, the Splash kernel's exactness on one device.
test-fast: install
	$(BIN)/python -m pytest -q -n auto tests/test_contract.py tests/test_user_errors.py \
		tests/test_cogvideox_vs_diffusers.py tests/test_splash_attention.py -k "not sharded"

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# What the stages write in $(OUT): stage files, the config, batch index and MagCache ratios, videos, previews,
# WAVs, the demo's image, temporaries a killed run left, and a batch's per-video folders (each holds a config);
# nothing else (a user's own images stay).
clean:
	rm -rf $(OUT)/*.safetensors $(OUT)/generation_config.json $(OUT)/batch.json $(OUT)/mag_ratios.json
	rm -rf $(OUT)/*.mp4 $(OUT)/*_preview.png $(OUT)/*.wav $(DEMO_IMAGE) $(OUT)/.*.tmp* $(OUT)/.tpu-video.lock
	for folder in $(OUT)/*/; do [ -f "$$folder/generation_config.json" ] && rm -rf "$$folder"; done; true
