"""A tiny Llama model folder that vLLM can serve with random weights.

No weights can be downloaded here, so the folder holds only ``config.json``:
vLLM's ``--load-format dummy`` fills the weights randomly, and
``--skip-tokenizer-init`` lets it run without tokenizer files (prompts are
sent as token-id lists). Output quality is irrelevant to the end-to-end
checks; only the KV cache and its events matter.
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


def write_model_dir(path: Path) -> Path:
    """Write (or rewrite) the model folder at ``path`` and return it."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(LLAMA_CONFIG, indent=2) + "\n")
    return path
