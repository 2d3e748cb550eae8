"""The device-call plan: what each run takes on a GPU (RUN_S's estimates, GPU_S's measurements), the calls still
to make, session by session (CALLS), the payload's sets each step needs (STEP_SETS, STEP_ADDS, sets_missing), the
seconds around the checklist in a call (CALL_S), and the plan they make: `plan` and `plan_markdown`, what
`checklist.py --plan` prints and bench/gpu_check/README.md shows."""

from __future__ import annotations

from checklist_steps import LLM_CASES

# What each run takes on the GPU, for --budget_s and the call plan (--plan): STARTUP_SCALE x its wall time in the
# CPU dry run plus the real work's seconds on the GPU. A dry run is nearly all start-up (Python, imports, the
# launcher, loading model and data, saving): CPU work the GPU machine does too, there with a CUDA torch, CUDA's
# start and the real models, hence the 1.5. The work is estimated from its size (eager steps are launch-bound:
# ~15 ms a step of MiniLM, ~60 ms of the 135M LLM, ~20 ms a generated token), to be checked against call 1's runs.
# (step, run): (dry-run wall s, measured 2026-11-25 with --jobs 1 on 2 busy cores; GPU work s, estimated).
STARTUP_SCALE = 1.5
RUN_S = {
    ("env", "plain"): (3.0, 0),  # the machine's facts: one import of torch and the packages
    ("env", "llm"): (35.0, 0),  # the same and the LLM: the real GGUF dequantized (measured at real size), data
    ("env", "llm_cached"): (11.6, 0),  # the dequantized GGUF kept in hf_home by an earlier call of this machine
    ("1", "ours"): (11.7, 10),  # 225 steps of MiniLM, batch 8, evaluated on 379 reviews each epoch
    ("1", "trainer"): (12.1, 10),
    ("1", "trainer_grouped"): (12.1, 10),  # not in the dry run: trainer's
    ("2a", "lora"): (9.0, 15),  # 75 steps, generation on the 379 records twice (zero-shot too)
    ("2a", "lora_gc"): (9.0, 12),  # lora and lora_gc are not in the dry run: lora_packed's start-up
    ("2a", "lora_packed"): (9.0, 8),
    ("2a", "trl"): (9.0, 20),  # no trl in the dry run: ours' start-up; TRL's imports and data preparation
    ("2b", "full"): (6.3, 10),
    ("2b", "full_gc"): (6.3, 40),  # not yet run on the GPU: full's there (39 s) and a third more for recomputation
    ("2b", "trl"): (6.3, 25),
    ("3", "eager"): (9.0, 10),  # only when step 2a's lora run is not there (a machine started afresh)
    # inductor by regions (one layer compiled for all 30), forward and backward, a variant for the first layer (its
    # input needs no gradient), a recompile for new lengths and one for the epoch's last batch; compiled whole it
    # took 119 s, 216 s and over 90 s for those three on session 3's H100, and was stopped at 438 s
    ("3", "compiled"): (18.9, 200),
    ("4", "train"): (12.4, 40),  # with the reload helper; 20 steps, 2 sharded checkpoints, 64 prompts
    ("5", "zero2"): (10.7, 60),  # DeepSpeed's start, 20 steps, 64 prompts, the save; with the reload (one helper
    # for both stages since 2026-12-07: these estimates, measured with one each, keep its time twice)
    ("5", "zero3"): (9.4, 60),  # both through tests/launched/deepspeed_on_cpu.py since 2026-11-26
    ("6", "plain"): (11.3, 15),  # 10 epochs of 1,437 digits; the dry run runs it as step 7's image run
    ("6", "sync_batchnorm"): (11.3, 15),  # the dry run stops at the CPU's refusal: taken as plain's
    ("7", "image"): (11.3, 15),
    ("7", "lora"): (8.0, 12),
    ("8", "manifest"): (7.8, 200),  # 8 GB: two saves and two resumes, 3 times: ~100 GB through the disk
    # Steps 9 and 10 run the prepared LLM (the dry run's tiny one: 19.7 s and 18.2 s on 2 busy cores); with the real
    # 135M model a run started in 29 s here, and the pairs' or prompts' preparation took 10 s.
    ("9", "bench_dpo"): (126.0, 90),  # 4 runs: 10 s of preparation and 29 s a run
    ("10", "bench_grpo"): (68.0, 120),  # 2 runs; on the GPU 91 steps of 16 samples of 8 tokens each
    # 2 runs of 300 pairs: TRL (step 9's 600 took about 90 s) and ours compiled, its 75 steps and inductor's
    # compilations (the dry run traces 6 graphs: the policy and the reference without gradients, each for its first
    # length and then dynamic, and evaluation with the adapters on and off), taken at 50 s each
    ("11", "bench_dpo"): (30.0, 400),
    # 12 steps of each of 3 contenders, steps 4 to 8 under torch.profiler: session 4 measured 264 s for two (ours 112
    # s, TRL's 143, the prompts' preparation 9); the third, ours without cuDNN's attention, taken as ours'
    ("12", "bench_grpo"): (11.0, 360),
    # Step 13 (dry run measured 2026-12-07, --jobs 1 on 2 busy cores; TRL's with trl 1.16.0 put on the path, as CI
    # has none). The work: 2a's lora on session 1's H200 (GPU_S: 65 s, 22 of them training, 9.5 the zero-shot
    # evaluation, which step 13 does not run), with a 4-bit base a third more training (bitsandbytes dequantizes each
    # of the 210 linear layers' weights in every forward and backward pass: launches, on a launch-bound step), about
    # 2 s more evaluation, 3 s of quantizing at load; TRL's from its lora_trl (61 s, 38 training) in the same way.
    ("13", "qlora"): (5.7, 61),
    ("13", "trl"): (6.3, 71),
    ("13", "lora"): (6.3, 46),  # the LoRA reference: 2a's lora less its zero-shot evaluation
    # Step 14 (dry run measured 2026-12-07, --jobs 1): the LLM as train.py's classifier on step 1's work, 225 steps of
    # 8 reviews of up to 128 tokens, 3 evaluations of 379. Taken at 2b's full run's pace (its record: 11.5 s for 75
    # steps, 153 ms a step on session 1's H200, launch-bound), 34 s, with loading, evaluation and the model's save;
    # LoRA's adapters add launches and its merge a save; QLoRA dequantizes each linear layer's weights in every pass
    # and its merge reads the base again; the reload: 3 models of 135M.
    ("14", "full"): (9.0, 45),
    ("14", "lora"): (9.1, 50),
    ("14", "qlora"): (9.1, 65),
    ("14", "reload"): (4.6, 10),
    # Step 15 (dry run measured 2026-12-07, --jobs 1 on 2 busy cores): the LLM classifier's LoRA at batch 32, 57 steps
    # of up to 128 tokens, 3 evaluations of 379: launch-bound as step 14's (its LoRA 50 s at batch 8), a batch of 32
    # a little longer a step; checkpointing recomputes each layer's forward: a third more of the training's time.
    ("15", "lora"): (13.0, 30),
    ("15", "lora_gc"): (13.0, 36),
}
# Each run's wall seconds on the first GPU session (an H200, 2026-11-26; the LLM's weights drawn at random, the
# runs as the steps make them): they replace RUN_S's estimates, which were 1.1 to 3 times too short for the LLM.
GPU_S = {
    ("env", "llm_shape"): 16.5,
    ("1", "ours"): 31.9,
    ("1", "trainer"): 29.7,
    ("1", "trainer_grouped"): 36.4,
    ("2a", "lora"): 65.4,  # with the zero-shot evaluation: 379 answers generated twice
    ("2a", "lora_trl"): 61.2,
    ("2a", "lora_gc"): 77.7,
    ("2a", "lora_gc_trl"): 66.5,
    ("2a", "lora_packed"): 47.3,
    ("2a", "lora_packed_trl"): 30.7,
    ("2b", "full"): 39.0,
    ("2b", "full_trl"): 34.8,
    ("4", "train"): 55.0,  # with the reload
    ("7", "image"): 30.5,
    ("7", "lora"): 66.6,
    # Session 2 (a second H200, 2026-11-26): the steps' whole wall time, from their records.
    ("9", "bench_dpo"): 370.3,  # 4 runs; 279 s estimated
    # Its runs: 146.6 s and 111.8 s (94.7 s and 91.0 s on session 1's machine); since then a third, ours with
    # --compile_generation, taken as ours' run and a minute more for inductor's compilation (not yet run on a GPU).
    # Session 3 (an H100, 2026-11-27): its three runs, the third with --compile_generation (76, 90 and 112 s).
    ("10", "bench_grpo"): 284.4,
    # Session 4 (an H200, 2026-11-28): step 3's runs, its compiled one by regions. Its step 12 (GRPO's and DPO's
    # benchmarks then, two contenders each: 264 s and 152 s against 223 estimated for both, probably the profiler's
    # traces, read at the end of each run) has three GRPO contenders since: RUN_S.
    ("3", "eager"): 41.5,  # 36.4 s on session 3's H100
    ("3", "compiled"): 120.2,  # 79 s of it compiling; compiled whole (session 3) it was stopped at 438 s
}
# The device calls still to make (README "The device calls"), session by session: a session has 15 device minutes
# and one machine start; the machine goes back 30 s after a call. `carry`: the payload's parts and folders (payload.py's
# sets: step1 and llm_shape in one part each, llm in two); `shape`: the LLM steps run with --llm_shape (the demo LLM's
# architecture, its weights drawn at random). Session 1 (2026-11-26) ran steps 1, 2a, 4 and 7, 2b's first case,
# and step 10's runs (the call ended before their record); session 2 (2026-11-26) ran steps 10 and 9; session 3
# (2026-11-27) step 10, and step 3 until its compiled run, compiled whole, was stopped; session 4 (2026-11-28) steps
# 12 and 3 (bench/gpu_check/README.md). `qlora`: bitsandbytes alone, installed beside `llm` (STEP_ADDS).
CALLS = [
    # Step 12 again: session 4's profile found ours' GRPO paying 0.49 s a step in cuDNN attention's host code. GRPO's
    # rows now pad to a multiple of 8, the profile gives each operator's longest and median call (a graph built per
    # new length, or a cost of every call?), and a third run goes without cuDNN's attention (what it costs a step).
    # Then 2b's checkpointing case, never run, and train.py's (step 15): the memory it saves and the speed it costs
    # need no trained weights.
    {"session": 5, "carry": ["llm_shape-1", "llm_shape"], "install": True, "shape": True, "steps": ["12"]},
    {"session": 5, "carry": ["llm_shape"], "install": False, "shape": True, "steps": ["2b", "15"]},
    # DPO with --torch_compile: step 9 found its step launch-bound, 1.31x TRL against a target of 1.5x.
    {"session": 6, "carry": ["llm_shape-1", "llm_shape"], "install": True, "shape": True, "steps": ["11"]},
    {"session": 7, "carry": ["llm_shape-1", "llm_shape"], "install": True, "shape": True, "steps": ["5", "8", "6"]},
    # The demo LLM's own weights: generation accuracy on a GPU (two calls carry them).
    {"session": 8, "carry": ["llm-1"], "install": False, "shape": False, "steps": []},
    {"session": 8, "carry": ["llm-2"], "install": True, "shape": False, "steps": ["2a", "4"]},
    # QLoRA (step 13) on the demo LLM's own weights: the accuracy it keeps against our LoRA's is what the 4-bit base
    # trades for its memory. bitsandbytes (the qlora set, 41 MiB) fits no call beside a part of the LLM's set.
    {"session": 9, "carry": ["llm-1"], "install": False, "shape": False, "steps": []},
    {"session": 9, "carry": ["qlora-1"], "install": False, "shape": False, "steps": []},
    # train.py's LoRA and QLoRA (step 14) on the same call: the LLM as a classifier, its accuracy on the real weights
    {"session": 9, "carry": ["llm-2"], "install": True, "shape": False, "steps": ["13", "14"]},
]
SESSION_S = 900  # a session's device time
# Which of payload.py's sets a step can run with (any one of them installed); the other steps run the LLM.
STEP_SETS = {"1": ("step1",), "6": ("step1", "llm", "llm_shape"), "8": ("step1", "llm", "llm_shape")}
# The sets a step needs as well, installed beside its LLM's: bitsandbytes (41 MiB) fits no call with an LLM set's part
STEP_ADDS = {"13": "qlora", "14": "qlora"}


