"""The ChatML model fixture is what the tests claim: a tied GQA Qwen2 that the HF Auto classes load."""

from __future__ import annotations

from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast


def test_chatml_model_dir_loads_as_a_tied_gqa_qwen2_with_its_chat_template(chatml_model_dir: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(chatml_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(chatml_model_dir)
    assert model.config.model_type == "qwen2"
    assert model.config.tie_word_embeddings is True
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    messages = [{"role": "user", "content": "what is 3 + 4?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nwhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text  # byte-level BPE round-trips, special tokens are single ids
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert len(tokenizer("what is 12 + 7?")["input_ids"]) < len("what is 12 + 7?")  # merges were learnt
    # the tokenizer.json alone (what vLLM and the tokenizers library read) encodes as AutoTokenizer does
    raw = PreTrainedTokenizerFast(tokenizer_file=f"{chatml_model_dir}/tokenizer.json")
    for probe in ("Let's think: 13 + 4 = 17.", "  spaced \n\n out", text):
        assert raw(probe)["input_ids"] == tokenizer(probe)["input_ids"], probe


def test_the_local_engine_stops_at_every_eos_of_the_generation_config(chatml_model_dir: str) -> None:
    """An instruct model ends a turn with <|im_end|> and may end text with <|endoftext|>: both stop."""
    from nexrl_hpc.models.tiny import load_tokenizer, stop_token_ids

    tokenizer = load_tokenizer(chatml_model_dir)
    ids = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    assert stop_token_ids(chatml_model_dir, tokenizer) == tuple(ids)
