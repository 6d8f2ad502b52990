"""A character-level tokenizer built locally (nothing downloaded), loadable as a fast HF tokenizer."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]


def build_char_tokenizer(alphabet: str, chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """One token per character of ``alphabet`` plus pad/bos/eos/unk; BOS is prepended on encode.

    ``chat_template`` (Jinja) lets the inference server answer chat requests, which agent
    workflows send; without one the server only serves ``/v1/completions``.

    Save it with ``save_pretrained`` and load it back with ``PreTrainedTokenizerFast.from_pretrained``
    (``AutoTokenizer`` on some model types picks a slow tokenizer class that drops spaces).
    """
    chars = list(dict.fromkeys(alphabet))  # unique, in order
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    if chat_template:
        tokenizer.chat_template = chat_template
    return tokenizer
