"""A real tokenizer and chat template for the tiny models, trained here, no model hub.

    python -m scripts.dumps.tiny_tokenizer MODEL_DIR [--generation-markers]

A byte-level BPE (any UTF-8 text encodes, nothing is unknown) trained with the `tokenizers`
library on scripts/dumps/data/tokenizer_corpus.txt, its vocabulary within the tiny models'
1024 embeddings, and DeepSeek-V3's special tokens and role markers. Written as Hugging
Face files (tokenizer.json, tokenizer_config.json holding the chat template,
special_tokens_map.json) that AutoTokenizer loads as a PreTrainedTokenizerFast.

Two chat templates, the same text: DeepSeek-V3's shape (no `{% generation %}` markers: the
loss mask has to be found by rendering prefixes turn by turn), and the same with the
assistant's reply inside `{% generation %}` markers (transformers' assistant mask).
"""

import argparse
import json
import os
from pathlib import Path

from scripts.paths import REPO_ROOT

CORPUS = REPO_ROOT / "scripts" / "dumps" / "data" / "tokenizer_corpus.txt"
VOCAB_SIZE = 1024  # the tiny models' vocab_size
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SPECIAL_TOKENS = [BOS, EOS, USER, ASSISTANT]
FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _assistant_turn(generation_markers: bool) -> str:
    reply = "{{ message['content'] + '" + EOS + "' }}"
    if generation_markers:
        reply = "{% generation %}" + reply + "{% endgeneration %}"
    return "{{ '" + ASSISTANT + "' }}" + reply


def chat_template(generation_markers: bool) -> str:
    """DeepSeek-V3's role markers; other roles are refused by the template."""
    return (
        "{{ bos_token }}"
        "{% for message in messages %}"
        "{% if message['role'] == 'system' %}{{ message['content'] }}"
        "{% elif message['role'] == 'user' %}{{ '" + USER + "' + message['content'] }}"
        "{% elif message['role'] == 'assistant' %}" + _assistant_turn(generation_markers) +
        "{% else %}{{ raise_exception('no role ' + message['role'] + ' in this chat template') }}"
        "{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '" + ASSISTANT + "' }}{% endif %}"
    )


def train(texts=None, vocab_size: int = VOCAB_SIZE) -> "tokenizers.Tokenizer":
    """The BPE, trained on the corpus (or the strings `texts` yields); the same merges on every run."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    special = [AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    if texts is None:
        tokenizer.train([str(CORPUS)], trainer)
    else:
        tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def tokenizer_config(generation_markers: bool) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": EOS,
        "add_bos_token": False, "add_eos_token": False,
        "model_max_length": 16384,
        "clean_up_tokenization_spaces": False,
        "chat_template": chat_template(generation_markers),
    }


def _write_atomically(path: Path, text: str) -> None:
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temp.write_text(text, encoding="utf-8")
    os.replace(temp, path)


def write_tokenizer(model_dir: Path, generation_markers: bool = False, tokenizer=None) -> Path:
    """Write the tokenizer files (of `tokenizer`, default the tiny models' BPE) into `model_dir`
    (replacing any); the folder."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    _write_atomically(model_dir / "tokenizer.json", (tokenizer or train()).to_str(pretty=True))
    _write_atomically(model_dir / "tokenizer_config.json", json.dumps(tokenizer_config(generation_markers), indent=2))
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": EOS}
    _write_atomically(model_dir / "special_tokens_map.json", json.dumps(special, indent=2))
    return model_dir


def has_tokenizer(model_dir: Path) -> bool:
    return all((Path(model_dir) / name).exists() for name in FILES)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--generation-markers", action="store_true",
                        help="the chat template marks the assistant's reply with {%% generation %%}")
    args = parser.parse_args(argv)
    print(write_tokenizer(args.model_dir, args.generation_markers))


if __name__ == "__main__":
    main()
