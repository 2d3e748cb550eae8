"""Training: the model made ready, the steps planned, the exact loss, and what the log shows.

- pretrained.py    load_model_config, fetch_weights: a model from the Hub or a local directory; causal_lm_class:
                   the Auto class that loads a causal LM whole (one that also reads images too); shared_weights
- fsdp.py          load_pretrained (under FSDP only rank 0 reads the weights), fixes to Accelerate's FSDP2 preparation
- activation_checkpointing.py  checkpoint_if_asked (--gradient_checkpointing) and the FSDP config's option alike
- zero3_loading.py under DeepSpeed ZeRO-3, a checkpoint whose head has another shape loaded whole
- optimizer.py     make_adamw, make_lr_scheduler, train_in_fp32
- step_plan.py     StepPlan: steps, epochs, progress; dropout seeded per micro-batch
- exact_loss.py    count_step, global_mean_loss: the step's loss over all its examples on all ranks
- training_log.py  TrainingLog: trackers, train_log.jsonl, the progress bar
- nonfinite.py     a loss or gradient that turned NaN or infinite, found on every rank
- oom_backoff.py   OOMBackoff: --oom_backoff, a step split in smaller micro-batches after running out of memory
- compilation.py   dynamo_plugin, configure_compile, compile_by_regions: how --torch_compile compiles;
                   compile_counts: what it compiled

Knows nothing of results, language models or a script's start: imports core, data and checkpoints.
"""
