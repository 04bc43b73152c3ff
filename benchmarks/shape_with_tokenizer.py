"""A model folder of the Llama-3.1-8B shape that uses the shipped tokenizer (4,096 tokens), for benchmarks
that need text (prefix_cache.py builds its agent workload from source text) with --load-format dummy.

    python benchmarks/shape_with_tokenizer.py /tmp/llama8b-shape
"""
from __future__ import annotations

import json
import os
import shutil
import sys

from specserve.assets import SHIPPED_TARGET


def main() -> None:
    dst = sys.argv[1] if len(sys.argv) > 1 else "/tmp/llama8b-shape"
    os.makedirs(dst, exist_ok=True)
    config = json.load(open(os.path.join(SHIPPED_TARGET, "config.json")))
    config.update(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=128, max_position_embeddings=8192, tie_word_embeddings=False)
    json.dump(config, open(os.path.join(dst, "config.json"), "w"), indent=1)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(SHIPPED_TARGET, name), dst)
    print(dst)


if __name__ == "__main__":
    main()
