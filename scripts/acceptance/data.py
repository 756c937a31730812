"""What the acceptance pipeline sends: plain text records of the corpus' training split for the
dump (what `generate` takes, every token in the loss), and held-out prompts from the `prompts`
split, which no record and no training batch of the target ever held.

Both are cut at line ends by the target's own tokenizer and chosen in a fixed order (the
sha256 of each file's path), so every machine and every run sends the same tokens.
"""

import hashlib
import json
from pathlib import Path
from typing import Iterator, List

from scripts.acceptance import corpus


def _by_hash(files: List[corpus.SourceFile]) -> List[corpus.SourceFile]:
    return sorted(files, key=lambda f: hashlib.sha256(f"{f.package}/{f.path}".encode()).hexdigest())


def _pieces(tokenizer, text: str, max_tokens: int) -> Iterator[str]:
    """The text in consecutive runs of whole lines of at most `max_tokens` tokens each (a
    longer line is cut by tokens)."""
    lines = text.splitlines(keepends=True)
    counts = [len(encoding.ids) for encoding in tokenizer.encode_batch(lines, add_special_tokens=False)] if lines else []
    piece, size = [], 0
    for line, count in zip(lines, counts):
        if size + count > max_tokens and piece:
            yield "".join(piece)
            piece, size = [], 0
        if count > max_tokens:
            ids = tokenizer.encode(line, add_special_tokens=False).ids
            for start in range(0, len(ids), max_tokens):
                yield tokenizer.decode(ids[start:start + max_tokens])
            continue
        piece.append(line)
        size += count
    if piece and "".join(piece).strip():
        yield "".join(piece)


def write_train_records(tokenizer, path: Path, total_tokens: int, max_tokens: int = 1024) -> dict:
    """JSON Lines of {"id", "text"} from the training split, about `total_tokens` tokens."""
    written, tokens = 0, 0
    with open(path, "w", encoding="utf-8") as out:
        for f in _by_hash(corpus.split("train")):
            for n, piece in enumerate(_pieces(tokenizer, f.text, max_tokens)):
                count = len(tokenizer.encode(piece, add_special_tokens=False).ids)
                if count < 16:
                    continue
                out.write(json.dumps({"id": f"{f.path}#{n}", "text": piece}) + "\n")
                written += 1
                tokens += count
            if tokens >= total_tokens:
                return {"records": written, "tokens": tokens, "max_tokens": max_tokens}
    return {"records": written, "tokens": tokens, "max_tokens": max_tokens}


def held_out_prompts(tokenizer, count: int, prompt_tokens: int) -> List[dict]:
    """`count` prompts of `prompt_tokens` tokens from the `prompts` split: each starts at the
    first line end past a quarter, a half or three quarters of its file (past the license
    header), files taken in turn."""
    files = _by_hash(corpus.split("prompts"))
    prompts = []
    for numerator, denominator in ((1, 2), (1, 4), (3, 4)):
        for f in files:
            start = f.text.find("\n", len(f.text) * numerator // denominator) + 1
            ids = tokenizer.encode(f.text[start:], add_special_tokens=False).ids
            if start <= 0 or len(ids) < prompt_tokens:
                continue
            prompts.append({"id": f"{f.path}@{start}", "input_ids": ids[:prompt_tokens]})
            if len(prompts) == count:
                return prompts
    return prompts
