"""The work that needs torch, run in a subprocess (`checklist.py --helper env|reload`), so that the runner imports
only the standard library: the machine's facts and the LLM's preparation (`env`), the saved models reloaded
(`reload`)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from checklist_steps import REPO, SITE_MARKER


def helper_env(args) -> dict:
    """The machine (`machine`), and with --llm the LLM's preparation (`helper_llm_prep`)."""
    found = {"environment": machine()}
    if args.llm:
        found["llm"] = helper_llm_prep(args)
    return found


def machine() -> dict:
    """The machine: GPU, driver, torch, CUDA, every package of requirements*.txt and what differs."""
    import importlib.metadata as metadata
    import platform

    import torch

    info = {
        "python": platform.python_version(),
        "executable": sys.executable,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "gpu": None,
        "platform": platform.platform(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = {
            "name": props.name,
            "memory": f"{props.total_memory / 2**30:.1f} GiB",
            "capability": f"{props.major}.{props.minor}",
            "count": torch.cuda.device_count(),
        }
        smi = shutil.which("nvidia-smi")
        if smi:
            done = subprocess.run(
                [smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
            )
            info["gpu"]["driver"] = (
                done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None
            )
    required = {}
    for name in ("requirements.txt", "requirements-demo.txt", "bench/requirements-bench.txt"):  # not the dev tools
        for line in (REPO / name).read_text().splitlines():
            line = line.split("#")[0].strip()
            match = re.match(r"^([A-Za-z0-9_.\-]+)\s*([<>=!~].*)?$", line)
            if match and not line.startswith("-"):
                required[match.group(1)] = (match.group(2) or "").strip()
    extra = ["huggingface_hub", "tokenizers", "pyarrow", "fsspec", "triton", "deepspeed", "pydantic", "trl"]
    extra.append("bitsandbytes")  # step 13 (QLoRA); on the GPU machine from the payload's qlora set
    packages = {}
    for name in [*required, *extra]:
        try:
            packages[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            packages[name] = None
    try:
        import deepspeed  # noqa: F401
    except Exception as exc:  # recorded, not raised: step 5 reads it
        if packages.get("deepspeed"):
            packages["deepspeed"] = None
            info["deepspeed_import_error"] = f"{type(exc).__name__}: {exc}"[:300]
    info["packages"] = packages
    info["differs_from_requirements"] = [
        {"name": name, "required": spec or "(any)", "found": packages.get(name)}
        for name, spec in required.items()
        if not version_meets(packages.get(name), spec)
    ]
    site = os.environ.get("PYTHONPATH", "").split(os.pathsep)[0]
    marker = Path(site, SITE_MARKER) if site else None
    info["payload"] = json.loads(marker.read_text()) if marker and marker.exists() else None
    return info


def version_meets(found: str | None, spec: str) -> bool:
    if found is None:
        return False
    if not spec:
        return True
    try:
        from packaging.specifiers import SpecifierSet

        return SpecifierSet(spec).contains(found, prereleases=True)
    except ImportError:
        return spec == f"=={found}"


def helper_llm_prep(args) -> dict:
    """The LLM of steps 2 to 5, dequantized once into <HF_HOME>/dequantized-gguf (the demo's GGUF on a GPU,
    a tiny Llama written as GGUF in the dry run), the chat records both trainers read (bench_sft's, the
    demo's own), and the facts MFU needs: the model's weights by kind, and the records' token counts."""
    import torch
    from accelerate import PartialState
    from bench_sft import write_chat_data
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from ddp_utils.data.demo import demo_llm_gguf
    from ddp_utils.language_models.gguf import dequantized_gguf

    work, train_records, eval_records = Path(args.llm[0]), int(args.llm[1]), int(args.llm[2])
    work.mkdir(parents=True, exist_ok=True)
    PartialState()  # ddp_utils logs through Accelerate's logger
    if args.llm_shape:  # the demo LLM's architecture and tokenizer, its weights drawn at random: speed figures only
        model_dir, gguf_dir, gguf_file = random_weights_llm(Path(args.llm_shape), work / "random-weights"), None, None
    elif args.dry_run:
        sys.path.insert(0, str(REPO / "tests"))
        from conftest import make_tiny_gguf

        path = work / "tiny-gguf" / "tiny.Q.gguf"
        if not path.exists():  # made once: its dequantized copy is cached by the file's path, size and time
            path, _ = make_tiny_gguf(path.parent)
        gguf_dir, gguf_file = str(path.parent), path.name
    else:
        gguf_dir, gguf_file = demo_llm_gguf()
    if not args.llm_shape:
        model_dir = dequantized_gguf(gguf_dir, gguf_file)
    files = write_chat_data(work, train_records, eval_records)
    if (
        args.dry_run
    ):  # the tiny model's tokenizer is byte-level with a 256-token context: short reviews, so nothing is cut
        for path in files.values():
            records = [json.loads(line) for line in path.read_text().splitlines()]
            for record in records:
                turn = record["messages"][1]
                review, question = turn["content"].rsplit("\n\n", 1)
                turn["content"] = f"{review[-80:]}\n\n{question}"
            path.write_text("".join(json.dumps(record) + "\n" for record in records))
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    head = model.get_output_embeddings()
    linears = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    lengths = []
    for line in files["train"].read_text().splitlines():
        ids = tokenizer.apply_chat_template(json.loads(line)["messages"], tokenize=True)
        lengths.append(len(ids["input_ids"] if hasattr(ids, "keys") else ids))  # transformers 5: a BatchEncoding
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    facts = {
        "linear_params": sum(m.in_features * m.out_features for m in linears),
        "head_params": head.in_features * head.out_features,
        "lora_params": 16 * sum(m.in_features + m.out_features for m in linears),  # r 16 on every linear map
        "layers": config.num_hidden_layers,
        "attention_width": heads * head_dim,
        # Each token attends to ~L/2 tokens of its record (causal): 4·d·L/2 FLOPs per layer, with L weighted by
        # the tokens of each record: sum(L²)/sum(L).
        "mean_tokens_attended": sum(n * n for n in lengths) / max(sum(lengths), 1) / 2,
        "records": len(lengths),
        "max_record_tokens": max(lengths, default=0),
        "records_over_256_tokens": sum(n > 256 for n in lengths),
        "mean_record_tokens": sum(lengths) / max(len(lengths), 1),
        "total_params": sum(p.numel() for p in model.parameters()),
    }
    facts["weights"] = "random (--llm_shape): speed figures only, no accuracy" if args.llm_shape else "the demo's"
    random, linear = "WEIGHTS DRAWN AT RANDOM, " if args.llm_shape else "", f"{facts['linear_params'] / 1e6:.1f}M"
    facts["model"] = (
        f"{random}{config.model_type}, {facts['total_params'] / 1e6:.1f}M parameters ({linear} in the layers' linear "
        f"maps, LM head {facts['head_params'] / 1e6:.1f}M)"
    )
    facts["classifier"] = (  # step 14's: the body, a new score head instead of the LM head
        f"{random}{config.model_type} as a classifier: its causal LM's body ({linear} in the layers' linear maps) "
        "and a new score head"
    )
    facts["summary"] = (
        f"{facts['model']}, {len(lengths)} records of {facts['mean_record_tokens']:.0f} tokens on average (longest "
        f"{facts['max_record_tokens']})"
    )
    return {
        "model_dir": model_dir,
        "gguf_dir": gguf_dir,
        "gguf_file": gguf_file,
        "train_file": str(files["train"]),
        "validation_file": str(files["validation"]),
        "facts": facts,
    }


def random_weights_llm(shape: Path, target: Path) -> str:
    """A model directory of the LLM whose config and tokenizer are in `shape`, with weights drawn at random
    (seed 0, the architecture's own initialization, float32 as the dequantized demo's): the real model's training
    speed and memory (the same shapes, the same kernels) in a call that cannot carry its weights; its generation
    runs every answer to its maximum length (no stop token is drawn), its accuracy means nothing."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if (target / "config.json").exists():
        return str(target)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(shape), dtype=torch.float32)
    staging = target.with_name(target.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    for path in shape.iterdir():
        if path.name != "config.json":
            shutil.copy2(path, staging / path.name)
    staging.rename(target)
    return str(target)


def helper_reload(args) -> dict:
    """Each saved model (args.rest, the keys of the answer) loads with from_pretrained (a causal LM, or a sequence
    classifier as its config names it), with every weight found, and computes finite logits; each one other than
    --reference gets the largest difference of its weights from it."""
    found = {}
    for directory in args.rest:  # one model that does not load leaves the others' answers (and its step's figures)
        try:
            found[directory] = reload_one(Path(directory), args.reference)
        except Exception as exc:
            problem = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            found[directory] = {"ok": False, "problem": problem, "summary": f"no: {problem}"}
    return found


def reload_one(directory: Path, reference: str | None) -> dict:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    architectures = AutoConfig.from_pretrained(directory).architectures or []
    classifier = any(name.endswith("ForSequenceClassification") for name in architectures)
    auto = AutoModelForSequenceClassification if classifier else AutoModelForCausalLM
    model, info = auto.from_pretrained(directory, output_loading_info=True)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    with torch.no_grad():
        finite = bool(torch.isfinite(model(**tokenizer("The review says", return_tensors="pt")).logits).all())
    problems = {
        k: list(v)[:5] for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")
    }
    problem = "; ".join(f"{k}: {v}" for k, v in problems.items()) or ("" if finite else "non-finite logits")
    result = {
        "ok": not problem,
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": str(next(model.parameters()).dtype),
        "files": sorted(p.name for p in directory.glob("*.safetensors")),
        "problem": problem,
    }
    if reference and Path(reference).resolve() != directory.resolve():
        mine, theirs = {}, {}
        for target, folder in ((mine, directory), (theirs, Path(reference))):
            for file in sorted(folder.glob("*.safetensors")):
                target.update(load_file(file))
        common = sorted(set(mine) & set(theirs))
        diffs = [float((mine[k].float() - theirs[k].float()).abs().max()) for k in common]
        result.update(max_abs_diff=max(diffs, default=None), tensors_compared=len(common))
    result["summary"] = (
        f"yes: {result['parameters'] / 1e6:.1f}M parameters, {result['dtype']}" if result["ok"] else f"no: {problem}"
    )
    return result


HELPERS = {"env": helper_env, "reload": helper_reload}
