"""A tiny Llama model folder that vLLM can serve with random weights.

No weights can be downloaded here, so the folder holds only ``config.json``:
vLLM's ``--load-format dummy`` fills the weights randomly, and
``--skip-tokenizer-init`` lets it run without tokenizer files (prompts are
sent as token-id lists). Output quality is irrelevant to the end-to-end
checks; only the KV cache and its events matter.

For text prompts the folder also holds a word-level tokenizer (``tokenizer.json``): token id
``i`` (3 to the vocabulary's end) is the word ``t<i>``, 0-2 are ``<unk>``, ``<s>`` and
``</s>``, and nothing is added around a prompt, so ``text_of(ids)`` tokenizes back to
exactly ``ids`` in vLLM and in its ``/tokenize``. Engines load it unless started with
``--skip-tokenizer-init``.
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB_SIZE = 32000

LLAMA_CONFIG: dict[str, object] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 2048,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}


SPECIAL = ("<unk>", "<s>", "</s>")


def text_of(token_ids: list[int]) -> str:
    """The text that the folder's tokenizer turns into exactly ``token_ids`` (ids 3 and up)."""
    return " ".join(f"t{i}" for i in token_ids)


def tokenizer_json() -> dict[str, object]:
    """A Hugging Face ``tokenizer.json``: one word per token, split on whitespace."""
    vocab = {word: i for i, word in enumerate(SPECIAL)}
    vocab.update({f"t{i}": i for i in range(len(SPECIAL), VOCAB_SIZE)})
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": word, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}
                         for i, word in enumerate(SPECIAL)],
        "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }


def write_model_dir(path: Path) -> Path:
    """Write (or rewrite) the model folder at ``path`` and return it."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(LLAMA_CONFIG, indent=2) + "\n")
    (path / "tokenizer.json").write_text(json.dumps(tokenizer_json()) + "\n")
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>",
        "bos_token": "<s>", "eos_token": "</s>", "model_max_length": 2048,
        "clean_up_tokenization_spaces": False}, indent=2) + "\n")
    return path
