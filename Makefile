# Fresh machine: Python 3.11 + pip + the local torch 2.13.0 CPU wheel. Everything else comes from PyPI.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
OUT ?= stage_outputs
MODEL ?= tiny-cogvideox
PROMPT ?= A panda playing a guitar in a bamboo forest

.PHONY: install demo test test-fast lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first and pinned, so pip takes the local CPU build instead of a CUDA one from the index.
# `plan` adds libtpu (~700 MB): the TPU compiler that --plan and its tests use on this CPU host.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[cpu,plan,dev]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/python stage1_text_encoder.py --model $(MODEL) --prompt "$(PROMPT)" --output_dir $(OUT)
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

clean:
	rm -rf $(OUT)/*.safetensors $(OUT)/*.json $(OUT)/*.mp4
