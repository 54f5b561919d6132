# Everything a fresh machine needs: `make demo` and `make test` create .venv,
# install torch==2.13.0 when torch is absent (from PyPI that is the CUDA build on Linux x86_64, several GB;
# this project's machines take a CPU build from disk; set TORCH_PIN or install torch first to choose), and install acco
# with the extras its tests cover (transformers, accelerate, lightning and torchtitan for the integrations).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH_PIN ?= torch==2.13.0

.PHONY: venv test test-all mutations dist-check demo study lr-study bench clean

$(VENV)/.ready: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_PIN)"
	$(PIP) install -q -e ".[test,examples,hf,lightning,torchtitan]"
	@touch $@

venv: $(VENV)/.ready

## The quick tier (CPU; multi-rank tests on gloo, each with a timeout): unit tests, the oracle equivalences at
## 2 ranks, one run of each integration, one TP and one FSDP2 mesh, the README's block. Tests marked slow are left out.
test: $(VENV)/.ready
	ACCO_REQUIRE_EXTRAS=1 OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "not slow"

## Every test (what CI runs): the quick tier, plus launches of the examples, studies and benchmarks, two hosts on
## network namespaces (as root), how processes end under signals, and equivalences at 1, 3 and 4 ranks.
test-all: $(VENV)/.ready
	ACCO_REQUIRE_EXTRAS=1 OMP_NUM_THREADS=1 $(PY) -m pytest -q --durations=15

## The mutations (tests/mutations.py) of the files changed since .ci/mutation-base (the main that the last
## landed change was checked against): each breaks the library and its tests must fail. CI runs this.
mutations: $(VENV)/.ready
	OMP_NUM_THREADS=1 $(PY) tests/mutations.py --touched $$(cat .ci/mutation-base)

## The package as users install it: build the wheel and sdist (python -m build, into dist/), install the wheel
## into a fresh venv (.dist-venv, with torch pinned as above) and, from outside the clone, import it, take a 2-rank
## gloo step and run acco-probe --help (tests/wheel_smoke.py). CI runs it after test-all.
dist-check: $(VENV)/.ready
	rm -rf dist .dist-venv
	$(PY) -m build --outdir dist .
	$(PYTHON) -m venv .dist-venv
	.dist-venv/bin/python -m pip install -q "$(TORCH_PIN)"
	.dist-venv/bin/python -m pip install -q dist/torch_acco-*.whl
	cd "$$(mktemp -d)" && OMP_NUM_THREADS=1 $(CURDIR)/.dist-venv/bin/python $(CURDIR)/tests/wheel_smoke.py --source $(CURDIR)

## What ACCO buys (about 5 minutes on 2 cores): DDP, ZeRO-1, ACCO and ACCO + int8 on 2 CPU ranks over a simulated slow link,
## a table of tokens/s, communication hidden and held-out loss, a verdict, and runs/demo/loss_vs_time.png.
## Then the slow link (a round lasts 3x the compute: int8 rounds, runs/demo-slow/).
demo: $(VENV)/.ready
	OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --standalone --nproc_per_node=2 examples/demo.py $(DEMO_ARGS)
	OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --standalone --nproc_per_node=2 examples/demo.py \
		--link-share 3 --out runs/demo-slow $(DEMO_ARGS)

## The convergence study of docs/studies/convergence-runs.md (about 100 minutes on 2 cores).
study: $(VENV)/.ready
	$(PY) examples/gpt/study.py --out runs/study --steps 600 --eval-every 50

## The learning-rate study of docs/studies/lr-study.md (DDP vs ACCO, 5 LRs, 3 seeds; DPU 1 seed; the remedy acco-sync20
## at 2e-3 and 4e-3): resumable, appends to docs/convergence_data/lr_study.jsonl, then rewrites its tables and
## plots. On 2 cores a run takes 270-600 s with the machine to itself: the 35 runs the question needs about 4 h, all
## 41 about 5.5 h (the recorded 41 took 7.98 h, some beside tests). `make lr-study LR_STUDY_ARGS=--report-only` redraws.
## While tests or a timing benchmark run: `sh examples/nanogpt/pause.sh stop`, then `... cont` (the ranks too).
lr-study: $(VENV)/.ready
	nice -n 19 $(PY) examples/nanogpt/study.py $(LR_STUDY_ARGS)

## The benchmarks of docs/benchmarks.md (root: network namespaces and tc). Every point 3 times, the methods
## interleaved; report.py gives median [min-max]. On 2 cores (2026-11-23): overlap 29 min, hetero 14 min,
## memory 28 min (partly alongside a test run), about 70 minutes in all.
## Records are appended: start from an empty runs/bench (move an earlier run's records away first).
bench: $(VENV)/.ready
	@test ! -e runs/bench || { echo "runs/bench exists: move the earlier run's records away first"; exit 1; }
	$(PY) benchmarks/overlap.py --rates 500,125,62 --repeats 3 \
		--methods compute,acco,acco:ring0,dpu,sync,ddp,ddp-zero --out runs/bench/overlap.jsonl
	$(PY) benchmarks/hetero.py --rates 125 --repeats 3 --out runs/bench/hetero.jsonl
	$(PY) benchmarks/memory.py --ranks 2,4 --dtypes fp32,bf16 --repeats 3 --methods acco,dpu,sync,ddp,ddp-zero \
		--out runs/bench/memory.jsonl
	$(PY) benchmarks/report.py runs/bench/overlap.jsonl runs/bench/hetero.jsonl runs/bench/memory.jsonl \
		--plot docs/benchmarks_overlap.png

clean:
	rm -rf $(VENV) runs .pytest_cache dist .dist-venv
