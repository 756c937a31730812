"""The copier's slice size set inside the server process, attached with --forward-hooks:
`small_slices` makes every forward's rows cross in slices of `bytes` (a few rows each), so a
server test checks the slicing on the real server, row for row against the oracle. The hook
itself does nothing; the factory is the way into the scheduler process, before the first
forward builds the copier."""


def small_slices(config):
    from sglang.srt.hidden_states_dump import copier

    copier.SLICE_BYTES = config["bytes"]
    return lambda module, inputs, output: None


def small_slices_hook(slice_bytes: int) -> dict:
    """One --forward-hooks entry (join it to the others' list)."""
    return {"name": "small_slices", "target_modules": ["model.norm"],
            "hook_factory": "tests.server.copier_hooks:small_slices", "config": {"bytes": slice_bytes}}
