"""The ground every other part stands on: what a rank may do alone, and how the ranks agree.

- errors.py     UsageError, RunFailed, Preempted, their exit codes and the preemption signals (a leaf)
- ranks.py      rank-0 I/O: the main process works first or alone, every rank shares its verdict or its error
- files.py      JSON and JSONL written by the main process only, atomically
- sharded.py    is_sharded: the one test of whether the weights are split over the ranks (a leaf)
- redact.py     secrets (tokens, keys) kept out of logs and files

Knows nothing of models, data, training or checkpoints: imports nothing of ddp_utils outside core.
"""
