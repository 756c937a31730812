"""The independent oracle: torch forward hooks that SGLang attaches with --forward-hooks.

They record, on every forward, SGLang's own values at the points the dump captures, by a
different path than the patched capture code:
- `model.embed_tokens`: the embedding output (the stream entering layer 0), and its input,
  the forward's token ids;
- `model.layers.{i}`: returns (hidden_states, residual), whose sum is the residual stream
  entering layer i+1 (SGLang defers the residual add into the next layer's norm); its first
  input is the forward's positions;
- `model.norm`: the final normed hidden state the LM head reads;
- `model.layers.{i}.mlp.topk` (when asked): the experts each row took in MoE layer i.
Those are DeepseekV3ForCausalLM's names; a model that wraps it names its decoder by another
path (Kimi-K2.5: `language_model.model`).

The hooks of one forward fill one record (embed_tokens runs first, model.norm last), which
the norm hook saves as `forward.<n>.pt`: {"input_ids", "positions", "0".."L", "last"}, one
row per token of the forward. Decode-only forwards are saved only when the hooks are asked
to (`decode`: a test of dumped answers); otherwise the files stay bounded by the prompt
tokens served.

Readers place a request's rows by its token ids and positions alone, not by any field the
patch adds: `residual_streams` for one prompt in one forward, `request_rows` for many
prompts across batched and chunked forwards.
"""

import itertools
from collections import defaultdict
from pathlib import Path
from typing import Dict, Hashable, List, NamedTuple, Optional, Sequence, Set

import torch

# The record of the forward in progress, shared by the hooks of the scheduler process.
_record: Dict[str, torch.Tensor] = {}
_forwards = itertools.count()


def _host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu").clone()


def record_output(config):
    out_dir = Path(config["dir"])
    kind = config["kind"]
    # Under tensor parallelism every rank's forward count names the same files: one rank
    # saves. Every rank still takes the values: on 0.5.23 reading the residual stream
    # (`snapshot`) may run the layer boundary's all-reduce, which a rank that skipped it
    # would leave its peers waiting in (eight ranks hung at warmup when only rank 0 read).
    saves = config.get("rank") is None or _process_rank() == config["rank"]

    def hook(module, inputs, output):
        if kind == "embed":
            _record.clear()
            _record["input_ids"] = _host(inputs[0]).to(torch.int64)
            _record["0"] = _host(output)
        elif kind == "experts":
            _record[f"experts.{config['index']}"] = _host(output.topk_ids).sort(dim=-1).values
        elif kind == "layer":
            positions, forward_batch = inputs[0], inputs[2]
            stream = getattr(forward_batch, "residual_stream", None)
            if stream is not None:
                # 0.5.23: a layer returns (output, topk indices) and leaves the residual on
                # the batch's stream, whose snapshot is their sum.
                value = stream.snapshot(output[0])
            else:
                hidden_states, residual = output[:2]  # 0.5.14 layers also return topk indices
                value = hidden_states if residual is None else hidden_states + residual
            _record[str(config["index"] + 1)] = _host(value)
            if config["index"] == 0:
                _record["positions"] = _host(positions).to(torch.int64)
                _record["decode_only"] = forward_batch.forward_mode.is_decode()
        else:
            value = output[0] if isinstance(output, tuple) else output
            record = dict(_record, last=_host(value))
            _record.clear()
            if saves and (not record.pop("decode_only") or config.get("decode")):
                torch.save(record, out_dir / f"forward.{next(_forwards):05d}.pt")

    return hook


def _process_rank() -> int:
    """This scheduler process's rank in the server's process group (0 without one)."""
    import torch.distributed

    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def hook_specs(out_dir: Path, num_layers: int, decoder: str = "model", decode: bool = False,
               rank: Optional[int] = None, moe_layers: Sequence[int] = ()) -> List[dict]:
    """The --forward-hooks entries for the decoder at module path `decoder`; target names
    are exact (a pattern would match submodules). `decode`: decode-only forwards are saved too.
    `rank`: only the scheduler process of that rank saves (tensor parallelism). `moe_layers`:
    the experts each row took in those layers are recorded too (`experts.<i>`, sorted ids)."""
    targets = [("embed", f"{decoder}.embed_tokens", {"kind": "embed"}), ("norm", f"{decoder}.norm", {"kind": "norm"})]
    targets += [(f"layer{i}", f"{decoder}.layers.{i}", {"kind": "layer", "index": i}) for i in range(num_layers)]
    targets += [(f"experts{i}", f"{decoder}.layers.{i}.mlp.topk", {"kind": "experts", "index": i}) for i in moe_layers]
    return [
        {"name": name, "target_modules": [module], "hook_factory": "tests.server.oracle_hooks:record_output",
         "config": {"dir": str(out_dir), "decode": decode, "rank": rank, **config}}
        for name, module, config in targets
    ]


def forward_files(out_dir: Path) -> List[Path]:
    return sorted(out_dir.glob("forward.*.pt"))


