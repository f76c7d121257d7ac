# Front door. `make serve` and `make test` install what is missing first (scripts/install.sh).
VENV  ?= $(or $(VLLM_MS_VENV),$(HOME)/.cache/vllm-mindspore/venv)
PY    := $(VENV)/bin/python
HOST  ?= 127.0.0.1
PORT  ?= 8000
DEMO_MODEL := demo_model
MODEL ?= $(DEMO_MODEL)
SERVE_ARGS ?= --max-model-len 2048

export VLLM_MS_VENV := $(VENV)

.PHONY: install install-mindformers serve test bench demo-model

install:
	@bash scripts/install.sh

# The optional MindSpore Transformers package (vLLM_MODEL_BACKEND=MindFormers runs its model classes).
install-mindformers:
	@bash scripts/install.sh --with-mindformers

$(DEMO_MODEL)/config.json: | install
	$(PY) scripts/make_demo_model.py $(DEMO_MODEL)

demo-model: $(DEMO_MODEL)/config.json

serve: install $(if $(filter $(DEMO_MODEL),$(MODEL)),$(DEMO_MODEL)/config.json)
	$(VENV)/bin/vllm-mindspore serve $(MODEL) --host $(HOST) --port $(PORT) $(SERVE_ARGS)

# The tests cover both backends: the optional package is installed too (one small wheel).
test: install-mindformers
	$(PY) -m pytest -q --durations=30 tests

bench: install $(DEMO_MODEL)/config.json
	$(PY) benchmarks/throughput.py --model $(DEMO_MODEL) --engines vllm-mindspore,hf --workloads offline --repeats 1
