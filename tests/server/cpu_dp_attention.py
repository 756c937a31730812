"""A stand-in for what SGLang 0.5.23's DP attention expects of a CPU attention backend,
attached with --forward-hooks (its factory runs in every scheduler process at model load).

Under DP attention every attention group pads its batch to the largest group's size
(`ForwardBatch._pad_inputs_to_size`), which on the CPU asks the attention backend for the
sequence length of a padded row, `get_cpu_graph_seq_len_fill_value`. Only the CPU backends
for AMX (intel_amx) and hybrid linear attention define it; torch_native, the backend a CPU
without AMX runs, does not, and every rank raises AttributeError at warmup. The value is the
one intel_amx returns (1, as CUDA backends' `get_cuda_graph_seq_len_fill_value` mostly do):
a padded row attends to one slot. It changes no row of a real request."""


def padded_rows_attend_to_one_slot(config):
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    if not hasattr(TorchNativeAttnBackend, "get_cpu_graph_seq_len_fill_value"):
        TorchNativeAttnBackend.get_cpu_graph_seq_len_fill_value = lambda self: 1
    return lambda module, inputs, output: None


def spec(target: str = "model.norm") -> list:
    return [{"name": "padded_rows_attend_to_one_slot", "target_modules": [target],
             "hook_factory": "tests.server.cpu_dp_attention:padded_rows_attend_to_one_slot", "config": {}}]
