"""Files in the shapes users bring, made here: GLUE's TSVs (MRPC's quotes, STS-B's float scores), an
OpenAI chat file with content parts, LLaMA-Factory's sets (v1 content parts, images, pairs, KTO tags),
TRL's preference pairs, Alpaca records and a long multi-turn conversation. Each is read right or
refused in one line that names the record and the fix; most are checked through the scripts' own
`parse_args` and `prepare_data`, the regression through the launcher on 1 and 2 processes."""

import json
import logging
import random
import re
import shutil

import numpy as np
import pytest

from conftest import (
    FILLER,
    REPO,
    WORDS,
    launch,
    load_script,
    make_tiny_causal_lm,
    refused_in_process,
    write_text_corpus,
)
from ddp_utils import UsageError

# GLUE's MRPC train.tsv, as it ships: no quoting; a sentence may start with a quote it does not close.
MRPC = (
    "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
    '1\t702876\t702977\tAmrozi accused his brother , whom he called " the witness " , of distorting his evidence .\t'
    'Referring to him as only " the witness " , Amrozi accused his brother of distorting his evidence .\n'
    "0\t2108705\t2108831\tYucaipa owned Dominick 's before selling the chain to Safeway in 1998 .\t"
    "Yucaipa bought Dominick 's in 1995 for $ 693 million .\n"
    '1\t1330381\t1330521\t" Sanitation is poor ... there could be typhoid and cholera , he said .\t'
    "He said sanitation was poor and there could be typhoid and cholera .\n"
    "0\t3344667\t3344648\tThey had published an advertisement on the Internet on June 10 , he added .\t"
    "On June 10 , the ship 's owners had published an advertisement on the Internet .\n"
    "1\t1236820\t1236712\tThe stock rose $ 2.11 , or about 11 percent , to close Friday at $ 21.51 .\t"
    "PG & E Corp. shares jumped $ 1.63 or 8 percent to $ 21.03 on Friday .\n"
    "0\t2029631\t2029565\tRevenue in the first quarter of the year dropped 15 percent .\t"
    "With the scandal hanging over Stewart 's company , revenue dropped 15 percent .\n"
)


def sft(tmp_path, records, *extra, chat_template=False, name="train.jsonl"):
    """train_sft.py's own parse_args and prepare_data on `records` (a JSONL file), with the tiny Llama."""
    from accelerate import PartialState

    PartialState(cpu=True)
    model = make_tiny_causal_lm(tmp_path / f"llama-{chat_template}", chat_template=chat_template)
    path = tmp_path / name
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    script = load_script("train_sft")
    argv = ["--model_name_or_path", model, "--train_file", path, "--validation_file", path, "--report_to", "none"]
    argv += ["--output_dir", tmp_path / "out", "--eval_max_new_tokens", 0, *extra]
    args = script.parse_args([str(a) for a in argv])
    return script.prepare_data(args)


# --- GLUE's TSVs ------------------------------------------------------------------------------------


@pytest.mark.fast
def test_a_glue_tsv_is_read_as_tsv_quotes_and_all(tmp_path):
    """Before: read with CSV quoting, the quote that opens row 2's sentence swallowed the lines after
    it, and 6 rows loaded as 5, silently."""
    from ddp_utils import read_data_files

    (tmp_path / "train.tsv").write_text(MRPC)
    train = read_data_files({"train": str(tmp_path / "train.tsv")})["train"]
    assert len(train) == 6 and train["Quality"] == [1, 0, 1, 0, 1, 0]
    assert train[2]["#1 String"].startswith('" Sanitation is poor') and "\n" not in "".join(train["#1 String"])


@pytest.mark.fast
def test_a_csv_whose_rows_merged_is_warned_about_naming_the_row(tmp_path, caplog):
    import logging

    from accelerate import PartialState

    from ddp_utils import read_data_files

    PartialState(cpu=True)
    (tmp_path / "train.csv").write_text('text,label\ngood film,1\n"a quote opens here,0\nbad film,0\n"closed,1\n')
    with caplog.at_level(logging.WARNING):
        train = read_data_files({"train": str(tmp_path / "train.csv")})["train"]
    assert len(train) == 2, "the quote swallowed two lines: legal CSV, and likely a mistake"
    assert "the 'text' of record 1 holds a newline or a tab (2 rows from 4 lines of data)" in caplog.text


@pytest.mark.fast
def test_a_tsv_written_with_csv_quoting_is_warned_about_and_glues_is_not(tmp_path, caplog):
    """pandas' to_csv(sep="\\t") quotes a field that holds quotes, CSV's way. A .tsv is read without quoting (as
    GLUE ships it): the quotes trained as text, and a quoted newline split its row, refused as a missing label."""
    import logging

    from accelerate import PartialState

    from ddp_utils import read_data_files

    PartialState(cpu=True)
    (tmp_path / "pandas.tsv").write_text('text\tlabel\n"he said ""great drug"""\tpos\nplain text\tneg\n')
    (tmp_path / "train.tsv").write_text(MRPC)
    with caplog.at_level(logging.WARNING):
        read_data_files({"train": str(tmp_path / "train.tsv")})
        assert "quoted" not in caplog.text, "GLUE's quotes are text"
        read_data_files({"train": str(tmp_path / "pandas.tsv")})
    assert "the 'text' of record 0 looks quoted as in a CSV file" in caplog.text
    assert "quoting=csv.QUOTE_NONE" in caplog.text


@pytest.mark.fast
def test_files_not_in_utf8_a_bom_and_a_folder_are_read_or_named_in_one_line(tmp_path):
    """A Latin-1 JSONL loaded (Arrow keeps the bytes) and failed at its first read, anywhere later, with a raw
    UnicodeDecodeError; a .txt from Windows' Notepad trained its BOM as text; a folder was "does not exist"."""
    from ddp_utils import read_data_files

    (tmp_path / "latin1.jsonl").write_bytes('{"text": "café au lait"}\n'.encode("latin-1"))
    (tmp_path / "latin1.txt").write_bytes("café au lait\n".encode("latin-1"))
    (tmp_path / "notepad.txt").write_bytes("\ufeffHello world\nsecond line\n".encode("utf-8"))
    for name, expected in (("latin1.jsonl", "is not UTF-8 text"), ("latin1.txt", "codec can't decode byte 0xe9")):
        with pytest.raises(UsageError, match=re.escape(expected) + ".*; save it as UTF-8$"):
            read_data_files({"train": str(tmp_path / name)})
    assert list(read_data_files({"train": str(tmp_path / "notepad.txt")})["train"]["text"]) == [
        "Hello world", "second line"
    ]  # fmt: skip
    with pytest.raises(UsageError, match=re.escape("holds files read in different ways (.jsonl, .txt)")):
        read_data_files({"train": str(tmp_path)})


@pytest.mark.fast
def test_a_hub_datasets_shards_are_read_as_a_folder_or_a_glob_and_several_splits_are_refused(tmp_path, caplog):
    """A Hub dataset's snapshot holds its data as Parquet shards (data/train-00000-of-00002.parquet, ...) beside a
    README.md. The scripts took one file ("is a folder; give the path of one file"), and train_clm.py, which took a
    folder, left every Parquet shard out as binary and refused the folder. Now a folder (its README left out, said)
    or a glob of shards is read whole, for every script; one whose files are of several splits is refused, as all
    of them, the test shards too, would have trained."""
    import datasets
    from accelerate import PartialState

    from ddp_utils import read_data_files

    PartialState(cpu=True)  # it logs the files it left out through Accelerate's logger
    data = tmp_path / "snapshot" / "data"
    data.mkdir(parents=True)
    rows = [{"text": f"review {i}", "label": i % 3} for i in range(10)]
    for shard, part in enumerate((rows[:6], rows[6:])):
        datasets.Dataset.from_list(part).to_parquet(str(data / f"train-0000{shard}-of-00002.parquet"))
    (tmp_path / "snapshot" / "README.md").write_text("---\nlicense: mit\n---\n# A dataset card\n")
    (tmp_path / "snapshot" / ".gitattributes").write_text("*.parquet filter=lfs\n")
    with caplog.at_level(logging.INFO):
        for given in ("snapshot", "snapshot/data", "snapshot/data/train-*.parquet"):
            for raw_text in (False, True):  # train.py and the LLM scripts; train_clm.py
                if raw_text and given == "snapshot":  # raw text: Markdown is text too, so which is meant is asked
                    with pytest.raises(UsageError, match=r"\(.md, .parquet\); give one kind, with a glob: '.*snapshot/"
                                                         r"\*\*/\*.parquet', say"):  # fmt: skip
                        read_data_files({"train": str(tmp_path / given)}, raw_text=raw_text)
                    continue
                read = read_data_files({"train": str(tmp_path / given)}, raw_text=raw_text)["train"]
                assert read.to_list() == rows, (given, raw_text)
    assert "1 files that are not data left out: [" in caplog.text and "README.md']" in caplog.text

    datasets.Dataset.from_list(rows[:2]).to_parquet(str(data / "test-00000-of-00001.parquet"))
    for given in ("snapshot", "snapshot/data/*.parquet", "snapshot/**"):
        for raw_text in (False, True):
            several = "holds the files of several splits (test: 1, train: 2), which would all be read as train data"
            with pytest.raises(UsageError, match=re.escape(several)) as refused:
                read_data_files({"train": str(tmp_path / given)}, raw_text=raw_text)
            fix = re.search(r"give train files alone with a quoted glob, '([^']+)'", str(refused.value)).group(1)
            assert fix == f"{data}/*train*"  # the fix it names reads the training shards alone
            assert read_data_files({"train": fix}, raw_text=raw_text)["train"].to_list() == rows
    # A folder whose own name reads as a split is no split of its files; a split named after a separator is one,
    # and one beside files that name none would be read with them.
    corpus = tmp_path / "test_corpus"
    corpus.mkdir()
    for name in ("train.jsonl", "extra.jsonl"):
        (corpus / name).write_text('{"text": "a review", "label": 1}\n')
    for given in (str(corpus), f"{corpus}/", f"{corpus}/*.jsonl"):
        assert len(read_data_files({"train": given})["train"]) == 2
    (corpus / "extra.jsonl").rename(corpus / "alpaca_test.jsonl")
    with pytest.raises(UsageError, match=re.escape("several splits (test: 1, train: 1)")):
        read_data_files({"train": str(corpus)})
    (corpus / "train.jsonl").rename(corpus / "reviews.jsonl")
    with pytest.raises(UsageError, match=re.escape("several splits (test: 1, no split named: 1)")):
        read_data_files({"train": str(corpus)})
    with pytest.raises(UsageError, match=re.escape("holds no data files (.csv, .json, .jsonl, .parquet, .tsv, .txt)")):
        read_data_files({"train": str(write_code_checkout(tmp_path / "code"))})
    code = read_data_files({"train": str(tmp_path / "code")}, raw_text=True)["train"]  # test_*.py is no split
    assert len(code) == 2


