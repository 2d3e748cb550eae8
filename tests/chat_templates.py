"""The chat templates of the families users fine-tune, written for the tests in the shape their
tokenizer files carry them (tokenizer_config.json's `chat_template`), with the special tokens and
the EOS each ships, on a word-level vocabulary: built offline, no Hub.

What each family does that the scripts must handle:

- llama3 (Llama 3.x instruct): a system block always, turns end with <|eot_id|>, EOS <|eot_id|>;
  llama3-base: the same template, EOS <|end_of_text|> (answers never stopped); tools as Llama 3.1 shows them: in
  the first user turn, a call as {"name", "parameters"}, one a turn, every result quoted as JSON text;
- qwen2.5 (instruct) and qwen2.5-base: ChatML with a default system turn, <|im_end|>; the base EOS is
  <|endoftext|>; tools in the system turn, calls in <tool_call> tags, results as a user turn;
- qwen3: ChatML, a <think> block on answers after the last user turn, dropped from earlier answers,
  and an empty one in the generation prompt with enable_thinking=false;
- mistral (v0.3): [INST] ... [/INST] answer</s>, the system text in the LAST user turn only;
- gemma2: refuses a system turn; gemma3: folds it into the first user turn; <end_of_turn>, EOS <eos>;
- phi3: <|system|>/<|user|>/<|assistant|> ... <|end|>, and EOS after the whole conversation;
- chatml: plain ChatML, <|im_end|> as EOS.
"""

from __future__ import annotations

from pathlib import Path

LLAMA3 = (  # with Llama 3.1's tool support: the tools in the first user turn, one call a turn, results JSON-quoted
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}"
    "{%- if tools %}{{- 'Environment: ipython\n' }}{%- endif %}"
    "{{- 'Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n' }}"
    "{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- if tools %}{%- set first_user = messages[0]['content'] | trim %}{%- set messages = messages[1:] %}"
    "{{- '<|start_header_id|>user<|end_header_id|>\n\nCall one of these functions with JSON when it helps.\n\n' }}"
    "{%- for tool in tools %}{{- tool | tojson(indent=4) + '\n\n' }}{%- endfor %}"
    "{{- first_user + '<|eot_id|>' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + message.content | tojson + '<|eot_id|>' }}"
    "{%- elif 'tool_calls' in message %}"
    "{%- if message.tool_calls | length != 1 %}{{- raise_exception('only one tool call at a time') }}{%- endif %}"
    "{%- set call = message.tool_calls[0].function %}"
    '{{- \'<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "\' + call.name + \'", "parameters": \''
    " + call.arguments | tojson + '}<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{{- message['content'] | trim + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)
QWEN25 = (  # with its tool support: the tools in the system turn, calls in <tool_call> tags, results as a user turn
    "{%- set default_system = 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' %}"
    "{%- if tools %}{{- '<|im_start|>system\n' }}"
    "{{- messages[0]['content'] if messages[0]['role'] == 'system' else default_system }}"
    "{{- '\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n'"
    " + 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' + tool | tojson }}{%- endfor %}"
    "{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within '"
    ' + \'<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": \''
    " + '<args-json-object>}\n</tool_call><|im_end|>\n' }}"
    "{%- elif messages[0]['role'] != 'system' %}{{- '<|im_start|>system\n' + default_system + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not (loop.first and tools))"
    " or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\n' + message.content }}{%- endif %}"
    "{%- for call in message.tool_calls %}{%- if call.function is defined %}{%- set call = call.function %}{%- endif %}"
    '{{- \'\n<tool_call>\n{"name": "\' + call.name + \'", "arguments": \' + call.arguments | tojson'
    " + '}\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
QWEN3 = (
    "{%- set ns = namespace(last_query_index=messages|length - 1, found=false) %}"
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if not ns.found and message.role == 'user' %}{%- set ns.found = true %}{%- set ns.last_query_index = index %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or message.role == 'system' %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set content = message.content %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index %}"
    "{{- '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}"
    "{%- else %}{{- '<|im_start|>assistant\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{%- endif %}"
)
MISTRAL_V03 = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}"
    "{%- for message in loop_messages %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if loop.last and system_message is defined %}"
    "{{- '[INST] ' + system_message + '\n\n' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + eos_token }}"
    "{%- endif %}{%- endfor %}"
)
GEMMA2 = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
GEMMA3 = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set first_user_prefix = messages[0]['content'] + '\n\n' %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set first_user_prefix = '' %}"
    "{%- set loop_messages = messages %}{%- endif %}"
    "{%- for message in loop_messages %}{%- if message['role'] == 'assistant' %}{%- set role = 'model' %}"
    "{%- else %}{%- set role = message['role'] %}{%- endif %}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{%- endif %}"
)
PHI3 = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '<|system|>\n' + message['content'] + '<|end|>\n' }}"
    "{% elif message['role'] == 'user' %}{{ '<|user|>\n' + message['content'] + '<|end|>\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

QWEN_TOOL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]  # added, not special
# family: (template, special tokens, bos, eos, end of turn, non-special added tokens)
FAMILIES = {
    "llama3": (LLAMA3, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                        "<|end_of_text|>"], "<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>", []),
    "llama3-base": (LLAMA3, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                             "<|end_of_text|>"], "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", []),
    "qwen2.5": (QWEN25, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"], None, "<|im_end|>", "<|im_end|>",
                QWEN_TOOL_TAGS),
    "qwen2.5-base": (QWEN25, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"], None, "<|endoftext|>", "<|im_end|>", []),
    "qwen3": (QWEN3, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"], None, "<|im_end|>", "<|im_end|>",
              ["<think>", "</think>"]),
    "mistral-v0.3": (MISTRAL_V03, ["<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>", "</s>", []),
    "gemma2": (GEMMA2, ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>", "<end_of_turn>", []),
    "gemma3": (GEMMA3, ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>", "<end_of_turn>", []),
    "phi3": (PHI3, ["<s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"], "<s>",
             "<|endoftext|>", "<|end|>", []),
    "chatml": (CHATML, ["<|im_start|>", "<|im_end|>"], None, "<|im_end|>", "<|im_end|>", []),
}  # fmt: skip

WORDS = (
    "system user assistant model you are a helpful review says is the answer positive negative neutral "
    "good bad film was it movie be brief reply with one word what do think of this hmm fine great"
).split()


def make_family_tokenizer(family: str, directory: Path):
    """A word-level fast tokenizer with `family`'s special tokens, BOS, EOS and chat template, saved
    to `directory` as its tokenizer files carry them. Returns the loaded tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    template, special, bos, eos, _, added = FAMILIES[family]
    vocabulary = ["<unk>", *special, *added, *WORDS]
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocabulary)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token=bos, eos_token=eos, model_max_length=256,
        additional_special_tokens=[t for t in special if t not in (bos, eos)],
    )  # fmt: skip
    tokenizer.add_tokens(added)  # Qwen3's <think> tags: added, not special (decoded with the answer)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(directory)
    return AutoTokenizer.from_pretrained(directory)


def make_family_model(family: str, directory: Path):
    """`family`'s tokenizer and a 2-layer Llama of its vocabulary, saved to `directory`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = make_family_tokenizer(family, directory)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory
