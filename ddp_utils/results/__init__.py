"""What a run leaves behind: the output directory, the model saved, the results, the report, the Hub push.

- output.py         the output directory; save_model: the unwrapped model's full state dict, written atomically
- report.py         write_results: metrics.json, training_args.json, report/
- model_card.py     the README.md model card
- hub.py            --push_to_hub: the repository, the names refused, one commit after the run
- after_the_run.py  work the main process does once every rank has finished (the Hub upload)

Knows nothing of language models or a script's start: imports core, data, checkpoints and training.
"""
