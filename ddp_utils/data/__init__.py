"""Data: the user's files read and checked, the training order, and the evaluation gathered.

- data_files.py      read_data_files: local CSV, TSV, JSON, JSONL, Parquet or text, each file checked as it is read;
                     for raw text, code a file a record
- file_lists.py      which files an option names: a file, a folder's or a glob's (a Hub dataset's shards), of one
                     kind and one split
- record_names.py    a refused record's name: its number in its split, and where several files hold the split, its
                     file and its row there
- raw_data.py        check_splits: the splits' columns checked once, a share held out, limits as first rows or a
                     sample; a Hub dataset's own split names (named_splits)
- dataloaders.py     the training order: whole steps, shuffled from (seed, epoch), dealt to the ranks
- evaluation.py      each example gathered once; metrics loaded offline (metrics/); the score that ranks checkpoints
- classification.py  labels to classes (validation numbered by name), accuracy, F1, the confusion matrix, regression
                     scores; which task a column is
- text_classifiers.py  what a text classifier's tokenizer and config must agree on, whatever its family: the pad
                     token and side, the input length limit, the EOS tokens BART's and T5's heads read
- multi_label.py     label lists (names, class labels, 0/1 vectors) as multi-hot; exact match, micro and macro F1
- image_folders.py   image folders: a class per subfolder, the unreadable images found once per node
- image_columns.py   other image datasets' columns: paths and pixel arrays read as images
- vision.py          images into inputs (any mode), a seeded augmentation, SyncBatchNorm
- demo.py            the offline demos' models (demo_models/) and data

Knows nothing of checkpoints, training, results or language models: imports only core.
"""