@pytest.mark.fast
@pytest.mark.parametrize("kind", ["jsonl", "json", "csv", "tsv", "parquet", "txt", "paragraphs"])
def test_a_record_of_several_files_is_named_by_its_file_and_its_row_there(tmp_path, kind):
    """A split read from a folder or glob of shards numbers its records across the files, in their order: a refused
    record was "train record 912345" and the user had to count through 40 shards. Its name now holds the file and
    its row there, counted as the split's reader counts (blank lines, JSON arrays, quoted CSV fields, paragraphs, a
    shard that holds no record), and every record's file and row hold that very record. One file, or the Hub, keep
    the plain name; a name is looked up only when shown."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    from accelerate import PartialState

    from ddp_utils import read_data_files
    from ddp_utils.data import record_names

    PartialState(cpu=True)
    folder = tmp_path / "shards"
    folder.mkdir()
    sizes = (3, 1, 4) if kind in ("txt", "paragraphs") else (3, 0, 1, 4)  # a line of text is a record, even blank
    start = 0
    for shard, size in enumerate(sizes):
        rows = [{"text": f"w{i} says \"hi\"" if kind == "csv" else f"w{i} w{i + 1}", "label": i % 2}
                for i in range(start, start + size)]  # fmt: skip
        name = folder / f"train-{shard:05d}-of-00004.{'txt' if kind == 'paragraphs' else kind}"
        if kind == "jsonl":  # a blank line between records, as a hand-made file has: no record
            name.write_text("\n\n".join(json.dumps(row) for row in rows) + "\n")
        elif kind == "json":
            name.write_text(json.dumps(rows, indent=1))
        elif kind == "parquet":
            schema = pa.schema([("text", pa.string()), ("label", pa.int64())])
            pq.write_table(pa.Table.from_pylist(rows, schema=schema), name)
        elif kind == "csv":
            datasets.Dataset.from_list(rows).to_csv(str(name), index=False) if rows else name.write_text("text,label\n")
        elif kind == "tsv":
            name.write_text("text\tlabel\n" + "".join(f"{row['text']}\t{row['label']}\n" for row in rows))
        else:  # lines, or paragraphs of two lines between blank lines of spaces
            sep, line = ("\n", "{text}") if kind == "txt" else ("\n  \n", "{text}\nand more")
            name.write_text(sep.join(line.format(**row) for row in rows) + "\n")
        start += size
    options = {"txt_records": "paragraph"} if kind == "paragraphs" else {}
    data = read_data_files({"train": str(folder)}, raw_text=kind in ("txt", "paragraphs"), **options)["train"]
    assert len(data) == sum(sizes)
    names = [record_names.record_name("train", number) for number in range(len(data) + 1)]
    assert not record_names._FILES["train"]["ends"], "named before shown: no file counted yet"
    names = [str(name) for name in names]
    assert names[-1] == f"train record {len(data)}"  # past the files: a number, not a wrong file
    assert names[7] == f"train record 7 (row 3 of '{sorted(folder.iterdir())[-1]}')"
    for number, named in enumerate(names[:-1]):
        found = re.fullmatch(rf"train record {number} \(row (\d+) of '(.+)'\)", named)
        assert found, named
        alone = read_data_files({"validation": found.group(2)}, raw_text=kind in ("txt", "paragraphs"), **options)
        assert alone["validation"][int(found.group(1))] == data[number], named
        assert record_names.record_name("validation", 0) == "validation record 0"  # one file: the split's number
        assert record_names.record_name("train", 7) == "train record 7"  # read anew: the folder's files forgotten
    data = read_data_files({"train": str(folder)}, raw_text=kind in ("txt", "paragraphs"), **options)
    named = record_names.record_name("train", 7)
    from ddp_utils import named_splits

    named_splits(data, None, None)  # a Hub dataset's reading after it (in one process, as here): numbers alone
    assert record_names.record_name("train", 7) == "train record 7" and str(named) == names[7]  # a name keeps its files


@pytest.mark.fast
def test_a_refused_record_in_a_folder_of_shards_is_named_by_its_file_also_after_a_held_out_share(tmp_path):
    """Through the scripts: SFT's empty answer in the third shard, with a share held out and shuffled, and
    train.py's empty text in the second, each named by its file and row."""
    from accelerate import PartialState

    from ddp_utils.data import record_names

    PartialState(cpu=True)
    shards = tmp_path / "chats"
    shards.mkdir()
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "w1"}]}
    bad = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]}
    records = [good] * 20
    records[16] = bad
    for shard in range(3):  # 7, 7 and 6 records: the 17th is the third shard's third
        part = records[shard * 7 : shard * 7 + 7]
        (shards / f"train-{shard:05d}-of-00003.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    model = make_tiny_causal_lm(tmp_path / "llama", chat_template=True)
    argv = ["--model_name_or_path", model, "--train_file", shards, "--output_dir", tmp_path / "out"]
    argv += ["--report_to", "none", "--validation_split_percentage", 20, "--eval_max_new_tokens", 4]
    module = load_script("train_sft")
    expected = f"train record 16 (row 2 of '{shards / 'train-00002-of-00003.jsonl'}'): its assistant turn 1 is empty"
    with pytest.raises(UsageError, match=re.escape(expected)):
        module.prepare_data(module.parse_args([str(a) for a in argv]))
    (shards / "train-00002-of-00003.jsonl").write_text("".join(json.dumps(good) + "\n" for _ in range(6)))
    module.prepare_data(module.parse_args([str(a) for a in argv]))  # every record named, none refused:
    assert not record_names._FILES["train"]["ends"]  # no file was counted (a name is looked up when shown)

    reviews = tmp_path / "reviews"
    reviews.mkdir()
    for shard in range(2):
        rows = [f"review {i},{i % 2}\n" for i in range(5)]
        rows[3] = ",1\n" if shard == 1 else rows[3]  # an empty text: the 9th record, the second file's 4th
        (reviews / f"part{shard}.csv").write_text("text,label\n" + "".join(rows))
    expected = f"(first: record 8 (row 3 of '{reviews / 'part1.csv'}')); fill or drop them"
    refused_in_process("train", ["--train_file", reviews, "--output_dir", tmp_path / "o"], expected)


def write_code_checkout(directory):
    (directory / "tests").mkdir(parents=True)
    (directory / "train.py").write_text("print('train')\n")
    (directory / "tests" / "test_train.py").write_text("def test(): pass\n")
    return directory


@pytest.mark.fast
def test_a_folder_or_a_glob_of_text_files_is_read_for_raw_text_each_file_named_in_its_message(tmp_path, caplog):
    """train_clm.py's --train_file data/ or 'data/**/*.txt' (a corpus often ships as many files) was refused: "give
    the path of one file". With `raw_text` a folder's files at every level (hidden ones and empty ones left out) or a
    glob's are read, of one kind; a file that is not UTF-8 is named, not the folder."""
    from accelerate import PartialState

    from ddp_utils import read_data_files

    PartialState(cpu=True)  # it logs the files it read through Accelerate's logger
    (tmp_path / "data" / "more").mkdir(parents=True)
    (tmp_path / "data" / ".hidden").mkdir()
    (tmp_path / "data" / "a.txt").write_text("first line\nsecond line\n")
    (tmp_path / "data" / "more" / "b.txt").write_text("third line")  # no line break at its end
    (tmp_path / "data" / "empty.txt").write_text("")
    (tmp_path / "data" / ".hidden" / "c.txt").write_text("not read\n")
    lines = ["first line", "second line", "third line"]
    for given in ("data", "data/**/*.txt", "data/*/*.txt"):
        read = read_data_files({"train": str(tmp_path / given)}, raw_text=True)["train"]["text"]
        assert list(read) == (lines[2:] if given == "data/*/*.txt" else lines), given
    (tmp_path / "data" / "notes.md").write_text("# notes\n")
    for given, expected in (
        ("data", "holds files read in different ways (.md, .txt); give one kind, with a glob:"),
        ("data/*.csv", "matches no file"),
        ("data/*.md", None),
    ):
        if expected is None:  # a Markdown file: one record, its whole text
            assert read_data_files({"train": str(tmp_path / given)}, raw_text=True)["train"]["text"] == ["# notes\n"]
            continue
        with pytest.raises(UsageError, match=re.escape(expected)):
            read_data_files({"train": str(tmp_path / given)}, raw_text=True)
    (tmp_path / "data" / "notes.md").unlink()
    (tmp_path / "data" / "more" / "latin1.txt").write_bytes("café\n".encode("latin-1"))
    with pytest.raises(UsageError, match=r"latin1.txt' is not UTF-8 \('utf-8' codec can't decode byte 0xe9"):
        read_data_files({"validation": str(tmp_path / "data")}, raw_text=True)
    import gzip  # datasets opens it through: C4's .json.gz was read as one record, its JSON as text

    with gzip.open(tmp_path / "c4.json.gz", "wt") as handle:
        handle.write('{"text": "first line", "url": "https://example.com"}\n')
    with pytest.raises(UsageError, match=r"c4.json.gz' is compressed; decompress it \(gunzip"):
        read_data_files({"train": str(tmp_path / "c4.json.gz")}, raw_text=True)
    with pytest.raises(UsageError, match=re.escape("unknown extension '.md'")):
        (tmp_path / "notes.md").write_text("# notes\n")
        read_data_files({"train": str(tmp_path / "notes.md")})
    # A code checkout: its __pycache__ and binary files (a logo, a .pyc elsewhere) are left out, said in a warning;
    # a folder named like a glob is a folder; one of downloaded .json.gz files is told to decompress them.
    code = tmp_path / "repo [main]"
    (code / "pkg" / "__pycache__").mkdir(parents=True)
    (code / "pkg" / "a.py").write_text("def f():\n    return 1\n")
    (code / "pkg" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\xa7\r\r\n\0\0\0\0")
    (code / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")
    (code / "README").write_text("a package\n")
    (code / "@eaDir" / "README").mkdir(parents=True)  # a Synology NAS's thumbnail folder, as image folders skip it
    (code / "@eaDir" / "README" / "SYNOFILE_THUMB").write_text("not the package's\n")
    with caplog.at_level(logging.WARNING):
        read = read_data_files({"train": str(code)}, raw_text=True)["train"]["text"]
    assert list(read) == ["a package\n", "def f():\n    return 1\n"]
    assert "1 binary files left out (.png: 1): not text" in caplog.text
    (tmp_path / "c4").mkdir()
    shutil.move(tmp_path / "c4.json.gz", tmp_path / "c4" / "c4-train.00000.json.gz")
    with pytest.raises(UsageError, match=re.escape("holds no text files, 1 binary ones (.gz: 1); decompress them")):
        read_data_files({"train": str(tmp_path / "c4")}, raw_text=True)
    (tmp_path / "empty.tsv").write_text("")
    with pytest.raises(UsageError, match="is empty; it needs a header and at least one example"):
        read_data_files({"train": str(tmp_path / "empty.tsv")})


def write_stsb(path, rows, seed):
    """STS-B's shape: two sentences and a float similarity score from 0 to 5 (here: how positive)."""
    rng = random.Random(seed)
    lines = ["genre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore"]
    for i in range(rows):
        positive = rng.random() < 0.5
        score = (4 if positive else 1) + rng.random() - 0.5
        word = rng.choice(WORDS["positive" if positive else "negative"])
        first, second = " ".join(rng.choices(FILLER, k=4) + [word]), " ".join(rng.choices(FILLER, k=3))
        lines.append(f"main-captions\tMSRvid\t2012test\t{i:04d}\tnone\tnone\t{first}\t{second}\t{score:.3f}")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_float_label_column_trains_a_regression_the_same_on_one_and_two_processes(tiny_model, tmp_path):
    """STS-B as a user gives it: a TSV with a float score and no validation file. One output, the
    squared error; MSE, Pearson and Spearman over the held-out 10%, each example once: the same on
    1 and 2 processes (before: 7 classes, and a refusal without --validation_file)."""
    from safetensors.numpy import load_file

    train = write_stsb(tmp_path / "train.tsv", 100, seed=0)
    common = ["--model_name_or_path", tiny_model, "--train_file", train, "--text_column", "sentence1,sentence2"]
    common += ["--label_column", "score", "--max_length", 32, "--learning_rate", 1e-2, "--num_train_epochs", 6]
    common += ["--warmup_ratio", 0]
    common += ["--per_device_eval_batch_size", 3, "--checkpointing_steps", "no", "--report_to", "none"]
    runs = {}
    for processes, batch in ((1, 8), (2, 4)):
        output_dir = tmp_path / f"run{processes}"
        result = launch(
            REPO / "scripts" / "train.py",
            *common,
            "--per_device_train_batch_size",
            batch,
            "--output_dir",
            output_dir,
            num_processes=processes,
        )
        assert result.returncode == 0, result.output[-3000:]
        assert "task: regression on 'score'" in result.output
        runs[processes] = output_dir
    one, two = (json.loads((runs[n] / "metrics.json").read_text()) for n in (1, 2))
    assert one["eval_examples"] == two["eval_examples"] == 10, "10% of 100 held out, each counted once"
    for key in ("eval_mse", "eval_pearson", "eval_spearman"):  # within the float drift of 54 steps at lr 1e-2
        assert two[key] == pytest.approx(one[key], rel=2e-3), key
    assert one["eval_loss"] == one["eval_mse"] and one["eval_pearson"] > 0.5, "it learned which word scores high"
    config = json.loads((runs[1] / "config.json").read_text())
    assert config["problem_type"] == "regression" and len(config["id2label"]) == 1
    weights = [load_file(str(runs[n] / "model.safetensors")) for n in (1, 2)]
    np.testing.assert_allclose(weights[1]["classifier.weight"], weights[0]["classifier.weight"], rtol=1e-3, atol=1e-4)
    assert json.loads((runs[1] / "training_args.json").read_text())["metric_for_best_model"] == "eval_loss"


def write_topics(path, rows, seed):
    """Multi-label records as JSONL: a list of topics per text (none, one or both), each topic marked by its words."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            topics = sorted(rng.sample(["negative", "positive"], k=rng.choice([0, 1, 1, 2])))
            words = rng.choices(FILLER, k=4) + [word for topic in topics for word in rng.choices(WORDS[topic], k=2)]
            f.write(json.dumps({"text": " ".join(rng.sample(words, len(words))), "topics": topics}) + "\n")
    return path


def test_a_column_of_label_lists_trains_multi_label_the_same_on_one_and_two_processes(tiny_model, tmp_path):
    """GoEmotions' or a user's list of labels per example: one output per label, its binary cross-entropy; exact
    match and micro and macro F1 over the held-out examples, each once: the same on 1 and 2 processes; the saved
    model reloads as a multi-label classifier (before: Arrow's "no kernel matching input types" traceback)."""
    from transformers import pipeline

    train = write_topics(tmp_path / "train.jsonl", 100, seed=0)
    common = ["--model_name_or_path", tiny_model, "--train_file", train, "--label_column", "topics"]
    common += ["--max_length", 32, "--learning_rate", 3e-3, "--num_train_epochs", 6, "--warmup_ratio", 0]
    common += ["--per_device_eval_batch_size", 3, "--checkpointing_steps", "no", "--report_to", "none"]
    runs = {}
    for processes, batch in ((1, 8), (2, 4)):
        output_dir = tmp_path / f"run{processes}"
        result = launch(
            REPO / "scripts" / "train.py", *common, "--per_device_train_batch_size", batch, "--output_dir", output_dir,
            num_processes=processes,
        )  # fmt: skip
        assert result.returncode == 0, result.output[-3000:]
        assert "task: multi-label classification on 'topics': 2 labels, each yes or no" in result.output
        runs[processes] = json.loads((output_dir / "metrics.json").read_text())
    one, two = runs[1], runs[2]
    assert one["eval_examples"] == two["eval_examples"] == 10, "10% of 100 held out, each counted once"
    for key in ("eval_loss", "eval_exact_match", "eval_f1_micro", "eval_f1_macro"):
        assert two[key] == pytest.approx(one[key], rel=1e-3, abs=1e-6), key
    assert one["eval_loss"] < 0.6 and one["eval_f1_micro"] > 0.6, "it learned which words mark which topic"
    classify = pipeline("text-classification", model=str(tmp_path / "run1"), top_k=None)
    scores = {row["label"]: row["score"] for row in classify("great superb wonderful")[0]}
    assert set(scores) == {"negative", "positive"} and sum(scores.values()) != pytest.approx(1.0), "sigmoids"


@pytest.mark.fast
def test_multi_label_columns_map_to_multi_hot_and_score_as_scikit_learn(tmp_path):
    """JSON lists of names and GoEmotions' sequence of class labels; a validation label never trained is refused,
    and --task classification on lists names --task multi_label. The scores match scikit-learn's."""
    import datasets
    from accelerate import PartialState
    from sklearn.metrics import f1_score

    from ddp_utils.data.classification import label_task
    from ddp_utils.data.multi_label import multi_label_scores

    PartialState(cpu=True)  # ddp_utils logs through Accelerate's logger

    rows = {"train": [{"t": ["b", "a"]}, {"t": []}, {"t": ["c"]}], "validation": [{"t": ["a"]}, {"t": ["c", "b"]}]}
    raw = datasets.DatasetDict({split: datasets.Dataset.from_list(r) for split, r in rows.items()})
    task, config, to_labels = label_task(raw, "t")
    assert task == "multi_label" and config["problem_type"] == "multi_label_classification"
    assert config["id2label"] == {0: "a", 1: "b", 2: "c"} and to_labels(["c", "a"]) == [1.0, 0.0, 1.0]
    assert to_labels([]) == [0.0, 0.0, 0.0]
    emotions = datasets.Features({"t": datasets.List(datasets.ClassLabel(names=["anger", "joy", "love"]))})
    goemotions = datasets.DatasetDict(
        {split: datasets.Dataset.from_dict({"t": [[1], [0, 2]]}, features=emotions) for split in rows}
    )
    task, config, to_labels = label_task(goemotions, "t")
    assert config["id2label"] == {0: "anger", 1: "joy", 2: "love"} and to_labels([2]) == [0.0, 0.0, 1.0]
    rows["validation"].append({"t": ["d"]})
    unseen = datasets.DatasetDict({split: datasets.Dataset.from_list(r) for split, r in rows.items()})
    with pytest.raises(UsageError, match=r"validation labels \['d'\] never occur in the training data"):
        label_task(unseen, "t")
    with pytest.raises(UsageError, match="'t' holds lists of labels, which --task classification cannot train on"):
        label_task(raw, "t", "classification")
    as_text = datasets.DatasetDict(  # a CSV's cells, the validation split the same as the training
        {split: datasets.Dataset.from_list([{"t": str(r["t"])} for r in rows["train"]]) for split in rows}
    )
    with pytest.raises(UsageError, match=r"the labels of 't' are lists written as text \(\"\['b', 'a'\]\"\)"):
        label_task(as_text, "t")
    task, config, _ = label_task(as_text, "t", "classification")
    assert task == "classification" and config["problem_type"] == "single_label_classification", "said, not inherited"
    joined = {split: datasets.Dataset.from_list([{"t": "2"}, {"t": "14"}, {"t": "2,14"}]) for split in rows}
    with pytest.raises(UsageError, match=r"some labels of 't' join others with commas \('2,14'\); .*split\(\",\"\)"):
        label_task(datasets.DatasetDict(joined), "t")  # GoEmotions' TSV
    for vectors in ([[0, 1, 0], [1, 1, 0]], [[0.0, 1, 0], [1.0, 1, 0]], [[False, True, False], [True, True, False]]):
        hot = datasets.DatasetDict({split: datasets.Dataset.from_dict({"t": vectors}) for split in rows})
        task, config, to_labels = label_task(hot, "t")  # already multi-hot: Jigsaw's columns gathered, HF's tutorials
        assert config["id2label"] == {0: "LABEL_0", 1: "LABEL_1", 2: "LABEL_2"} and to_labels(vectors[1]) == [1, 1, 0]
    holes = datasets.DatasetDict({split: datasets.Dataset.from_dict({"t": [["a", None], ["b"]]}) for split in rows})
    with pytest.raises(UsageError, match="1 items of the train label lists in 't' are null; drop them"):
        label_task(holes, "t")
    from ddp_utils.data.classification import label_mapping

    with pytest.raises(UsageError, match="'t' holds lists of labels; this script takes one label per example"):
        label_mapping(raw, "t")  # train_image.py's

    rng = np.random.default_rng(0)
    predicted, present = rng.integers(0, 2, (50, 4)), rng.integers(0, 2, (50, 4))
    present[:, 3] = predicted[:, 3] = 0  # a label never present nor predicted: 0 in the macro mean
    scores = multi_label_scores(predicted, present, np.ones(50))
    assert scores["eval_f1_micro"] == pytest.approx(f1_score(present, predicted, average="micro"))
    assert scores["eval_f1_macro"] == pytest.approx(f1_score(present, predicted, average="macro", zero_division=0))
    assert scores["eval_exact_match"] == pytest.approx(float((predicted == present).all(1).mean()))


@pytest.mark.fast
def test_whole_numbers_written_as_decimals_are_refused_as_ambiguous_and_either_task_can_be_given(tmp_path):
    """A CSV whose labels read 0.0 and 1.0 (pandas writes a column that once held a gap so): classes or scores? It
    trained a regression in silence; now refused in one line naming both tasks. --task classification makes them
    the classes "0" and "1", as an integer column's; STS-B's scores (fractions) stay a regression."""
    import datasets
    from accelerate import PartialState

    from ddp_utils.data.classification import label_task

    PartialState(cpu=True)  # label_task logs the task it chose
    path = tmp_path / "reviews.csv"
    path.write_text("text,label\n" + "".join(f"review {i},{i % 2}.0\n" for i in range(8)))
    raw = datasets.load_dataset("csv", data_files={"train": str(path), "validation": str(path)})
    assert raw["train"].features["label"].dtype == "float64"
    with pytest.raises(UsageError) as refused:
        label_task(raw, "label")
    assert str(refused.value) == (
        "the labels of 'label' are floats, all whole numbers (0.0, 1.0): classes or scores? give --task "
        "classification (2 classes) or --task regression"
    )
    task, labels, to_id = label_task(raw, "label", "classification")
    assert task == "classification" and labels["id2label"] == {0: "0", 1: "1"}
    assert [to_id(v) for v in (0.0, 1.0, 1)] == [0, 1, 1]
    assert label_task(raw, "label", "regression")[0] == "regression"
    scores = datasets.Dataset.from_dict({"text": ["a", "b", "c"], "score": [0.0, 2.4, 5.0]})
    assert label_task(datasets.DatasetDict({"train": scores, "validation": scores}), "score")[0] == "regression"
    whole = datasets.Dataset.from_dict({"text": ["a", "b", "c"], "score": [0.0, 2.0, 5.0]})
    whole_and_fractions = datasets.DatasetDict({"train": whole, "validation": scores})  # validation's 2.4: scores
    assert label_task(whole_and_fractions, "score")[0] == "regression"
    # No validation file: the 10% held out keeps each class's share, as an integer column's (a rare class stays in
    # training), where a random split could leave one class in validation alone.
    from ddp_utils.data.raw_data import _stratified

    rare = datasets.Dataset.from_dict({"label": [0.0] * 18 + [1.0] * 2})
    held = _stratified(rare, "label", 2, seed=0)
    assert held is not None and sorted(rare[held]["label"]) == [0.0, 0.0]


@pytest.mark.fast
def test_an_integer_label_column_says_how_many_classes_it_made_and_regression_needs_numbers(caplog):
    import logging

    import datasets
    from accelerate import PartialState

    from ddp_utils.data.classification import label_task

    PartialState(cpu=True)
    years = datasets.Dataset.from_dict({"text": ["a"] * 60, "year": list(range(1960, 2020))})
    raw = datasets.DatasetDict({"train": years, "validation": years})
    with caplog.at_level(logging.INFO):
        task, labels, _ = label_task(raw, "year")
    assert task == "classification" and labels["num_labels"] == 60
    assert "'year' holds 60 distinct integers: a classifier of 60 classes (--task regression" in caplog.text
    # One example a year: a quantity, not classes, and nothing learned; said as a warning (before: an info line).
    assert [r.levelname for r in caplog.records if "distinct integers" in r.message] == ["WARNING"]
    assert "; 1.0 training examples a class, too few to learn one: are they classes?" in caplog.text
    intents = datasets.Dataset.from_dict({"text": ["a"] * 300, "intent": list(range(30)) * 10})
    caplog.clear()
    with caplog.at_level(logging.INFO):  # 30 intents of 10 examples each: classes, said in the log only
        label_task(datasets.DatasetDict({"train": intents, "validation": intents}), "intent")
    assert [r.levelname for r in caplog.records if "distinct integers" in r.message] == ["INFO"]
    assert label_task(raw, "year", "regression")[:2] == ("regression", {"num_labels": 1, "problem_type": "regression"})
    words = datasets.Dataset.from_dict({"text": ["a", "b"], "label": ["good", "bad"]})
    with pytest.raises(UsageError, match="--task regression needs numbers in 'label'"):
        label_task(datasets.DatasetDict({"train": words, "validation": words}), "label", "regression")


# --- Classification files as spreadsheets and scripts write them ------------------------------------


def classify(tmp_path, tiny_model, files: dict, *extra):
    """train.py's own parse_args and prepare_data on `files` ({"train.csv": text, ...}: the first the training
    file, a second the validation file), with the tiny BERT."""
    from accelerate import PartialState

    PartialState(cpu=True)
    paths = []
    for name, text in files.items():
        (tmp_path / name).write_text(text)
        paths.append(tmp_path / name)
    argv = ["--model_name_or_path", tiny_model, "--train_file", paths[0], "--output_dir", tmp_path / "out"]
    argv += ["--validation_file", paths[-1], "--report_to", "none", "--max_length", 32, *extra]
    script = load_script("train")
    return script.prepare_data(script.parse_args([str(a) for a in argv]))


INTENTS = "text,label\nbook me a flight,book_flight\nhello there,None\nnull,NA\nfly me to Rome,book_flight\nhi,None\n"


@pytest.mark.fast
@pytest.mark.parametrize("extension", [".csv", ".tsv"])
def test_labels_and_text_reading_none_or_na_are_values_not_missing(tiny_model, tmp_path, extension):
    """LUIS and CLINC intent sets have a "None" class. pandas reads "None", "NA", "null" and "N/A" cells as missing,
    and such a file was refused: "3 train records have an empty or missing 'label'"; only an empty cell is."""
    text = INTENTS.replace(",", "\t") if extension == ".tsv" else INTENTS
    tokenized, _, config = classify(tmp_path, tiny_model, {f"train{extension}": text})
    assert sorted(config.label2id) == ["NA", "None", "book_flight"] and len(tokenized["train"]) == 5
    with pytest.raises(UsageError, match="1 train records have an empty or missing 'label' \\(first: record 1\\)"):
        classify(tmp_path, tiny_model, {f"gaps{extension}": text.replace("None", "", 1)})


@pytest.mark.fast
def test_a_validation_file_with_other_columns_than_the_training_files_prepares(tiny_model, tmp_path):
    """A validation file with a column more ("source") failed at the end of the first epoch, in `map`, with
    "Unable to create tensor ... activate truncation and/or padding"; the other way round, at once, in `map`."""
    plain, extra = (
        "text,label\ngood,pos\nbad,neg\nfine,pos\nawful,neg\n",
        "text,label,source\ngood,pos,web\nbad,neg,web\n",
    )
    for files in ({"train.csv": plain, "extra.csv": extra}, {"extra.csv": extra, "plain.csv": plain}):
        tokenized, _, _ = classify(tmp_path, tiny_model, files)
        assert all(tokenized[split].column_names == tokenized["train"].column_names for split in tokenized)


@pytest.mark.fast
def test_a_csv_separated_by_semicolons_is_named_so(tiny_model, tmp_path):
    """Excel saves "CSV" with semicolons in many locales: one column, "text;label", and the fix named was a
    --text_column, which cannot help."""
    with pytest.raises(UsageError, match="Its header looks separated by ';': save it separated by commas as .csv"):
        classify(tmp_path, tiny_model, {"train.csv": "text;label\ngood;pos\nbad;neg\n"})


@pytest.mark.fast
def test_labels_with_spaces_around_them_are_one_class_and_said(tiny_model, tmp_path, caplog):
    """ "pos " and " pos" (a spreadsheet's stray space, "good, pos" in a CSV) were classes of their own."""
    text = "text,label\ngood, pos\nbad,neg\nfine,pos \nawful,neg\ngreat,pos\n"
    with caplog.at_level("WARNING"):
        tokenized, _, config = classify(tmp_path, tiny_model, {"train.csv": text})
    assert config.label2id == {"neg": 0, "pos": 1} and list(tokenized["train"]["labels"]) == [1, 0, 1, 0, 1]
    assert "labels of 'label' with spaces around them are read without: [' pos', 'pos ']" in caplog.text


@pytest.mark.fast
@pytest.mark.parametrize(
    "files, extra, expected",
    [
        ({"t.jsonl": '{"s": "a", "score": 1.5}\n{"s": "b", "score": NaN}\n{"s": "c", "score": 2.0}\n'},
         ["--text_column", "s", "--label_column", "score"],
         "1 train records have a missing, NaN or infinite 'score' (first: record 1)"),
        ({"t.jsonl": '{"s": "a", "score": 1.5}\n{"s": "c", "score": 2.0}\n', "v.jsonl": '{"s": "b", "score": NaN}\n'},
         ["--text_column", "s", "--label_column", "score"],
         "1 validation records have a missing, NaN or infinite 'score' (first: record 0)"),
        ({"t.jsonl": '{"text": "a", "label": 0}\n{"text": "b", "label": "1"}\n'}, [],
         "the train data's 'label' mixes types from record to record"),
        ({"t.jsonl": '{"text": 5, "label": 0}\n{"text": 6, "label": 1}\n'}, [],
         "the train data's 'text' holds numbers (int64), not text (first: record 0, '5'); name a text column with "
         "--text_column"),
        ({"t.csv": "s,score\na,1.5\nb,NA\nc,2.0\nd,0.25\n"}, ["--text_column", "s", "--label_column", "score"],
         "the train data's 'score' holds numbers and 'NA', a gap written as text: leave those cells empty"),
    ],
    ids=["nan-train-label", "nan-validation-label", "mixed-label-types", "numbers-as-text", "na-among-numbers"],
)  # fmt: skip
def test_json_values_that_cannot_train_are_refused_in_one_line(tiny_model, tmp_path, files, extra, expected):
    """Python's json.dumps writes NaN: in training a NaN loss at step one, blamed on the learning rate; in
    validation NaN scores and a "best" checkpoint, reported as a success. Mixed types and numbers as text ended in
    Arrow's or the tokenizer's traceback. R's write.csv writes NA among numbers: read as text, a regression
    trained as a classifier of '0.25', ..., 'NA'; given --task classification, it is one."""
    with pytest.raises(UsageError) as refused:
        classify(tmp_path, tiny_model, files, *extra)
    assert expected in str(refused.value)
    if "a gap written as text" in expected:
        _, _, config = classify(tmp_path, tiny_model, files, *extra, "--task", "classification")
        assert sorted(config.label2id) == ["0.25", "1.5", "2.0", "NA"]


# --- Hub text datasets, as datasets.load_dataset returns them ------------------------------------


def hub_text(monkeypatch, tiny_model, tmp_path, raw, *argv):
    """train.py's parse_args and prepare_data on `raw`, a DatasetDict as `datasets.load_dataset(name)` returns it
    (the Hub's own split names and features), through the script's --dataset_name branch; (args, data)."""
    import datasets
    from accelerate import PartialState

    PartialState(cpu=True)  # the script logs through Accelerate
    monkeypatch.setattr(datasets, "load_dataset", lambda *names, **options: raw)
    script = load_script("train")
    argv = ["--model_name_or_path", tiny_model, "--dataset_name", "stand-in", "--output_dir", tmp_path / "out", *argv]
    args = script.parse_args([str(a) for a in [*argv, "--report_to", "none", "--max_length", 32]])
    return args, script.prepare_data(args)


def hub_dataset(splits: dict, features: dict, seed=0):
    """A DatasetDict built in memory with `features` ({column: feature}): per split, its labels (or label lists);
    each text column a few words, the label's in the first ("positive" and "negative" where a name is one)."""
    import datasets

    rng, features = random.Random(seed), datasets.Features(features)
    texts = [c for c, f in features.items() if getattr(f, "dtype", "") == "string" and c not in ("idx", "id")]
    label = next(c for c in features if c not in texts and c not in ("idx", "id"))
    names = getattr(features[label], "names", None) or getattr(getattr(features[label], "feature", None), "names", [])

    def words(value):
        name = names[value] if isinstance(value, int) and 0 <= value < len(names) else str(value)
        return " ".join(rng.choices(FILLER, k=3) + rng.choices(WORDS.get(name, FILLER), k=1))

    built = {}
    for split, labels in splits.items():
        columns = {c: [words(v if c == texts[0] else None) for v in labels] for c in texts}
        columns.update({label: labels, "idx": list(range(len(labels))), "id": [str(i) for i in range(len(labels))]})
        columns = {c: values for c, values in columns.items() if c in features}
        built[split] = datasets.Dataset.from_dict(columns, features=features)
    return datasets.DatasetDict(built)


SENTIMENT = ["negative", "positive"]


@pytest.mark.fast
def test_hub_text_datasets_as_load_dataset_gives_them_train_with_their_names(tiny_model, tmp_path, monkeypatch):
    """GLUE's SST-2 (an idx column, a test split labelled -1 left unread), MNLI's pairs and validation_matched, STS-B's
    float scores (regression), Yelp's class names with spaces, GoEmotions' lists of class labels (multi-label), a
    ClassLabel of numbers named out of order: each read with the names the saved config gives pipeline()."""
    import datasets

    CL, V = datasets.ClassLabel, datasets.Value
    sst2 = hub_dataset(
        {"train": [0, 1] * 6, "validation": [1, 0, 1], "test": [-1] * 3},
        {"sentence": V("string"), "label": CL(names=SENTIMENT), "idx": V("int32")},
    )
    _, (tokenized, _, config) = hub_text(monkeypatch, tiny_model, tmp_path, sst2, "--text_column", "sentence")
    assert config.id2label == {0: "negative", 1: "positive"} and tokenized["validation"]["labels"] == [1, 0, 1]
    mnli = hub_dataset(
        {"train": [0, 1, 2] * 4, "validation_matched": [2, 1], "validation_mismatched": [0], "test_matched": [-1]},
        {"premise": V("string"), "hypothesis": V("string"), "label": CL(names=["entailment", "neutral", "contra"])},
    )
    argv = ["--text_column", "premise,hypothesis", "--validation_split", "validation_matched"]
    _, (tokenized, tokenizer, config) = hub_text(monkeypatch, tiny_model, tmp_path, mnli, *argv)
    assert tokenized["validation"]["labels"] == [2, 1] and config.label2id["contra"] == 2
    assert tokenizer.decode(tokenized["train"][0]["input_ids"]).count("[SEP]") == 2, "the pair, both sentences"
    stsb = hub_dataset({"train": [0.5, 4.2, 3.0, 1.25], "validation": [2.0, 5.0]},
                       {"sentence1": V("string"), "sentence2": V("string"), "label": V("float32")})  # fmt: skip
    pairs = ["--text_column", "sentence1,sentence2"]
    _, (tokenized, _, config) = hub_text(monkeypatch, tiny_model, tmp_path, stsb, *pairs)
    assert config.problem_type == "regression" and tokenized["validation"]["labels"] == [2.0, 5.0]
    stars = CL(names=["1 star", "2 star", "3 stars", "4 stars", "5 stars"])
    yelp = hub_dataset({"train": [0, 1, 2, 3, 4] * 2, "test": [4, 0]}, {"label": stars, "text": V("string")})
    _, (tokenized, _, config) = hub_text(monkeypatch, tiny_model, tmp_path, yelp)
    assert list(config.id2label.values()) == stars.names and tokenized["validation"]["labels"] == [4, 0]
    emotions = datasets.Sequence(CL(names=["admiration", "anger", "joy"]))
    go = hub_dataset({"train": [[0], [1, 2], [2], []], "validation": [[2, 0]]},
                     {"text": V("string"), "labels": emotions, "id": V("string")})  # fmt: skip
    _, (tokenized, _, config) = hub_text(monkeypatch, tiny_model, tmp_path, go, "--label_column", "labels")
    assert config.problem_type == "multi_label_classification" and tokenized["validation"]["labels"] == [[1, 0, 1]]
    numbers = hub_dataset({"train": [0, 1, 1, 0], "test": [0]}, {"text": V("string"), "label": CL(names=["1", "0"])})
    _, (tokenized, _, config) = hub_text(monkeypatch, tiny_model, tmp_path, numbers)
    assert config.id2label == {0: "1", 1: "0"} and tokenized["validation"]["labels"] == [0], "the ClassLabel's order"


@pytest.mark.fast
def test_max_samples_of_a_hub_text_split_in_class_order_take_every_class(tiny_model, tmp_path, monkeypatch):
    """IMDB's train and test splits are sorted by label: --max_train_samples 10 took 'neg' alone, refused as
    "validation labels ['pos'] never occur in the training data; add training examples of them", a fix that
    named the data, not the option; --max_eval_samples 6 scored one class. Each is now a sample, by --seed."""
    import datasets

    imdb = hub_dataset(
        {"train": [0] * 20 + [1] * 20, "test": [0] * 10 + [1] * 10, "unsupervised": [-1] * 5},
        {"text": datasets.Value("string"), "label": datasets.ClassLabel(names=["neg", "pos"])},
    )
    _, (tokenized, _, _) = hub_text(
        monkeypatch, tiny_model, tmp_path, imdb, "--max_train_samples", 10, "--max_eval_samples", 6
    )
    assert (len(tokenized["train"]), len(tokenized["validation"])) == (10, 6)
    assert set(tokenized["train"]["labels"]) == set(tokenized["validation"]["labels"]) == {0, 1}


@pytest.mark.fast
@pytest.mark.parametrize(
    "texts, label, argv, expected",
    [
        (["text"], "labels", [], "has no column 'label'; its columns are ['text', 'labels', 'id']. Name the right one "
         "with --label_column labels"),  # GoEmotions
        (["text"], "target", [], "Name the right one with --label_column target"),
        (["review"], "category", ["--text_column", "review"], "Name the right one with --label_column category"),
        (["text"], "stars", [], "Name the right one with --label_column stars"),
        (["sentence1", "sentence2"], "label", [], "Name the right one with --text_column sentence1,sentence2"),
        (["question1", "question2"], "label", [], "Name the right one with --text_column question1,question2"),
        (["title", "content"], "label", [], "Name the right one with --text_column title,content"),  # Amazon polarity
        (["tweet"], "label", [], "Name the right one with --text_column tweet"),
        (["Text"], "Label", ["--text_column", "Text"], "Name the right one with --label_column Label"),
    ],
    ids=["labels", "target", "category", "stars", "mrpc", "qqp", "amazon", "tweet", "capitals"],
)  # fmt: skip
def test_a_hub_dataset_of_other_column_names_is_told_the_option_with_its_column(
    tiny_model, tmp_path, monkeypatch, texts, label, argv, expected
):
    """The fix said "Name the right one with --label_column", no value, for GoEmotions' 'labels' and a 'target',
    'category' or 'stars'; for MRPC's and QQP's sentence pairs it named no column, and for Amazon polarity its
    'content' alone (the title dropped)."""
    import datasets

    names = datasets.ClassLabel(names=SENTIMENT)
    features = {**{c: datasets.Value("string") for c in texts}, label: names}
    if label == "labels":  # GoEmotions: lists of class labels, and an id
        features.update(labels=datasets.Sequence(names), id=datasets.Value("string"))
    raw = hub_dataset({"train": [[0], [1]] if label == "labels" else [0, 1]}, features)
    with pytest.raises(UsageError) as refused:
        hub_text(monkeypatch, tiny_model, tmp_path, raw, *argv)
    assert expected in str(refused.value)


@pytest.mark.fast
def test_one_column_of_a_sentence_pair_is_warned_about(tiny_model, tmp_path, monkeypatch, caplog):
    """MNLI with --text_column premise trained on the premise alone, the hypothesis (and the task) dropped unsaid."""
    import datasets

    mnli = hub_dataset(
        {"train": [0, 1, 2] * 2, "validation_matched": [1, 2]},
        {"premise": datasets.Value("string"), "hypothesis": datasets.Value("string"),
         "label": datasets.ClassLabel(names=["entailment", "neutral", "contradiction"])},
    )  # fmt: skip
    with caplog.at_level(logging.WARNING):
        hub_text(monkeypatch, tiny_model, tmp_path, mnli, "--text_column", "premise", "--validation_split",
                 "validation_matched")  # fmt: skip
    assert "'hypothesis' is not read, only 'premise'; for the pair: --text_column premise,hypothesis" in caplog.text


@pytest.mark.fast
@pytest.mark.parametrize(
    "splits, argv, expected",
    [
        ({"train": [0, -1, 1, 2, -1, 0], "validation": [1, 2]}, [],
         "2 of the 6 train examples are unlabelled (label -1, as SNLI's without a gold label); drop them in the DATA "
         "section: data = data.filter(lambda row: row['label'] >= 0)"),
        ({"train": [0, 1, 2], "validation": [1, 2], "test": [-1, -1]}, ["--validation_split", "test"],
         "the validation split is unlabelled (label -1 in every example, as in GLUE's test splits); name a labelled "
         "split with --validation_split"),
        ({"train": [0, 1, 2], "unsupervised": [-1, -1], "test": [1]}, ["--train_split", "unsupervised"],
         "the train split is unlabelled (label -1 in every example"),
        ({"train": [0.5, 4.0, 2.5], "validation": [1.0, 3.0], "test": [-1.0, -1.0, -1.0]},
         ["--validation_split", "test"],
         "the validation data's 'label' is -1.0 in every example (an unlabelled split, as GLUE's STS-B test), "
         "nothing to learn from or score; give validation data of labelled, varied values (of a Hub dataset: another "
         "split, --validation_split)"),
        ({"train": [2.0, 2.0, 2.0], "validation": [1.0, 3.0]}, [],
         "the train data's 'label' is 2.0 in every example, nothing to learn from or score; give train data"),
    ],
    ids=["snli-some-unlabelled", "glue-test", "imdb-unsupervised", "stsb-test", "constant-train"],
)  # fmt: skip
def test_unlabelled_hub_examples_are_refused_with_the_fix_that_applies(
    tiny_model, tmp_path, monkeypatch, splits, argv, expected
):
    """SNLI's training split holds examples without a gold label (-1) among the others: "use a labelled split", the
    fix given, exists for none of its splits. STS-B's test split (-1.0 throughout) trained and scored as a success:
    an MSE against -1, correlations of 0."""
    import datasets

    regression = isinstance(splits["train"][0], float)
    label = datasets.Value("float32") if regression else datasets.ClassLabel(names=["entailment", "neutral", "c"])
    raw = hub_dataset(splits, {"premise": datasets.Value("string"), "label": label})
    with pytest.raises(UsageError) as refused:
        hub_text(monkeypatch, tiny_model, tmp_path, raw, "--text_column", "premise", *argv)
    assert expected in str(refused.value)


@pytest.mark.fast
def test_sparse_regression_scores_whose_validation_is_constant_train_with_a_warning(
    tiny_model, tmp_path, monkeypatch, caplog
):
    """Toxicity-like scores, mostly 0: a validation split of zeros only is data, not an unlabelled split; refused
    at first (and told --validation_split, which local files cannot take), it trains, its correlations said NaN."""
    import datasets

    raw = hub_dataset({"train": [0.0, 0.0, 0.7, 0.0, 0.2], "validation": [0.0, 0.0]},
                      {"premise": datasets.Value("string"), "label": datasets.Value("float32")})  # fmt: skip
    with caplog.at_level(logging.WARNING):
        hub_text(monkeypatch, tiny_model, tmp_path, raw, "--text_column", "premise")
    assert "the validation data's 'label' is 0.0 in every example: its Pearson and Spearman" in caplog.text


# --- SFT: prompts and answers, content parts, media, long conversations, other data -----------------

ALPACA = [{"instruction": "is the movie good", "input": "w7 w8", "output": "w1 w2"}] * 4


@pytest.mark.fast
def test_prompt_completion_and_alpaca_become_chat_turns_when_the_tokenizer_has_a_template(tmp_path, caplog):
    """Before: BOS + prompt + answer + EOS, glued, even for an instruct model with a template."""
    import logging

    with caplog.at_level(logging.INFO):
        tokenized, tokenizer, _, _ = sft(tmp_path, ALPACA, chat_template=True)
    assert "alpaca records: the tokenizer's chat template, a user turn and an assistant turn" in caplog.text
    chat = tokenized["train"][0]
    text = tokenizer.decode(chat["input_ids"])
    assert text.startswith("<s> user: is the movie good w7 w8 assistant: w1 w2 </s>"), text
    learned = [t for t in chat["labels"] if t != -100]
    assert tokenizer.decode(learned) == "w1 w2 </s>", "the answer and its end of turn"
    caplog.clear()
    with caplog.at_level(logging.INFO):
        raw = sft(tmp_path, ALPACA, "--no-chat_template", chat_template=True)[0]["train"][0]
    assert "alpaca records: BOS, the prompt, '\\n\\n', the answer, EOS (no chat template: --no-chat_template)" in (
        caplog.text
    )
    assert tokenizer.decode(raw["input_ids"]) == "<s> is the movie good w7 w8 w1 w2 </s>"


@pytest.mark.fast
@pytest.mark.parametrize(
    "messages, expected",
    [
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}],
         "train record 0: its assistant turn 1 is empty; fill it or drop the record"),
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}, {"role": "user", "content": "x"},
          {"role": "assistant", "content": "w1"}], "train record 0: its assistant turn 1 is empty"),
        ([{"role": "human", "content": "hi"}, {"role": "gpt", "content": "w1"}],
         "has no assistant turn, so nothing to learn or to answer; its roles ['gpt', 'human'] are not the chat roles"),
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "text", "text": ""}]}],
         "train record 0: its assistant turn 1 is empty"),
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "weight": 0},
          {"role": "user", "content": "x"}, {"role": "assistant", "content": "w1"}], None),  # context, not learned
    ],
    ids=["empty-answer", "empty-earlier-answer", "sharegpt-roles-in-messages", "empty-parts", "weight-0-is-kept"],
)  # fmt: skip
def test_an_empty_answer_and_unknown_roles_are_refused_naming_the_turn(tmp_path, messages, expected):
    """An empty answer trained the model to answer with its end-of-turn token alone (DPO refused one); ShareGPT's
    role names in role/content turns were "no assistant turn ... end each conversation with the assistant's
    answer", though the record ends with one. An empty turn that is not learned ("weight": 0) is context."""
    if expected is None:
        assert len(sft(tmp_path, [{"messages": messages}] * 4, chat_template=True)[0]["train"]) == 4
        return
    with pytest.raises(UsageError, match=re.escape(expected)):
        sft(tmp_path, [{"messages": messages}] * 4, chat_template=True)
    if "earlier" in str(messages) or len(messages) == 4:  # under --loss_on last_assistant the earlier one is context
        sft(tmp_path, [{"messages": messages}] * 4, "--loss_on", "last_assistant", chat_template=True)


