"""The copier's slice size set inside the server process, attached with --forward-hooks:
`slices` makes every forward's rows cross in slices of `bytes`. A server test uses a few
rows a slice, to check the slicing row for row against the oracle; the benchmarks compare
slice sizes side by side. The hook itself does nothing; the factory is the way into the
scheduler process, before the first forward builds the copier."""


def slices(config):
    from sglang.srt.hidden_states_dump import copier

    copier.SLICE_BYTES = config["bytes"]
    return lambda module, inputs, output: None


def slices_hook(slice_bytes: int) -> dict:
    """One --forward-hooks entry (join it to the others' list)."""
    return {"name": "slices", "target_modules": ["model.norm"],
            "hook_factory": "scripts.bench.copier_hooks:slices", "config": {"bytes": slice_bytes}}
