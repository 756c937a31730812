"""Moonshot's INT4 checkpoint format (Kimi-K2-Thinking, Kimi-K2.5), packed and decoded with
compressed-tensors' own code.

The routed experts' weights are quantized to signed 4-bit integers, symmetric, one scale per
group of 32 inputs (W4A16), and stored as `weight_packed` (int32, eight values a word),
`weight_scale` (bf16) and `weight_shape`; every other weight stays bf16, named under `ignore`.
"""

import re
from typing import Dict

import torch

# The text model's quantization_config as Moonshot's release writes it.
QUANTIZATION_CONFIG = {
    "config_groups": {
        "group_0": {
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None, "block_structure": None, "dynamic": False, "group_size": 32,
                "num_bits": 4, "observer": "minmax", "observer_kwargs": {}, "strategy": "group",
                "symmetric": True, "type": "int",
            },
        },
    },
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}
ROUTED_EXPERT_WEIGHT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
PACKED_SUFFIX = "weight_packed"


def _scheme():
    """The scheme compressed-tensors parses from QUANTIZATION_CONFIG: the one place that says
    how the weights are quantized."""
    from compressed_tensors.quantization import QuantizationConfig

    return QuantizationConfig.model_validate(QUANTIZATION_CONFIG).config_groups["group_0"]


def pack(weights: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """`weights` with each routed expert's `weight` replaced by its packed form. Scales are the
    min-max ones compressed-tensors computes, stored in the weight's dtype; each packed weight
    must decode to exactly the weight fake-quantized with that scale, or nothing is returned."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = _scheme()
    packed = {}
    for name, weight in weights.items():
        if not ROUTED_EXPERT_WEIGHT.search(name):
            packed[name] = weight
            continue
        groups = weight.float().unflatten(-1, (-1, scheme.weights.group_size))
        scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
        scale = scale.to(weight.dtype)
        module = PackedQuantizationCompressor.compress(
            {"weight": weight, "weight_scale": scale, "weight_zero_point": zero_point}, scheme)
        decoded = PackedQuantizationCompressor.decompress(module, scheme)["weight"]
        if not torch.equal(decoded, fake_quantize(weight, scale, zero_point, scheme.weights)):
            raise RuntimeError(f"{name}: the packed weight does not decode to the fake-quantized weight")
        prefix = name[: -len("weight")]
        packed.update({prefix + key: value for key, value in module.items()})
    return packed


def decode(weights: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """`weights` with every packed module replaced by the `weight` compressed-tensors decodes
    it to: the bf16 model the INT4 checkpoint stands for."""
    from compressed_tensors.compressors import PackedQuantizationCompressor

    scheme = _scheme()
    decoded = {}
    prefixes = [name[: -len(PACKED_SUFFIX)] for name in weights if name.endswith(PACKED_SUFFIX)]
    module_keys = {prefix + key for prefix in prefixes for key in ("weight_packed", "weight_scale", "weight_shape")}
    for prefix in prefixes:
        module = {key: weights[prefix + key] for key in ("weight_packed", "weight_scale", "weight_shape")}
        decoded[prefix + "weight"] = PackedQuantizationCompressor.decompress(module, scheme)["weight"]
    decoded.update({name: value for name, value in weights.items() if name not in module_keys})
    return decoded