@pytest.mark.fast
def test_alpaca_history_and_system_are_trained_as_turns_and_refused_without_a_template(tmp_path):
    """LLaMA-Factory's Alpaca shape: a system text and a history of [question, answer] pairs before the
    instruction. DPO read both; SFT dropped them without a word, and trained the last answer alone."""
    record = {**ALPACA[0], "system": "w9", "history": [["the movie", "w3"]]}
    tokenized, tokenizer, _, _ = sft(tmp_path, [record] * 4, chat_template=True)
    text = tokenizer.decode(tokenized["train"][0]["input_ids"])
    # the tiny vocabulary has no word "system:"
    assert text.startswith("<s> <unk> w9 user: the movie assistant: w3 </s> user: is the movie good w7 w8"), text
    refused = pytest.raises(UsageError, match="record 0 has a system text or a history, which only a chat template")
    with refused:
        sft(tmp_path, [record] * 4, "--no-chat_template", chat_template=True)
    with pytest.raises(UsageError, match=re.escape("record 0: its history holds \"['the movie', None]\"; give it as")):
        sft(tmp_path, [{**record, "history": [["the movie", None]]}] * 4, chat_template=True)


@pytest.mark.fast
@pytest.mark.parametrize(
    "record, expected",
    [
        ({"system": "Be brief.", "question": "What is 6+6?", "chosen": "12", "rejected": "13"},
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 6+6?"}]),
        ({"system": "", "question": "What is 6+6?", "chosen": "12", "rejected": "13"}, "What is 6+6?"),
        ({"prompt": None, "chosen": "12", "rejected": "13"}, "train record 0: its prompt is missing; fill it or drop"),
    ],
    ids=["orca-with-system", "orca-without", "null-prompt"],
)  # fmt: skip
def test_orca_pairs_keep_their_question_and_a_null_prompt_is_one_line(record, expected):
    """Intel's orca_dpo_pairs (system, question, chosen, rejected) was read as an implicit prompt: the answers'
    shared first words became the prompt, and the question was dropped. A null prompt was a raw TypeError."""
    import datasets
    from accelerate import PartialState

    from ddp_utils.language_models.pair_formats import detect_pair_format

    PartialState(cpu=True)  # the format found is logged
    raw = datasets.DatasetDict({"train": datasets.Dataset.from_list([record])})
    fmt = detect_pair_format(raw, None)
    if isinstance(expected, str) and "missing" in expected:
        with pytest.raises(UsageError, match=re.escape(expected)):
            fmt.pair(record, 0, "train")
        return
    assert fmt.kind == "question" and fmt.pair(record, 0, "train")[0] == expected
    if isinstance(expected, list):  # turns: the template renders them, so --no-chat_template cannot
        with pytest.raises(UsageError, match="has a system text or a history, which only a chat template shows"):
            detect_pair_format(raw, False).pair(record, 0, "train")


CONVERSATION = [
    {"role": "user", "content": "the movie"},
    {"role": "assistant", "content": "w1 w2"},
    {"role": "user", "content": "was it good"},
    {"role": "assistant", "content": "w3"},
]


@pytest.mark.fast
def test_content_given_as_parts_is_joined_into_text_and_other_parts_are_refused(tmp_path):
    """OpenAI's chat file and LLaMA-Factory's v1 shape give content as a list of parts. Before: a
    Jinja TypeError inside the chat template, about 60 lines."""
    openai = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in CONVERSATION]
    llamafactory = [{**m, "content": [{"type": "text", "value": m["content"]}]} for m in CONVERSATION]
    plain = sft(tmp_path, [{"messages": CONVERSATION}] * 3, chat_template=True)[0]["train"][0]
    for records in (openai, llamafactory):
        assert sft(tmp_path, [{"messages": records}] * 3, chat_template=True)[0]["train"][0] == plain
    picture = {"type": "image_url", "image_url": {"url": "x.png"}}
    pictured = [{**openai[0], "content": [picture, *openai[0]["content"]]}, *openai[1:]]
    with pytest.raises(UsageError, match=r"^train record 0, turn 0 \(user\) holds a part of type 'image_url': this"):
        sft(tmp_path, [{"messages": pictured}] * 3, chat_template=True)


