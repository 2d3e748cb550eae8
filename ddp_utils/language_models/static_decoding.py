"""GRPO's sampling with its one-token steps compiled (`--compile_generation`): the samples' KV cache is a static
one, allocated once for the longest prompt and answer and kept across steps, so transformers' `generate` compiles
its decoding step once (torch.compile, mode "reduce-overhead") and on a GPU replays the model's forward pass as one
CUDA graph instead of launching each of its operators (about 2,700 a token for a 30-layer model); generate's own
few dozen operators a token (the mask, the sampling, the stop check) still launch one by one. Small models and short
answers spend a GRPO step launching kernels, not computing (bench/README.md, "The GPU check, session 2").

The prompts' pass is not compiled (its length changes every step): it runs as without the option, once per prompt,
into a dynamic cache that is then copied into the static one, each prompt's rows repeated for its samples. On a CPU
the same seeds draw the same samples either way (tests/test_grpo.py: dynamo traces the step, nothing is compiled);
on a GPU inductor's fused kernels, and attention over the static cache's full masked length, move the logits by
float rounding, which can flip a near-tie between two tokens.
"""

from __future__ import annotations

import functools

from accelerate import Accelerator
from accelerate.logging import get_logger

from ..core.errors import UsageError
from ..core.sharded import is_sharded
from ..training.compilation import COUNTS, compile_counts

logger = get_logger(__name__)


class StaticDecoding:
    """The static caches of a run's sampling, one per number of rows (a step's last, smaller batch has its own, and
    its own compiled graph; both stay allocated for the run), and the compile settings `generate` gets. Built once,
    before training, on every rank; refuses in one line what it cannot compile: sharded weights, layers other than
    attention, a sliding window shorter than a prompt. No communication."""

    def __init__(self, accelerator: Accelerator, model, max_prompt_length: int, max_completion_length: int):
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

        if is_sharded(accelerator):
            raise UsageError(
                "--compile_generation needs the whole model on every process (one GPU, or DDP); under FSDP or "
                "DeepSpeed leave it off"
            )
        config, layers = model.config, DynamicCache(config=model.config).layers
        for layer in layers:  # what the prompts' pass fills, layer by layer
            kind = type(layer)
            if kind not in (DynamicLayer, DynamicSlidingWindowLayer):
                raise UsageError(
                    f"--compile_generation copies attention caches, and {config.model_type} has {kind.__name__} "
                    "layers, which it cannot copy: leave it off for this model"
                )
            window = getattr(layer, "sliding_window", None)
            if kind is DynamicSlidingWindowLayer and window <= max_prompt_length:  # it keeps window - 1 tokens
                raise UsageError(
                    f"--compile_generation needs {config.model_type}'s sliding window ({window} tokens) to hold a "
                    f"whole prompt (--max_prompt_length {max_prompt_length}): lower it, or leave the option off"
                )
        # Full-length layers for sliding-window ones too: the model's mask applies the window over the whole cache.
        self.num_layers, self.max_length = len(layers), max_prompt_length + max_completion_length
        self.caches, self.before_first, self.reported = {}, None, False
        self.compile_config = compile_config(accelerator.device.type)

    def filled_from(self, prompts_cache, samples: int):
        """The static cache for `samples` rows per prompt of `prompts_cache` (the prompts' pass, one row each),
        reset and filled with each prompt's keys and values, repeated per sample, in place: its tensors stay where
        the compiled graph reads them."""
        from transformers.cache_utils import Cache

        rows = prompts_cache.layers[0].keys.shape[0] * samples
        if self.before_first is None:  # what was compiled before the first decoding (--torch_compile's, in tests)
            self.before_first = compile_counts()
        if rows not in self.caches:
            self.caches[rows] = Cache(layers=[static_layer_class()(self.max_length) for _ in range(self.num_layers)])
        cache = self.caches[rows]
        cache.reset()
        for index, layer in enumerate(prompts_cache.layers):
            cache.update(layer.keys.repeat_interleave(samples, 0), layer.values.repeat_interleave(samples, 0), index)
        return cache

    def warn_once(self) -> None:
        """After the first compiled decoding: a warning where it did not compile into one graph (no graph, a graph
        break, a CUDA graph skipped), which transformers and torch only log quietly. No communication."""
        if self.reported:
            return
        self.reported, now = True, compile_counts()
        graphs, breaks, left_eager, skips = (now.get(key, 0) - self.before_first.get(key, 0) for key in COUNTS)
        if graphs != 1 or breaks or left_eager or skips:
            logger.warning(
                f"--compile_generation: the decoding step compiled into {graphs} graph(s), with {breaks} graph "
                f"break(s), {left_eager} function(s) left uncompiled and {skips} CUDA graph(s) skipped: it gains "
                "less or nothing (TORCH_LOGS=graph_breaks,perf_hints says why)"
            )


@functools.cache
def static_layer_class():
    """transformers' StaticLayer, except that keys and values each keep the dtype the prompts' pass gave them, and
    what each new token adds is cast to it, as the dynamic cache's concatenation promotes it. Under autocast they can
    differ: a Gemma 3's prompts' pass gave fp32 values, its one-token steps bf16 ones (measured on a CPU), and
    transformers' layer holds keys and values in the first keys' dtype and refuses any other. A step wider than the
    prompts' pass (promotion the other way) is refused rather than rounded down."""
    import torch
    from transformers.cache_utils import StaticLayer

    class StaticLayerKeepingDtypes(StaticLayer):
        def lazy_initialization(self, key_states, value_states):
            super().lazy_initialization(key_states, value_states)
            if self.values.dtype != value_states.dtype:
                self.values = self.values.to(value_states.dtype)
                torch._dynamo.mark_static_address(self.values)  # where the compiled step reads and writes it

        def update(self, key_states, value_states, *args, **kwargs):
            if self.is_initialized:
                for new, held in ((key_states, self.keys), (value_states, self.values)):
                    if torch.promote_types(new.dtype, held.dtype) != held.dtype:
                        raise UsageError(
                            f"--compile_generation: a one-token step gave {new.dtype} where the prompts' pass gave "
                            f"{held.dtype}; leave the option off for this model and precision"
                        )
                key_states, value_states = key_states.to(self.keys.dtype), value_states.to(self.values.dtype)
            return super().update(key_states, value_states, *args, **kwargs)

    return StaticLayerKeepingDtypes


def compile_config(device_type: str):
    """How `generate` compiles its decoding step: with inductor into CUDA graphs ("reduce-overhead"), one graph per
    batch shape (not dynamic: a CUDA graph has fixed shapes). Graph breaks are allowed (a model whose code breaks the
    graph decodes in pieces, and `StaticDecoding.warn_once` says so). A CPU has no CUDA graphs to gain: there dynamo
    traces the same step without compiling it (its "eager" backend), in seconds where inductor's C++ build takes
    minutes, and transformers, which compiles on accelerators only, is told to."""
    from transformers import CompileConfig

    if device_type != "cpu":
        return CompileConfig(fullgraph=False, dynamic=False, mode="reduce-overhead")
    config = CompileConfig(fullgraph=False, dynamic=False, backend="eager", mode=None)
    config._compile_all_devices = True
    return config
