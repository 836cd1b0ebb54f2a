# Every target creates or reuses .venv and installs what it needs.
# torch is pinned to the CPU build that this machine has locally; an unpinned torch pulls CUDA.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: serve test test-triton chat install clean

# The server needs only pagoda's own dependencies.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e .
	@# The native CPU kernels (pagoda/csrc) into their cache, so no first start waits for them; without a
	@# compiler this says so in one line and pagoda runs its PyTorch path.
	$(VENV)/bin/pagoda --version 2>/dev/null || echo "pagoda: native CPU kernels not built; the PyTorch path runs"
	touch $(STAMP)

# The tests also need the test tools and the optional Ray extra (its tests run, not skip).
$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test,ray,otel]'
	touch $(TEST_STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/pagoda serve $(ARGS)

chat: $(STAMP)
	$(VENV)/bin/pagoda chat $(ARGS)

# -rs lists every skipped test with its reason under the summary.
test: $(TEST_STAMP)
	$(PY) -m pytest -q -rs $(ARGS)

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