@pytest.mark.fast
def test_records_with_images_are_refused_not_trained_as_text(tmp_path):
    """LLaMA-Factory's multimodal sets: an 'images' column and <image> in the text. Before: trained
    on the text alone, the placeholder learned as a word. An empty column (text-only records) is fine."""
    records = [{"instruction": "<image>what is it", "output": "w1", "images": ["cat.jpg"]}] * 3
    with pytest.raises(UsageError, match="the data has a 'images' column .* this script fine-tunes on text only"):
        sft(tmp_path, records, chat_template=True)
    assert len(sft(tmp_path, [{**r, "images": []} for r in records], chat_template=True)[0]["train"]) == 3


@pytest.mark.fast
def test_a_long_conversation_keeps_its_newest_answers_that_fit(tmp_path):
    """Before: a conversation whose answers did not all fit the block was dropped whole."""
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"w{i} w{i + 1} w{i + 2}"} for i in range(12)]
    tokenized, tokenizer, _, report = sft(tmp_path, [{"messages": turns}] * 2, "--block_size", 20, chat_template=True)
    assert report["train_records_answers_left_out"] == 2 and report["train_records_dropped"] == 0
    row = tokenized["train"][0]
    learned = "".join("x" if label != -100 else "." for label in row["labels"])
    answers = [tokenizer.decode([t for t in run if t != -100]) for run in _runs(row["labels"])]
    assert len(row["input_ids"]) == 20 and learned[0] == ".", learned
    assert answers == ["w9 w10 w11 </s>", "w11 w12 w13 </s>"][-len(answers) :] and answers, answers  # the newest, whole
    assert report["train_answers_left_out"] == 2 * (6 - len(answers)), "6 answers each: the rest left out"
    with pytest.raises(UsageError, match="last answer fits in --block_size 4 tokens; raise --block_size .*last_assist"):
        sft(tmp_path, [{"messages": turns}] * 2, "--block_size", 4, chat_template=True)  # not even the last one fits