def needs_llm(step: str) -> bool:
    """Whether a step runs the LLM that the environment helper prepares (steps 2 to 5, 7 and 9 to 15)."""
    return step not in STEP_SETS


def step_sets(step: str, llm_shape: bool) -> tuple:
    """The sets a step can run with: an LLM step needs the demo LLM (`llm`), or with --llm_shape any set
    with peft and trl (`llm_shape`, or `llm`)."""
    return STEP_SETS.get(step, ("llm", "llm_shape") if llm_shape else ("llm",))


def sets_missing(step: str, llm_shape: bool, installed: set) -> str | None:
    """What a step lacks of the payload where the sets `installed` are: one of its sets (step_sets), then the set it
    needs as well (STEP_ADDS); None when it can run."""
    sets = step_sets(step, llm_shape)
    if not installed.intersection(sets):
        return " or ".join(sets)
    return STEP_ADDS[step] if step in STEP_ADDS and STEP_ADDS[step] not in installed else None


# The seconds of a call around the checklist: the machine's start (first call), the pause before a later call, the
# transfers, payload.py's receive, probe and install (1.9 s for step 1's set on this machine), a margin at the end.
CALL_S = {"start": 90, "gap": 20, "transfer": 10, "receive": 5, "probe": 5, "install": 15, "margin": 30}


