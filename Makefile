# Every target creates or reuses .venv and installs what it needs.
# torch is pinned to the CPU build that this machine has locally; an unpinned torch pulls CUDA.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: serve test chat bench install clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/pagoda serve $(ARGS)

chat: $(STAMP)
	$(VENV)/bin/pagoda chat $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