def _runs(labels):
    """The runs of learned tokens in `labels`, each as its token ids."""
    runs, current = [], []
    for label in labels + [-100]:
        if label != -100:
            current.append(label)
        elif current:
            runs, current = runs + [current], []
    return runs


@pytest.mark.parametrize(
    "records, expected",
    [
        (
            [{"prompt": "the movie", "chosen": "w1", "rejected": "w2"}] * 3,  # TRL's preference shape
            "this is preference data (a 'chosen' and a 'rejected' answer per record), for preference tuning: "
            "scripts/train_dpo.py takes it",
        ),
        (
            [
                {
                    "conversations": [{"from": "human", "value": "the movie"}],
                    "chosen": {"from": "gpt", "value": "w1"},
                    "rejected": {"from": "gpt", "value": "w2"},
                }
            ]
            * 3,  # LLaMA-Factory's pairs
            "this is preference data",
        ),
        (
            [{"prompt": "the movie", "completion": "w1", "label": True}] * 3,  # TRL's KTO shape
            "this is unpaired preference data (KTO: an answer per record with a boolean 'label')",
        ),
        (
            [{"messages": CONVERSATION, "kto_tag": False}] * 3,  # LLaMA-Factory's KTO tag
            "with a boolean 'kto_tag'), which no script here trains on (TRL's KTOTrainer does)",
        ),
    ],
    ids=["trl_pairs", "llamafactory_pairs", "trl_kto", "llamafactory_kto"],
)
@pytest.mark.fast
def test_preference_data_given_to_the_sft_script_is_named_with_the_script_that_takes_it(records, expected, tmp_path):
    """Before: "has no assistant turn", or trained on one side."""
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    model = make_tiny_causal_lm(tmp_path / "llama", chat_template=True)
    args = ["--model_name_or_path", model, "--train_file", path, "--report_to", "none", "--output_dir", tmp_path / "o"]
    refused_in_process("train_sft", args, expected)


