# The README's two commands, `make demo` and `make test`, work on a fresh machine with only Python:
# they create .venv and install what they need. `make gpu-check` is what a GPU machine runs.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch: this project's machines serve torch==2.13.0 as a local CPU wheel; elsewhere set TORCH_SPEC
# (e.g. to a CPU index URL or the CUDA build you want).
TORCH_SPEC ?= torch==2.13.0
# `make test` needs the test tools and offline NVRTC (`.ci/run` checks the kernels with it);
# `make demo` needs only torch and scikit-learn (the data set).
EXTRAS ?= torch,test,dev,demo,nvrtc
DEMO_EXTRAS ?= torch,demo
ARCHS ?= sm_80,sm_90
comma := ,
# One stamp per extras set, so that `make demo` followed by `make test` still installs the test extras.
stamp = $(BIN)/.installed-$(subst $(comma),+,$(1))

.PHONY: demo test lint check-kernels gpu-check clean

$(BIN)/.installed-%: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_SPEC)
	$(BIN)/python -m pip install -q -e ".[$(subst +,$(comma),$*)]"
	touch $@

demo: $(call stamp,$(DEMO_EXTRAS))
	$(BIN)/cukit demo

lint: $(call stamp,$(EXTRAS))
	$(BIN)/ruff check .

check-kernels: $(call stamp,$(EXTRAS))
	$(BIN)/cukit check-kernels --arch $(ARCHS)

test: lint check-kernels
	$(BIN)/python -m pytest -q

# On a GPU machine with torch and CuPy already installed (no network): see .ci/gpu-check.
gpu-check:
	bash .ci/gpu-check

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .hypothesis
