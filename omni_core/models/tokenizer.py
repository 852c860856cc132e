"""A small byte-level BPE tokenizer for the seeded language-model checkpoints.

Byte-level so that any text encodes (no unknown token) and decoding round-trips; the
merges are learned from a fixed corpus so the files are the same at every run. Saved
through transformers so `AutoTokenizer.from_pretrained(dir, local_files_only=True)` loads it
like any hub tokenizer.
"""

from __future__ import annotations

from pathlib import Path

# Fixed training text: what the tokenizer learns merges from. Changing it changes every
# checkpoint's tokenizer.json, so it is data, not an example.
CORPUS = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
    "A model stage that is idle goes to sleep so that another stage can use the memory; "
    "when a request arrives, it wakes again and its weights come back from the host.",
    "Level one offloads the weights and discards the caches. Level two discards everything, "
    "and the weights are reloaded from the checkpoint before the stage serves again.",
    "Every command is answered by exactly one acknowledgement or refusal per rank.",
    "0 1 2 3 4 5 6 7 8 9 10 100 1000 + - * / = ( ) [ ] { } < > , . ; : ! ? ' \" # @ %",
    "def main():\n    return 0\n\nif __name__ == '__main__':\n    main()\n",
)


def special_tokens(family: str) -> dict[str, str]:
    """The role -> text of each special token; they take the first ids, in this order."""
    if family == "llama":
        return {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    return {"eos_token": "<|endoftext|>"}


def write_tokenizer(directory: Path, family: str, vocab_size: int | None) -> dict[str, int]:
    """Train, pad to `vocab_size` (None: as trained) and save; returns the special ids by role."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = special_tokens(family)
    texts = list(dict.fromkeys(specials.values()))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size or 1024,
        special_tokens=texts,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    if vocab_size is not None:
        trained = tokenizer.get_vocab_size()
        if trained > vocab_size:
            raise ValueError(f"the trained tokenizer has {trained} tokens, more than the model's vocab {vocab_size}")
        # Reserved tokens fill the rest, so every id the model can emit decodes to something.
        tokenizer.add_special_tokens([f"<|reserved_{i}|>" for i in range(vocab_size - trained)])
    # Padding (batched prompts) reuses the end-of-text token, as Qwen2 and Llama 3 do.
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=specials["eos_token"], **specials)
    wrapped.save_pretrained(str(directory))
    ids: dict[str, int] = {}
    for role, text in specials.items():
        token_id = tokenizer.token_to_id(text)
        if token_id is None:  # trained as a special token above: the tokenizers library lost it
            raise RuntimeError(f"the trained tokenizer has no id for its special token {text!r}; report this")
        ids[role] = token_id
    return ids


def write_clip_tokenizer(directory: Path) -> int:
    """A CLIPTokenizer without merges: every byte is a token, alone or word-final, so any
    text encodes. Returns its vocabulary size."""
    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = ["<|startoftext|>", "<|endoftext|>", *alphabet, *(f"{c}</w>" for c in alphabet)]
    tokenizer = CLIPTokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=[], model_max_length=77)
    tokenizer.save_pretrained(str(directory))
    return len(tokens)