def run_estimate_s(step: str, run: str) -> float:
    """A run's seconds on the GPU: measured there (GPU_S), else RUN_S's estimate: the dry run's wall time scaled,
    plus the work; TRL's runs share one."""
    if (step, run) in GPU_S:
        return GPU_S[(step, run)]
    dry, work = RUN_S.get((step, "trl") if run.endswith("_trl") else (step, run), (30.0, 60))
    return STARTUP_SCALE * dry + work


def gpu_runs(step: str) -> list[str]:
    """The runs a step makes on the GPU: each of its LLM cases', ours and TRL's, and its other runs in RUN_S but step
    3's eager one (made only on a machine without step 2a's). Step 13's LoRA reference is counted: its session does
    not run step 2a."""
    cases = [name for case, (s, _, _) in LLM_CASES.items() if s == step for name in (case, f"{case}_trl")]
    return cases + [run for (s, run) in RUN_S if s == step and run not in (*cases, "trl", "eager")]


def plan() -> list[dict]:
    """CALLS as device calls: the command, what it carries, --budget_s (600 s less what comes before the
    checklist and a margin), and the estimated seconds of the checklist and of the device time (a session's
    first call with the machine's start, each later one with the pause before it: back to back)."""
    rows, session, llm_ready = [], None, False
    for number, call in enumerate(CALLS, 1):
        first = call["session"] != session
        session, llm_ready = call["session"], llm_ready and not first
        payload = "python3 bench/gpu_check/payload.py"
        parts = [name for name in call["carry"] if name != "llm_shape"]  # the shape is a folder: nothing to receive
        commands = [f"{payload} receive"] if parts else []
        commands += [f"{payload} probe"] if first else []
        commands += [f"{payload} install"] if call["install"] else []
        before = sum(CALL_S[name] for name, used in (("receive", parts), ("probe", first)) if used)
        before += CALL_S["install"] if call["install"] else 0
        budget = 600 - CALL_S["margin"] - before
        steps, step_s, checklist_s = call["steps"], {}, 0.0
        if steps:
            shape = " --llm_shape .gpu_payload/llm_shape" if call["shape"] else ""
            commands.append(
                f"python3 bench/gpu_check/checklist.py --steps {','.join(steps)} --budget_s {budget} --require_site"
                + shape
            )
            llm = any(needs_llm(step) for step in steps)
            env = ("llm_shape" if call["shape"] else "llm_cached" if llm_ready else "llm") if llm else "plain"
            llm_ready |= llm
            step_s = {step: sum(run_estimate_s(step, run) for run in gpu_runs(step)) for step in steps}
            checklist_s = run_estimate_s("env", env) + sum(step_s.values())
        device_s = CALL_S["start" if first else "gap"] + CALL_S["transfer"] + before + checklist_s
        carry = [".gpu_payload/manifest.json"] if call["carry"] else []
        rows.append(
            {
                "call": number,
                "session": session,
                "command": "export PYTHONUNBUFFERED=1; " + " && ".join(commands),
                "carry": carry + [f".gpu_payload/{name}" for name in call["carry"]],
                "timeout_s": 600,
                "budget_s": budget,
                "step_s": step_s,
                "checklist_s": checklist_s,
                "device_s": device_s,
            }
        )
    return rows


def plan_markdown(rows: list[dict]) -> str:
    lines = [
        "| session | # | command | carry | timeout_s | steps: estimated s | device min (session) |",
        "|---:|---|---|---|---:|---|---:|",
    ]
    total, session = 0.0, None
    for row in rows:
        total = row["device_s"] + (total if row["session"] == session else 0.0)
        session = row["session"]
        carry = ", ".join(f"`{path}`" for path in row["carry"]) or "none"
        steps = ", ".join(f"{step}: {seconds:.0f}" for step, seconds in row["step_s"].items()) or "none: it carries"
        checklist = f" (checklist {row['checklist_s']:.0f} of {row['budget_s']})" if row["step_s"] else ""
        lines.append(
            f"| {row['session']} | {row['call']} | `{row['command']}` | {carry} | {row['timeout_s']} "
            f"| {steps}{checklist} | {row['device_s'] / 60:.1f} ({total / 60:.1f}) |"
        )
    return "\n".join(lines) + "\n"
