"""GRPO's sampling with its one-token steps compiled (`--compile_generation`): the samples' KV cache is a static
one, allocated once for the longest prompt and answer and kept across steps, so transformers' `generate` compiles
its decoding step once (torch.compile, mode "reduce-overhead") and on a GPU replays it as a CUDA graph: a launch or
so per new token instead of one per operator (about 2,700 for a 30-layer model). Small models and short answers
spend a GRPO step launching kernels, not computing (bench/README.md, "The GPU check, session 2").

The prompts' pass is not compiled (its length changes every step): it runs as without the option, once per prompt,
into a dynamic cache that is then copied into the static one, each prompt's rows repeated for its samples. The
same seeds draw the same samples either way (tests/test_grpo.py); only the attention's sums run over the static
cache's full length, masked, which moves logits by float rounding.
"""

from __future__ import annotations

import functools

from accelerate import Accelerator

from ..core.errors import UsageError
from ..core.sharded import is_sharded


class StaticDecoding:
    """The static caches of a run's sampling, one per number of rows (a step's last, smaller batch has its own, and
    its own compiled graph), and the compile settings `generate` gets. Built once, before training, on every rank;
    refuses in one line what it cannot compile: sharded weights, and layers that are not attention, or whose sliding
    window is shorter than a prompt and its answer. No communication."""

    def __init__(self, accelerator: Accelerator, model, max_length: int):
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
                    "layers (recurrent or linear attention): leave it off for this model"
                )
            window = getattr(layer, "sliding_window", None)
            if kind is DynamicSlidingWindowLayer and window <= max_length:  # it would keep only the window's end
                raise UsageError(
                    f"--compile_generation needs {config.model_type}'s sliding window ({window} tokens) to hold a "
                    f"whole prompt and answer ({max_length}): lower --max_prompt_length or --max_completion_length, "
                    "or leave it off"
                )
        self.layers, self.max_length, self.caches = len(layers), max_length, {}
        self.compile_config = compile_config(accelerator.device.type)

    def filled_from(self, prompts_cache, samples: int):
        """The static cache for `samples` rows per prompt of `prompts_cache` (the prompts' pass, one row each),
        reset and filled with each prompt's keys and values, repeated per sample, in place: its tensors stay where
        the compiled graph reads them."""
        from transformers.cache_utils import Cache

        rows = prompts_cache.layers[0].keys.shape[0] * samples
        if rows not in self.caches:
            # Full-length layers for sliding-window layers too: each window holds a whole prompt and answer (checked
            # above), so attending to the whole cache is what the window lets them see.
            self.caches[rows] = Cache(layers=[static_layer(self.max_length) for _ in range(self.layers)])
        cache = self.caches[rows]
        cache.reset()
        for index, layer in enumerate(prompts_cache.layers):
            cache.update(layer.keys.repeat_interleave(samples, 0), layer.values.repeat_interleave(samples, 0), index)
        return cache


def static_layer(max_length: int):
    """A static cache layer of `max_length` positions (`StaticLayer` with dtypes kept; see `layer_class`)."""
    return layer_class()(max_length)


@functools.cache
def layer_class():
    """transformers' StaticLayer, except that keys and values each keep the dtype the prompts' pass gave them, and
    what each new token adds is cast to it, as the dynamic cache's concatenation promotes it. Under autocast they can
    differ: a Gemma 3's prompts' pass gave fp32 values, its one-token steps bf16 ones (measured on a CPU), and
    transformers' layer holds keys and values in the first keys' dtype and refuses any other."""
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
                key_states, value_states = key_states.to(self.keys.dtype), value_states.to(self.values.dtype)
            return super().update(key_states, value_states, *args, **kwargs)

    return StaticLayerKeepingDtypes


def compile_config(device_type: str):
    """How `generate` compiles its decoding step: with inductor into CUDA graphs ("reduce-overhead"), one graph per
    batch shape (not dynamic: a CUDA graph has fixed shapes). A CPU has no CUDA graphs to gain: there dynamo traces
    the same step without compiling it (its "eager" backend), in seconds where inductor's C++ build takes minutes."""
    from transformers import CompileConfig

    if device_type == "cpu":
        config = CompileConfig(fullgraph=False, dynamic=False, backend="eager", mode=None)
    else:
        config = CompileConfig(fullgraph=False, dynamic=False, mode="reduce-overhead")
    config._compile_all_devices = True  # transformers compiles on GPUs only, unless told
    return config
