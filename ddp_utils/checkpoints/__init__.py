"""Checkpoints: written atomically, verified, resumed on any layout; preemption; failed writes.

- checkpoint.py       Checkpointer: when to save, the best one kept, the resume (what a script uses)
- checkpoint_save.py  save_checkpoint (staging directory, manifest, rename), pruning, disk space
- checkpoint_load.py  find_resume_checkpoint, verify_checkpoint, load_checkpoint, the layouts a checkpoint resumes on
- frozen_weights.py   a LoRA run's checkpoints without the frozen base, and its digest checked on resume
- manifest.py         list_checkpoints (the complete ones); every file's size and checksum
- preemption.py       SIGTERM / SIGUSR1: a checkpoint after the step in flight, exit 75, preempted.json
- write_failure.py    agree_on_write: a write that failed on any rank, one line on every rank

Knows nothing of the model's task, the data or the training step: imports only core.
"""