def residual_streams(out_dir: Path, num_layers: int, num_tokens: int) -> Dict[str, torch.Tensor]:
    """{"0".."L": stream entering layer i (L: last layer's output), "last": final normed state},
    taken from the one forward that prefilled exactly num_tokens rows."""
    matches = [r for r in (torch.load(p) for p in forward_files(out_dir)) if r["input_ids"].numel() == num_tokens]
    assert len(matches) == 1, f"expected one forward of {num_tokens} rows, found {len(matches)}"
    return {name: matches[0][name] for name in [str(i) for i in range(num_layers + 1)] + ["last"]}


class Forward(NamedTuple):
    prompts: Set[Hashable]  # the prompts this forward prefilled rows of
    prompt_rows: int
    other_rows: int  # rows of no given prompt: decode rows of a mixed batch, other requests


def request_rows(out_dir: Path, prompts: Dict[Hashable, Sequence[int]], first_forward: int = 0):
    """Per prompt, its streams ({"0".."L", "last"}: [T, H]) assembled from the rows of every
    saved forward from `first_forward` on; and a `Forward` per saved forward.

    A request's rows in one forward are a run of consecutive rows whose positions count up
    by one and whose token ids are the prompt's at those positions (one chunk of its
    prefill). A run is taken when none of its rows is taken and its prompt does not have
    those positions yet, in two passes:
    1. runs only one prompt explains (the same rows as a run of no other prompt), longest
       first; a random prompt matches another's rows only in short runs, so each request's
       own chunks win over chance matches;
    2. runs that several prompts explain alike (a chunk that lies inside a shared prefix),
       longest first, each to a prompt that lacks all of its positions, preferring one
       whose gap it fills exactly. Prompts equal on such a run have equal rows there.
    Doing the unambiguous chunks first keeps a shared-prefix chunk of one request from
    being handed to another chunked request whose own later chunk then finds its
    positions taken.
    """
    by_position_token = defaultdict(list)
    for key, prompt in prompts.items():
        for position, token in enumerate(prompt):
            by_position_token[(position, token)].append(key)

    records, runs = [], []
    for path in forward_files(out_dir)[first_forward:]:
        record = torch.load(path)
        forward = len(records)
        records.append(record)
        open_runs = {}  # key -> (first row, first position) of its run that reached the previous row
        previous_position = None
        for row, (position, token) in enumerate(zip(record["positions"].tolist(), record["input_ids"].tolist())):
            contiguous = previous_position is not None and position == previous_position + 1
            next_open = {}
            for key in by_position_token.get((position, token), ()):
                next_open[key] = open_runs.pop(key) if contiguous and key in open_runs else (row, position)
            for key, (first_row, first_position) in open_runs.items():
                runs.append((row - first_row, forward, first_row, first_position, key))
            open_runs, previous_position = next_open, position
        for key, (first_row, first_position) in open_runs.items():
            runs.append((record["input_ids"].numel() - first_row, forward, first_row, first_position, key))

    explained_by = defaultdict(list)  # (length, forward, first row, first position) -> prompts
    for length, forward, first_row, first_position, key in runs:
        explained_by[(length, forward, first_row, first_position)].append(key)
    order = sorted(explained_by, key=lambda run: (-run[0], run[1], run[2]))
    taken_rows = [torch.zeros(r["input_ids"].numel(), dtype=torch.bool) for r in records]
    covered = {key: torch.zeros(len(prompt), dtype=torch.bool) for key, prompt in prompts.items()}
    claims = defaultdict(list)
    held = defaultdict(set)

    def fills_gap(key, positions):
        before = positions.start == 0 or covered[key][positions.start - 1]
        after = positions.stop == len(covered[key]) or covered[key][positions.stop]
        return bool(before and after)

    for ambiguous in (False, True):
        for run in order:
            keys = explained_by[run]
            if (len(keys) > 1) != ambiguous:
                continue
            length, forward, first_row, first_position = run
            rows = slice(first_row, first_row + length)
            positions = slice(first_position, first_position + length)
            if taken_rows[forward][rows].any():
                continue
            free = [key for key in keys if not covered[key][positions].any()]
            if not free:
                continue
            key = next((k for k in free if fills_gap(k, positions)), free[0])
            taken_rows[forward][rows] = True
            covered[key][positions] = True
            claims[key].append((forward, rows, positions))
            held[forward].add(key)

    missing = {key: (~c).nonzero().flatten()[:5].tolist() for key, c in covered.items() if not c.all()}
    assert not missing, f"prompt positions no saved forward prefilled (first few per prompt): {missing}"
    names = [name for name in records[0] if name not in ("input_ids", "positions")] if records else []
    streams = {}
    for key, prompt in prompts.items():
        out = {name: torch.empty((len(prompt),) + records[0][name].shape[1:], dtype=records[0][name].dtype)
               for name in names}
        for forward, rows, positions in claims[key]:
            for name in names:
                out[name][positions] = records[forward][name][rows]
        streams[key] = out
    forwards = [Forward(held[f], int(taken_rows[f].sum()), int((~taken_rows[f]).sum())) for f in range(len(records))]
    return streams, forwards
