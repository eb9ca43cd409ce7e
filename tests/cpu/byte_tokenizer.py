"""A byte-level BPE tokenizer with a chat template and an EOS, written into a model folder in well under a second
(no hub downloads here), so that tests can serve the folders they write as ``piecegraph serve DIR`` would."""

from __future__ import annotations

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_byte_tokenizer(path) -> int:
    """Save the tokenizer into ``path``; returns its vocabulary size (256 bytes and 3 specials). The EOS,
    ``<|im_end|>``, is the last id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab.update({s: len(vocab) + i for i, s in enumerate(specials)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", chat_template=TEMPLATE,
                            additional_special_tokens=specials).save_pretrained(path)
    return len(vocab)
