"""The oracle's row placement on its own, with forward records written here: every row's
value is a function of the prompt tokens up to it (as in a causal model), so a prompt's
assembled streams are known exactly. The layout is the one a shared-prefix workload
produced under chunked prefill: two requests split inside the shared prefix, one chunk
of each holding prefix tokens only."""

import random

import torch

from tests.server import oracle_hooks

HIDDEN = 4
STREAMS = ["0", "1", "last"]


def row_value(tokens):
    generator = torch.Generator().manual_seed(hash(tuple(tokens)) % (2 ** 31))
    return torch.randn(len(STREAMS), HIDDEN, generator=generator)


def write_forward(out_dir, index, chunks):
    """chunks: (prompt, first position, last position + 1), in batch order."""
    positions = [p for _, start, stop in chunks for p in range(start, stop)]
    ids = [prompt[p] for prompt, start, stop in chunks for p in range(start, stop)]
    values = torch.stack([row_value(prompt[:p + 1]) for prompt, start, stop in chunks for p in range(start, stop)])
    record = {"input_ids": torch.tensor(ids), "positions": torch.tensor(positions)}
    record.update({name: values[:, i] for i, name in enumerate(STREAMS)})
    torch.save(record, out_dir / f"forward.{index:05d}.pt")


def expected_streams(prompt):
    values = torch.stack([row_value(prompt[:p + 1]) for p in range(len(prompt))])
    return {name: values[:, i] for i, name in enumerate(STREAMS)}


def test_chunks_inside_a_shared_prefix(tmp_path):
    rng = random.Random(0)
    prefix = [rng.randrange(10, 1000) for _ in range(300)]
    prompts = {f"p{i}": prefix + [1000 + i] + [rng.randrange(10, 1000) for _ in range(rng.randint(0, 40))]
               for i in range(6)}
    p = prompts
    # p2 is split at 116 and p4 at 297: both first chunks lie inside the prefix, and p4's
    # prefix chunk is longer than p2's second chunk.
    write_forward(tmp_path, 0, [(p["p0"], 0, len(p["p0"])), (p["p1"], 0, len(p["p1"])), (p["p2"], 0, 116)])
    write_forward(tmp_path, 1, [(p["p2"], 116, len(p["p2"])), (p["p3"], 0, len(p["p3"])), (p["p4"], 0, 297)])
    write_forward(tmp_path, 2, [(p["p4"], 297, len(p["p4"])), (p["p5"], 0, len(p["p5"]))])

    streams, forwards = oracle_hooks.request_rows(tmp_path, prompts)

    for key, prompt in prompts.items():
        for name, value in expected_streams(prompt).items():
            assert torch.equal(streams[key][name], value), (key, name)
    assert [f.prompts for f in forwards] == [{"p0", "p1", "p2"}, {"p2", "p3", "p4"}, {"p4", "p5"}]
    assert all(f.other_rows == 0 for f in forwards)


def test_rows_no_prompt_explains_are_counted(tmp_path):
    prompt = list(range(10, 60))
    stranger = list(range(500, 520))
    write_forward(tmp_path, 0, [(prompt, 0, len(prompt)), (stranger, 0, len(stranger))])

    streams, forwards = oracle_hooks.request_rows(tmp_path, {"mine": prompt})

    assert torch.equal(streams["mine"]["last"], expected_streams(prompt)["last"])
    assert forwards[0].prompt_rows == len(prompt) and forwards[0].other_rows == len(stranger)
