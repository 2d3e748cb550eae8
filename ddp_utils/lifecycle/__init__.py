"""A script's start and end: the launch checked, the options, the Accelerator, the run's set-up, a clean exit.

- start.py         start_run (the Accelerator, logging, seed), make_accelerator, start_training
- args.py          the options every script shares, and their checks
- model_args.py    the model options: LoRA and QLoRA, gradient checkpointing, the causal LM's
- option_names.py  other trainers' option names, answered with ours when refused
- launch_guard.py  check_launch: a launch that would silently run one process, or a world per process
- process_exit.py  run: a clean exit, bad input and faults as one line on every rank

The top: may import every other part, and nothing imports it but the scripts.
"""
