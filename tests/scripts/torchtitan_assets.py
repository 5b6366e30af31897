"""Make the files torchtitan's llama3 debug config reads from its repository's
``tests/assets`` (the wheel has none): a small BPE tokenizer trained here with the
``tokenizers`` library and a local text dataset in ``c4_test``'s shape (JSON lines with a
``text`` field). Nothing is downloaded.

    python tests/scripts/torchtitan_assets.py DIR   # DIR/tokenizer, DIR/c4_test
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

WORDS = [
    "the",
    "a",
    "checkpoint",
    "model",
    "training",
    "step",
    "shard",
    "rank",
    "weight",
    "optimizer",
    "moment",
    "data",
    "loader",
    "store",
    "chunk",
    "hash",
    "commit",
    "resume",
    "verify",
    "gradient",
    "batch",
    "token",
    "layer",
    "attention",
    "norm",
    "learning",
    "rate",
    "schedule",
    "warmup",
    "decay",
    "epoch",
    "sample",
    "sequence",
    "vocabulary",
    "parallel",
    "fully",
    "sharded",
    "tensor",
    "device",
    "memory",
    "disk",
    "write",
    "read",
    "object",
    "manifest",
    "run",
    "keep",
]


def _documents(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        sentences = []
        for _ in range(rng.randint(3, 8)):
            words = [rng.choice(WORDS) for _ in range(rng.randint(5, 14))]
            sentences.append(" ".join(words).capitalize() + ".")
        docs.append(" ".join(sentences))
    return docs


def make_assets(root: Path) -> None:
    """Write ``root/tokenizer`` and ``root/c4_test``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    docs = _documents(400)
    data = root / "c4_test"
    data.mkdir(parents=True, exist_ok=True)
    with open(data / "train.jsonl", "w") as f:  # the file name gives the split
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|begin_of_text|>", "<|end_of_text|>", "<unk>"]
    trainer = trainers.BpeTrainer(
        vocab_size=512,  # < the debug model's 2048 embeddings
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(docs, trainer)
    out = root / "tokenizer"
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": special[0],
                "eos_token": special[1],
                "add_bos_token": True,
                "add_eos_token": True,
            }
        )
    )


if __name__ == "__main__":
    make_assets(Path(sys.argv[1]))
