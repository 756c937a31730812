"""The copier's settings changed inside the server process, attached with --forward-hooks:
`slices` makes every forward's rows cross in slices of `bytes`. A server test uses a few
rows a slice, to check the slicing row for row against the oracle; the benchmarks compare
slice sizes side by side. `quantized_by_pytorch` quantizes fp8 rows with format.quantize_rows
(several passes) instead of fp8_rows' kernel (one), for the benchmarks to compare. The hooks
themselves do nothing; the factory is the way into the scheduler process, before the first
forward builds the copier."""


def slices(config):
    from sglang.srt.hidden_states_dump import copier

    copier.SLICE_BYTES = config["bytes"]
    return lambda module, inputs, output: None


def quantized_by_pytorch(config):
    from sglang.srt.hidden_states_dump import format, fp8_rows

    fp8_rows.quantize_rows = format.quantize_rows
    return lambda module, inputs, output: None


def slices_hook(slice_bytes: int) -> dict:
    """One --forward-hooks entry (join it to the others' list)."""
    return copier_hook("slices", {"bytes": slice_bytes})


def copier_hook(name: str, config: dict = None) -> dict:
    """The --forward-hooks entry of the factory `name` of this module."""
    return {"name": name, "target_modules": ["model.norm"],
            "hook_factory": f"scripts.bench.copier_hooks:{name}", "config": config or {}}
