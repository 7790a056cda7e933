"""A tiny trained tokenizer for synthetic models (benchmarks and tests)."""

from __future__ import annotations

import json
from pathlib import Path

TEXT = (
    "def add(a, b):\n    return a + b\n\nclass Stack:\n    def push(self, x):\n"
    "        self.items.append(x)\n\nimport os\nprint('hello world')\n"
) * 20


def write_tokenizer(path: Path) -> None:
    """A small byte-level BPE tokenizer with a chat template, into `path`."""
    # tokenizers comes with mlx-lm (through transformers); only models need it
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TEXT], trainer)
    tok.save(str(path / "tokenizer.json"))
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>"
        "assistant\n{% endif %}"
    )
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "chat_template": template,
            }
        )
    )
