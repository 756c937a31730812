"""The draft-config ids the dump records come from the release's own
set_eagle3_layers_to_capture, each checked by running it."""

from sglang.srt.hidden_states_dump.eagle3_layers import draft_layer_ids, eagle3_model_class, fed_layers
from tests.unit.conftest import RELEASE

MODEL = eagle3_model_class()


def test_every_recorded_draft_config_is_fed_exactly_the_dumped_layers():
    for dumped in ([3, 31, 59], [59, 3, 31], [2, 30, 58], [1, 2, 3], [0, 5, 60], [3, 31, 59, 61]):
        aux = sorted(layer for layer in dumped if layer < 61)
        for ids in draft_layer_ids(MODEL, dumped, 61):
            assert fed_layers(MODEL, ids, 61) == aux


def test_eagle3_default_layers_need_the_releases_own_ids():
    """What moved between releases (SGLang issue 25454's one-layer offset): 0.5.9 adds one
    to every id, later releases take ids whose first is not 1 as they are."""
    expected = [[2, 30, 58]] if RELEASE < (0, 5, 14) else [[3, 31, 59]]
    assert draft_layer_ids(MODEL, [3, 31, 59], 61) == expected


def test_a_config_without_ids_is_recorded_where_it_feeds_the_dumped_layers():
    # With no ids SGLang captures [2, L//2, L-3] in every release here.
    assert None in draft_layer_ids(MODEL, [2, 30, 58], 61)
    assert None not in draft_layer_ids(MODEL, [3, 31, 59], 61)


def test_layers_no_draft_config_is_fed_record_none():
    """The negative control: the last layer's output alone is never an aux layer upstream."""
    assert draft_layer_ids(MODEL, [61], 61) == []
    if RELEASE >= (0, 5, 14):
        # Entering layer 1 first: ids [1, ...] are shifted, ids [0, ...] are not.
        assert draft_layer_ids(MODEL, [1, 5, 7], 61) == []
