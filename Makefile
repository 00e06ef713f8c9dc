# Two commands do all set-up (README): `make demo` runs the embedded default, `make test` passes the tests.
SHELL := /bin/bash
PY312 ?= $(shell for p in $$(ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.12*/bin/python3.12 2>/dev/null) $$(command -v python3.12); do "$$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && echo "$$p" && break; done)
VENV ?= .venv
PYTEST_ARGS ?= -n 2 --dist loadgroup --durations=25

.PHONY: venv oracle redis demo test clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@test -n "$(PY312)" || { echo "error: Python 3.12 not found (set PY312=/path/to/python3.12)"; exit 1; }
	$(PY312) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	# through uv (pip's sources, pip as the fallback): the same versions, 2-4x faster (tools/fast_install.py)
	$(VENV)/bin/python tools/fast_install.py $(VENV)/bin/python -e ".[test]"
	# KV handoff data path A (optional): NIXL without its declared deps (they pull CUDA torch); module nixl_cu13
	$(VENV)/bin/pip install -q --no-deps nixl-cu13==1.5.1 || echo "warning: nixl-cu13 not installed: KV handoff uses the gRPC path only"
	touch $@

# The KV handoff tests start a real redis-server (Debian package) on a free loopback port.
redis:
	@command -v redis-server >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get install -y -q redis-server || { apt-get update -q && apt-get install -y -q redis-server; }; \
	  else sudo -n apt-get install -y -q redis-server; fi; }

oracle:
	bash tests/oracle/build_venv.sh >/dev/null

demo: venv
	$(VENV)/bin/dsjax generate --prompt "$$(printf 'import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.')" --max-new-tokens 64

test: venv oracle redis
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .oracle-venv