@pytest.mark.fast
def test_conversations_in_a_csv_are_json_text_and_train_as_the_jsonl_does(tmp_path):
    """A CSV cell (or a column stored as text) holds a conversation as JSON: messages and ShareGPT turns are read as
    the JSONL's (before: "fits none of the SFT formats", so no CSV of conversations could be used)."""
    import csv

    def csv_argv(path):
        model = tmp_path / "llama-True"  # the tiny Llama with a chat template that `sft` makes
        argv = ["--model_name_or_path", model, "--train_file", path, "--validation_file", path, "--report_to", "none"]
        return [str(a) for a in [*argv, "--output_dir", tmp_path / "out", "--eval_max_new_tokens", 0]]

    sharegpt = [{"from": "human", "value": "the movie"}, {"from": "gpt", "value": "w1 w2"}]
    for column, turns in (("messages", CONVERSATION), ("conversations", sharegpt)):
        from_jsonl = sft(tmp_path, [{column: turns}] * 6, chat_template=True, name=f"{column}.jsonl")[0]["train"]
        with open(tmp_path / f"{column}.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=[column])
            writer.writeheader()
            writer.writerows({column: json.dumps(turns)} for _ in range(6))
        script = load_script("train_sft")
        from_csv = script.prepare_data(script.parse_args(csv_argv(tmp_path / f"{column}.csv")))[0]["train"]
        assert from_csv["input_ids"] == from_jsonl["input_ids"] and from_csv["labels"] == from_jsonl["labels"], column
    (tmp_path / "broken.csv").write_text('messages\n"[{role: user}]"\n"[{role: user}]"\n')
    refused_in_process("train_sft", csv_argv(tmp_path / "broken.csv"), "its conversation is a string that is not valid")


@pytest.mark.fast
def test_preference_pairs_in_a_csv_are_json_text_and_read_as_the_jsonl_does(tmp_path):
    """A CSV of DPO pairs holds its turns as JSON text: read as conversations (before: trained as raw JSON text);
    a prompt that starts with "[INST]" or an answer that is a JSON array stays text."""
    import datasets
    from accelerate import PartialState

    from ddp_utils.language_models.pair_formats import detect_pair_format

    PartialState(cpu=True)  # ddp_utils logs through Accelerate's logger
    turns = {
        "prompt": [{"role": "user", "content": "the movie"}],
        "chosen": [{"role": "assistant", "content": "w1"}],
        "rejected": [{"role": "assistant", "content": "w2"}],
    }
    path = tmp_path / "pairs.csv"
    datasets.Dataset.from_list([{key: json.dumps(value) for key, value in turns.items()}] * 3).to_csv(str(path))
    raw = datasets.load_dataset("csv", data_files=str(path))
    fmt = detect_pair_format(raw, None)
    assert fmt.kind == "conversational"
    assert fmt.pair(raw["train"][0], 0, "train") == fmt.pair(turns, 0, "train")
    texts = {"prompt": "[INST] the movie [/INST]", "chosen": '[{"id": 1}]', "rejected": "[2]"}
    strings = datasets.DatasetDict({"train": datasets.Dataset.from_list([texts])})
    assert detect_pair_format(strings, None).pair(texts, 0, "train") == tuple(texts.values()), "text stays text"


@pytest.mark.fast
def test_sft_and_clm_preparation_runs_on_several_processes_with_the_same_result(tmp_path):
    """--preprocessing_num_workers, the chat template rendered per record in each (before: ignored by
    train_sft.py; train_clm.py's grouping into blocks ran in one process)."""
    records = [
        {"messages": [{"role": "user", "content": f"w{i} the movie"}, {"role": "assistant", "content": "w1"}]}
        for i in range(40)
    ]
    one = sft(tmp_path, records, chat_template=True)[0]["train"]
    two = sft(tmp_path, records, "--preprocessing_num_workers", 2, chat_template=True)[0]["train"]
    assert one["input_ids"] == two["input_ids"] and one["labels"] == two["labels"]
    clm = load_script("train_clm")
    corpus = write_text_corpus(tmp_path / "corpus.txt")
    model = make_tiny_causal_lm(tmp_path / "clm-llama")
    common = ["--model_name_or_path", model, "--train_file", corpus, "--block_size", 16, "--report_to", "none"]
    common += ["--validation_split_percentage", 40]
    blocks = [
        clm.prepare_data(clm.parse_args([*map(str, common), "--output_dir", str(tmp_path / "o"), *extra]))[0]["train"]
        for extra in ([], ["--preprocessing_num_workers", "2"])
    ]
    assert blocks[0]["input_ids"] == blocks[1]["input_ids"] and len(blocks[0]) > 2


# --- Hub datasets with their own split names --------------------------------------------------------


def hub_layout(directory, splits: dict):
    """A dataset folder as a Hub repository lays out its Parquet files (data/<split>-00000-of-00001.parquet), which
    `datasets.load_dataset(<folder>)` reads through the same builder as `--dataset_name <org>/<name>`: the splits
    keep their own names (UltraChat's train_sft and test_sft, UltraFeedback's train_prefs and test_prefs)."""
    import datasets

    for split, records in splits.items():
        (directory / "data").mkdir(parents=True, exist_ok=True)
        datasets.Dataset.from_list(records).to_parquet(str(directory / "data" / f"{split}-00000-of-00001.parquet"))
    return directory


@pytest.mark.fast
def test_a_hub_dataset_with_its_own_split_names_is_read_with_train_split_and_validation_split(tmp_path, caplog):
    """UltraChat 200k's layout for SFT, UltraFeedback binarized's for DPO. Before, both were refused ("no 'train'
    split") with a fix (local files) that did not let the dataset be used."""
    chat = [{"role": "user", "content": "the movie"}, {"role": "assistant", "content": "w1 w2"}]
    ultrachat = hub_layout(
        tmp_path / "ultrachat",
        {
            "train_sft": [{"prompt": "the movie", "messages": chat, "prompt_id": str(i)} for i in range(12)],
            "test_sft": [{"prompt": "the movie", "messages": chat, "prompt_id": str(i)} for i in range(5)],
            "train_gen": [{"prompt": "the movie", "messages": chat[:1], "prompt_id": "g"}],
        },
    )
    model = make_tiny_causal_lm(tmp_path / "llama", chat_template=True)
    common = ["--model_name_or_path", model, "--dataset_name", ultrachat, "--report_to", "none"]
    common += ["--output_dir", tmp_path / "o", "--eval_max_new_tokens", 0]
    refused_in_process(
        "train_sft", common, "the data has no 'train' split (it has ['test_sft', 'train_gen', 'train_sft']); give "
        "--train_split, one of ['train_gen', 'train_sft'] (and --validation_split)"
    )  # fmt: skip
    refused_in_process("train_sft", [*common, "--train_split", "train"], "--train_split train: the dataset has no such")
    only_validation = [*common, "--validation_split", "test_sft"]
    refused_in_process("train_sft", only_validation, "no 'train' split (it has ['test_sft', 'train_gen', 'train_sft'])")
    both = ["--train_split", "train_sft", "--validation_split", "train_sft"]
    refused_in_process("train_sft", [*common, *both], "--train_split and --validation_split both name 'train_sft'")
    tokenized = load_script("train_sft").prepare_data(
        load_script("train_sft").parse_args([*map(str, common), "--train_split", "train_sft", "--validation_split",
                                             "test_sft"])
    )[0]  # fmt: skip
    assert (len(tokenized["train"]), len(tokenized["validation"])) == (12, 5)
    import logging

    with caplog.at_level(logging.WARNING):  # a share held out: the splits left unread are named
        load_script("train_sft").prepare_data(load_script("train_sft").parse_args([*map(str, common), "--train_split",
                                                                                    "train_sft"]))  # fmt: skip
    assert "the dataset's splits ['test_sft', 'train_gen'] are not used; --validation_split names one" in caplog.text
    local = ["--model_name_or_path", model, "--train_file", tmp_path / "x.jsonl", "--train_split", "train_sft"]
    refused_in_process("train_sft", [*local, "--output_dir", tmp_path / "o"], "name the splits of a --dataset_name")

    pair = {"prompt": "the movie", "chosen": chat, "rejected": [*chat[:1], {"role": "assistant", "content": "w3"}]}
    pair.update(score_chosen=8.0, score_rejected=2.0)  # UltraFeedback's columns besides
    ultrafeedback = hub_layout(tmp_path / "ultrafeedback", {"train_prefs": [pair] * 8, "test_prefs": [pair] * 3})
    dpo = load_script("train_dpo")
    args = ["--model_name_or_path", model, "--dataset_name", ultrafeedback, "--train_split", "train_prefs"]
    args += ["--validation_split", "test_prefs", "--report_to", "none", "--output_dir", tmp_path / "d"]
    tokenized = dpo.prepare_data(dpo.parse_args([*map(str, args), "--eval_max_new_tokens", "0"]))[0]
    assert (len(tokenized["train"]), len(tokenized["validation"])) == (8, 3)


@pytest.mark.fast
@pytest.mark.parametrize(
    "script, bad, expected",
    [
        ("train_sft", {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]},
         "train record 13: its assistant turn 1 is empty"),
        ("train_dpo", {"prompt": "w1", "chosen": "w2", "rejected": "w2"},
         "train record 13: its chosen and rejected answers are the same"),
        ("train_grpo", {"prompt": "w1", "tools": [{"type": "function", "function": {"name": "f"}}]},
         "train record 13 has chat turns or tools, which only a chat template shows"),
    ],
    ids=["sft", "dpo", "grpo"],
)  # fmt: skip
def test_a_bad_record_is_named_by_its_row_in_the_file_also_after_a_held_out_share(tmp_path, script, bad, expected):
    """With no validation file, a share of the training file is held out and both parts are shuffled: the
    messages named a record by its place in the shuffled part (`train record 6` for the file's row 13), where
    the user could not find it. Either part's records are now named by their row in the training file."""
    from accelerate import PartialState

    PartialState(cpu=True)
    good = {
        "train_sft": {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "w1"}]},
        "train_dpo": {"prompt": "w1", "chosen": "w2", "rejected": "w3"},
        "train_grpo": {"prompt": "w1", "tools": None},
    }[script]
    records = [{**good, **({"prompt": f"w{i % 7 + 1}"} if "prompt" in good else {})} for i in range(20)]
    records[13] = bad
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    model = make_tiny_causal_lm(tmp_path / "llama", chat_template=script == "train_sft")
    argv = ["--model_name_or_path", model, "--train_file", path, "--output_dir", tmp_path / "out"]
    argv += ["--report_to", "none", "--validation_split_percentage", 20]
    if script == "train_grpo":  # the tiny model's 64 positions
        argv += ["--max_completion_length", 4, "--eval_max_new_tokens", 4]
    module = load_script(script)
    import datasets

    from ddp_utils import check_splits

    raw = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"n": i} for i in range(20)])})
    for seed, split, place in ((2, "train", 10), (4, "validation", 1)):  # either part, not at its row 13
        assert check_splits(raw, {"n": "x"}, seed=seed, hold_out_percentage=20)[split]["n"].index(13) == place
        args = module.parse_args([str(a) for a in [*argv, "--seed", seed]])
        with pytest.raises(UsageError, match=re.escape(expected)):
            module.prepare_data(args)
