"""Which ids an SGLang EAGLE-3 draft config of this release must name to be fed the
dumped layers.

A draft config names `eagle_config.eagle_aux_hidden_state_layer_ids`; the target model's
`set_eagle3_layers_to_capture` turns them into the layers it captures, and that mapping
moves between releases (0.5.9 adds one to every id; later releases only when the first id
is 1; no ids gives a default of its own). So it is not typed here: each candidate config
is run through this release's own method, and the ones that capture exactly the dumped
layers are kept. The draft is fed its layers in ascending order (the model captures them
as its layers run), whatever order the config or the dump names them in.
"""

from types import SimpleNamespace
from typing import List, Optional


def fed_layers(model_class, draft_layer_ids: Optional[List[int]], num_layers: int) -> List[int]:
    """The layers (transformers' convention) the model captures for a draft config that
    names `draft_layer_ids` (None: names none), by the release's own method."""
    stand_in = SimpleNamespace(
        pp_group=SimpleNamespace(is_last_rank=True),
        config=SimpleNamespace(num_hidden_layers=num_layers),
        model=SimpleNamespace(layers_to_capture=[]),
        capture_aux_hidden_states=False,
    )
    model_class.set_eagle3_layers_to_capture(stand_in, draft_layer_ids)
    return sorted(stand_in.model.layers_to_capture)


def draft_layer_ids(model_class, dumped: List[int], num_layers: int) -> List[Optional[List[int]]]:
    """Every draft config among the candidates (the aux layers' ids as they are, each one
    less, and no ids) whose ids this release feeds exactly the dumped aux layers: those
    below L, since upstream never captures the last layer's output. Empty when none does."""
    aux = sorted(layer for layer in dumped if layer < num_layers)
    if not aux:
        return []
    candidates = [aux, [layer - 1 for layer in aux], None]
    return [ids for ids in candidates if fed_layers(model_class, ids, num_layers) == aux]


def eagle3_model_class():
    """The target model class whose mapping the dump records (DeepSeek-V3 and Kimi-K2.5
    serve through it)."""
    from sglang.srt.models.deepseek_v2 import DeepseekV2ForCausalLM

    return DeepseekV2ForCausalLM
