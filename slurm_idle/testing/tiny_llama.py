"""Write a tiny Llama model dir (config + tokenizer, no weights) for a real vLLM on CPU.

Run with the vLLM venv's python, by path (`python tiny_llama.py DIR`): it needs transformers
and tokenizers, which the product's own environment does not have, and imports nothing of
slurm_idle. No download: the config is made here and vLLM serves it with
`--load-format dummy` (random weights), so the text is noise but the server, its scheduler,
KV cache and metrics are the real ones.

Sizes: head size 64 (hidden 256 / 4 heads), because vLLM's CPU attention backend refuses
head size 16; 2 layers keep a 16-token completion around 0.15 s on a busy core.
"""

from __future__ import annotations

import sys
from pathlib import Path

#: Words of the tokenizer: special tokens, then w0..w(N-1). Its size is the model's vocab.
SPECIAL = ("<unk>", "<s>", "</s>")
WORDS = 509  # 512 tokens in all


def vocabulary() -> dict[str, int]:
    words = [*SPECIAL, *(f"w{i}" for i in range(WORDS))]
    return {w: i for i, w in enumerate(words)}


def write_model(out: Path) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    vocab = vocabulary()
    out.mkdir(parents=True, exist_ok=True)
    LlamaConfig(
        vocab_size=len(vocab), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048,
        bos_token_id=vocab["<s>"], eos_token_id=vocab["</s>"],
    ).save_pretrained(out)
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        model_max_length=2048,
    ).save_pretrained(out)


if __name__ == "__main__":
    write_model(Path(sys.argv[1]))
