"""A small Qwen2-architecture model directory with a byte-level BPE tokenizer and a ChatML template.

What a researcher brings (Qwen2.5-Instruct and relatives), built offline: the tokenizer is
trained here with ``tokenizers`` on the given texts, the model is random-initialised from a
``Qwen2Config`` (grouped-query attention, tied embeddings by default), and the directory is
written with ``save_pretrained`` so ``AutoModelForCausalLM``/``AutoTokenizer`` load it like any
downloaded checkpoint. Tests use it as the "user's model"; a shipped task can warm it up.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# how Qwen2/2.5 split text before BPE (words with their leading space, single digits, punctuation)
QWEN2_SPLIT_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

# Qwen2.5's ChatML form, without its default system prompt and tool blocks
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE (GPT-2/Qwen style) trained on ``texts``, with ChatML's special tokens.

    The training is deterministic: the same texts give the same vocabulary and merges, so every
    process that needs the run's tokenizer can train it again (nexrl_hpc.models.run_tokenizer)."""
    tok = Tokenizer(models.BPE())
    # Qwen2's own pipeline (NFC, its split regex: digits one by one, then bytes): AutoTokenizer
    # loads a qwen2 directory as Qwen2Tokenizer, which rebuilds exactly this pipeline around the
    # saved vocabulary and merges, so it encodes as the tokenizer saved here does
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD_TOKEN, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    return tok


def chatml_tokenizer(core: Tokenizer, chat_template: str = CHATML_TEMPLATE) -> PreTrainedTokenizerFast:
    """``core`` (from ``train_bpe``) as an HF fast tokenizer: EOS ``<|im_end|>``, pad ``<|endoftext|>``."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START],
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def train_chatml_tokenizer(texts: Iterable[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on ``texts``, with ChatML special tokens and template."""
    return chatml_tokenizer(train_bpe(texts, vocab_size))


def build_qwen2_model(
    tokenizer: PreTrainedTokenizerFast,
    hidden_size: int = 128,
    intermediate_size: int = 256,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = True,
    seed: int = 0,
    model_vocab_size: int | None = None,
) -> Qwen2ForCausalLM:
    """A random-init Qwen2 causal LM sized to ``tokenizer`` (GQA when kv heads < heads).

    head_dim is hidden_size / num_attention_heads: vLLM's CPU attention needs at least 32.
    ``model_vocab_size``: the embedding's rows when more than the tokenizer's ids, padded as every
    Qwen model is (151,936 rows for ~151,665 tokens); the ids past the tokenizer have no token."""
    vocab_size = len(tokenizer) if model_vocab_size is None else model_vocab_size
    if vocab_size < len(tokenizer):
        raise ValueError(f"model_vocab_size={vocab_size} is below the tokenizer's {len(tokenizer)} ids")
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attention_dropout=0.0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    return model.float()


def save_model_dir(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, out_dir: str) -> str:
    """Write an HF directory: safetensors, config, tokenizer files with the chat template, generation config."""
    os.makedirs(out_dir, exist_ok=True)
    eos = [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(PAD_TOKEN)]
    model.generation_config = GenerationConfig(
        eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, do_sample=True, temperature=1.0
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def build_chatml_model_dir(
    out_dir: str, texts: Iterable[str], vocab_size: int = 512, **model_kwargs: int | bool
) -> str:
    """Train the tokenizer on ``texts``, build the model and save both to ``out_dir``; returns ``out_dir``."""
    tokenizer = train_chatml_tokenizer(texts, vocab_size)
    model = build_qwen2_model(tokenizer, **model_kwargs)  # type: ignore[arg-type]
    return save_model_dir(model, tokenizer, out_dir)
