"""LogitsProcessor._get_pruned_states and _get_hidden_states_to_store with aux hidden
states, on CPU tensors, in every branch of _get_pruned_states.

0.5.9 and 0.5.14 patch the file (0002); 0.5.23 leaves it as upstream wrote it, which the
dump relies on: aux hidden states pruned in every branch, in the list form and in the
packed [T, K*H] form of upstream's AuxHiddenStatePacker, and aux None (what the model
returns when no layer was captured) stored like no aux.

Every row of the inputs says which token it belongs to, so the expected rows are written
down as token positions, independently of the code under test. Upstream's unpatched
file, loaded as a separate module, is the negative control: it loses the aux rows in the
input-logprobs branch (0.5.9), and it fails on an empty aux list (every release), which
these tests must notice.
"""

import dataclasses
import importlib.util
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import List

import pytest
import torch
from torch import nn

from sglang.srt.layers import logits_processor as patched
from sglang.srt.layers.logits_processor import LogitsMetadata
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from tests.unit.conftest import RELEASE

HIDDEN_SIZE = 4
NUM_AUX = 3
METADATA_FIELDS = {f.name for f in dataclasses.fields(LogitsMetadata)}
# From 0.5.23 models may hand the logits processor one packed [T, K*H] tensor.
AUX_FORMS = ["list", "packed"] if hasattr(patched, "pack_aux_hidden_states") else ["list"]


def make_states(num_tokens: int):
    """hidden_states and NUM_AUX aux tensors [T, H]. Row t of hidden_states holds
    10*t + h in column h; row t of aux k holds 1000*(k+1) + 10*t + h, so a row tells
    which tensor and which token it came from."""
    rows = 10 * torch.arange(num_tokens, dtype=torch.float32)[:, None] + torch.arange(
        HIDDEN_SIZE, dtype=torch.float32
    )
    aux = [rows + 1000 * (k + 1) for k in range(NUM_AUX)]
    return rows.clone(), aux


def in_form(aux: List[torch.Tensor], form: str):
    return torch.cat(aux, dim=-1) if form == "packed" else aux


def as_layers(aux) -> List[torch.Tensor]:
    """The per-layer tensors of aux in either form."""
    return list(aux.split(HIDDEN_SIZE, dim=-1)) if isinstance(aux, torch.Tensor) else list(aux)


def token_positions(rows: torch.Tensor, aux_index: int) -> List[int]:
    """Which tokens rows of aux tensor `aux_index` were taken from (for messages)."""
    return ((rows[:, 0] - 1000 * (aux_index + 1)) // 10).long().tolist()


@dataclass
class Case:
    """One branch of _get_pruned_states: a batch and the token positions expected back."""

    name: str
    forward_mode: ForwardMode
    num_tokens: int
    # Token positions of the pruned rows (what logits are computed from).
    pruned: List[int]
    # Token positions whose hidden states CaptureHiddenMode.LAST stores: the token each
    # request samples from.
    sampled: List[int]
    metadata: dict = field(default_factory=dict)

    @property
    def input_logprobs(self) -> bool:
        return self.metadata.get("extend_return_logprob", False)

    def logits_metadata(self, capture_hidden_mode: CaptureHiddenMode) -> LogitsMetadata:
        return LogitsMetadata(
            forward_mode=self.forward_mode,
            capture_hidden_mode=capture_hidden_mode,
            **self.metadata,
        )


def extend(seq_lens, padded_static_len=-1):
    return dict(
        extend_seq_lens=torch.tensor(seq_lens),
        extend_seq_lens_cpu=list(seq_lens),
        padded_static_len=padded_static_len,
    )


def extend_with_logprobs(seq_lens, logprob_start_lens):
    return dict(
        extend_return_logprob=True,
        extend_seq_lens=torch.tensor(seq_lens),
        extend_seq_lens_cpu=list(seq_lens),
        extend_logprob_start_lens_cpu=list(logprob_start_lens),
    )


CASES = [
    Case("decode", ForwardMode.DECODE, 3, pruned=[0, 1, 2], sampled=[0, 1, 2]),
    Case("idle", ForwardMode.IDLE, 0, pruned=[], sampled=[]),
    # Requests of 3, 1 and 4 tokens: their last tokens are 2, 3 and 7.
    Case(
        "extend",
        ForwardMode.EXTEND,
        8,
        pruned=[2, 3, 7],
        sampled=[2, 3, 7],
        metadata=extend([3, 1, 4]),
    ),
    # One prefill of 5 tokens and two decodes of one token each.
    Case(
        "mixed",
        ForwardMode.MIXED,
        7,
        pruned=[4, 5, 6],
        sampled=[4, 5, 6],
        metadata=extend([5, 1, 1]),
    ),
    # Padded to 5 tokens per request: [t00, t01, p, p, p, t10, t11, t12, p, p]
    # (releases before 0.5.23).
    Case(
        "extend-padded-static-len",
        ForwardMode.EXTEND,
        10,
        pruned=[1, 7],
        sampled=[1, 7],
        metadata=extend([2, 3], padded_static_len=5),
    ),
    # Upstream's own example: tokens 0-3, 4-8, 9-14; logprobs from 0, 5 and 3. The
    # second request is a chunk with no input logprob (start == extend length): only
    # its last token is kept, to sample from.
    Case(
        "extend-logprobs",
        ForwardMode.EXTEND,
        15,
        pruned=[0, 1, 2, 3, 8, 12, 13, 14],
        sampled=[3, 8, 14],
        metadata=extend_with_logprobs([4, 5, 6], [0, 5, 3]),
    ),
    # Tokens 0-1, 2-4, 5; the first and the last request are chunks without input
    # logprobs.
    Case(
        "extend-logprobs-chunks-at-both-ends",
        ForwardMode.EXTEND,
        6,
        pruned=[1, 2, 3, 4, 5],
        sampled=[1, 4, 5],
        metadata=extend_with_logprobs([2, 3, 1], [2, 0, 1]),
    ),
    Case(
        "extend-logprobs-one-request",
        ForwardMode.EXTEND,
        6,
        pruned=[2, 3, 4, 5],
        sampled=[5],
        metadata=extend_with_logprobs([6], [2]),
    ),
    # Two requests verifying 3 draft tokens each.
    Case(
        "target-verify",
        ForwardMode.TARGET_VERIFY,
        6,
        pruned=list(range(6)),
        sampled=list(range(6)),
    ),
    Case(
        "draft-extend-v2",
        ForwardMode.DRAFT_EXTEND_V2,
        4,
        pruned=list(range(4)),
        sampled=list(range(4)),
    ),
    # 0.5.23: a draft extend keeps the rows its select index names (tokens 1 and 3).
    Case(
        "draft-extend-v2-select-index",
        ForwardMode.DRAFT_EXTEND_V2,
        4,
        pruned=[1, 3],
        sampled=[1, 3],
        metadata=dict(draft_extend_select_index=torch.tensor([1, 3])),
    ),
    Case(
        "decode-select-index",
        ForwardMode.DECODE,
        3,
        pruned=[0, 2],
        sampled=[0, 2],
        metadata=dict(draft_extend_select_index=torch.tensor([0, 2])),
    ),
]
# Only the branches this release has: each case's metadata names fields of its LogitsMetadata.
CASES = [case for case in CASES if set(case.metadata) <= METADATA_FIELDS]
LOGPROB_CASES = [case for case in CASES if case.input_logprobs]


def by_name(cases):
    return pytest.mark.parametrize("case", cases, ids=[case.name for case in cases])


aux_forms = pytest.mark.parametrize("form", AUX_FORMS)


def mode_name(capture_hidden_mode):
    return capture_hidden_mode.name


def same(ours, theirs) -> bool:
    if ours is None or theirs is None:
        return ours is None and theirs is None
    return torch.equal(ours, theirs)


def bare_processor(module):
    """A LogitsProcessor of `module` whose own __init__ did not run.

    LogitsProcessor.__init__ reads the global server args and the tensor-parallel group,
    which need a distributed environment. The two methods under test read nothing from
    self (only their arguments), so the real methods are called on an instance set up
    as a bare nn.Module.
    """
    processor = module.LogitsProcessor.__new__(module.LogitsProcessor)
    nn.Module.__init__(processor)
    return processor


def prune_and_store(module, case, capture_hidden_mode, aux):
    """Run both methods of `module` the way LogitsProcessor.forward chains them."""
    processor = bare_processor(module)
    hidden_states, _ = make_states(case.num_tokens)
    metadata = case.logits_metadata(capture_hidden_mode)
    (
        pruned_states,
        pruned_states_before_norm,
        aux_pruned_states,
        sample_indices,
        _input_logprob_indices,
        _token_to_seq_idx,
    ) = processor._get_pruned_states(hidden_states, None, aux, metadata)
    stored = processor._get_hidden_states_to_store(
        hidden_states,
        None,
        aux,
        pruned_states,
        pruned_states_before_norm,
        aux_pruned_states,
        sample_indices,
        metadata,
    )
    return pruned_states, aux_pruned_states, sample_indices, stored


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    """Upstream's unpatched logits_processor.py, imported as a module of its own."""
    checkout = os.environ["SGLANG_CHECKOUT"]
    source = subprocess.run(
        ["git", "-C", checkout, "show", "upstream:sglang/srt/layers/logits_processor.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = tmp_path_factory.mktemp("upstream") / "upstream_logits_processor.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("upstream_logits_processor", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def series_patches_it(upstream):
    with open(patched.__file__) as f:
        if f.read() == Path(upstream.__file__).read_text():
            pytest.skip("the series leaves logits_processor.py as upstream wrote it: nothing to compare")


@aux_forms
@by_name(CASES)
@pytest.mark.parametrize("capture_hidden_mode", list(CaptureHiddenMode), ids=mode_name)
def test_aux_pruned_like_hidden_states_in_every_branch(case, capture_hidden_mode, form):
    hidden_states, aux = make_states(case.num_tokens)
    pruned_states, aux_pruned_states, sample_indices, _ = prune_and_store(
        patched, case, capture_hidden_mode, in_form(aux, form)
    )

    assert torch.equal(pruned_states, hidden_states[case.pruned])
    assert aux_pruned_states is not None
    assert isinstance(aux_pruned_states, torch.Tensor) == (form == "packed")
    assert len(as_layers(aux_pruned_states)) == NUM_AUX
    for k, (pruned, full) in enumerate(zip(as_layers(aux_pruned_states), aux)):
        assert token_positions(pruned, k) == case.pruned
        assert torch.equal(pruned, full[case.pruned])
    if sample_indices is not None:
        sampled = [case.pruned[i] for i in sample_indices.tolist()]
        assert sampled == case.sampled


@aux_forms
@by_name(CASES)
def test_full_stores_aux_of_every_token(case, form):
    _, aux = make_states(case.num_tokens)
    *_, stored = prune_and_store(patched, case, CaptureHiddenMode.FULL, in_form(aux, form))

    expected = torch.cat(aux, dim=-1)
    assert stored.shape == (case.num_tokens, NUM_AUX * HIDDEN_SIZE)
    assert torch.equal(stored, expected)


@aux_forms
@by_name(CASES)
def test_last_stores_aux_of_the_sampled_tokens(case, form):
    _, aux = make_states(case.num_tokens)
    *_, stored = prune_and_store(patched, case, CaptureHiddenMode.LAST, in_form(aux, form))

    expected = torch.cat([full[case.sampled] for full in aux], dim=-1)
    assert stored.shape == (len(case.sampled), NUM_AUX * HIDDEN_SIZE)
    assert torch.equal(stored, expected)


@aux_forms
@by_name(CASES)
def test_null_stores_nothing(case, form):
    _, aux = make_states(case.num_tokens)
    *_, stored = prune_and_store(patched, case, CaptureHiddenMode.NULL, in_form(aux, form))

    assert stored is None


# Upstream crashes for LAST with input logprobs; see test_upstream_loses_aux_with_logprobs.
UPSTREAM_WORKS = [
    (case, mode)
    for case in CASES
    for mode in (CaptureHiddenMode.FULL, CaptureHiddenMode.LAST)
    if not (mode.is_last() and case.input_logprobs)
]


@pytest.mark.parametrize(
    "case, capture_hidden_mode",
    UPSTREAM_WORKS,
    ids=[f"{case.name}-{mode.name}" for case, mode in UPSTREAM_WORKS],
)
def test_stored_states_match_upstream_where_upstream_works(
    case, capture_hidden_mode, upstream, series_patches_it
):
    _, aux = make_states(case.num_tokens)
    *_, stored = prune_and_store(patched, case, capture_hidden_mode, aux)
    *_, upstream_stored = prune_and_store(upstream, case, capture_hidden_mode, aux)

    assert torch.equal(stored, upstream_stored)


@by_name(CASES)
@pytest.mark.parametrize("capture_hidden_mode", list(CaptureHiddenMode), ids=mode_name)
def test_without_aux_nothing_changes(case, capture_hidden_mode, upstream, series_patches_it):
    ours = prune_and_store(patched, case, capture_hidden_mode, None)
    theirs = prune_and_store(upstream, case, capture_hidden_mode, None)
    assert all(same(a, b) for a, b in zip(ours, theirs))


@by_name(CASES)
@pytest.mark.parametrize("capture_hidden_mode", list(CaptureHiddenMode), ids=mode_name)
def test_without_aux_the_hidden_states_are_stored(case, capture_hidden_mode):
    hidden_states, _ = make_states(case.num_tokens)
    pruned_states, aux_pruned_states, sample_indices, stored = prune_and_store(
        patched, case, capture_hidden_mode, None
    )
    assert aux_pruned_states is None
    if capture_hidden_mode.is_full():
        assert torch.equal(stored, hidden_states)
    elif capture_hidden_mode.is_last():
        assert torch.equal(stored, hidden_states[case.sampled])
    else:
        assert stored is None


@pytest.mark.skipif(RELEASE >= (0, 5, 23), reason="the 0.5.23 model returns aux None, not an empty list, when no layer was captured (patch 0001)")
@by_name(CASES)
def test_empty_aux_list_is_stored_like_no_aux(case):
    # Capture on, but no configured layer in this rank's range.
    hidden_states, _ = make_states(case.num_tokens)
    *_, full = prune_and_store(patched, case, CaptureHiddenMode.FULL, [])
    *_, last = prune_and_store(patched, case, CaptureHiddenMode.LAST, [])

    assert torch.equal(full, hidden_states)
    assert torch.equal(last, hidden_states[case.sampled])


@pytest.mark.skipif(RELEASE >= (0, 5, 14), reason="upstream prunes aux with input logprobs from 0.5.14 on")
@by_name(LOGPROB_CASES)
def test_upstream_loses_aux_with_logprobs(case, upstream):
    """The negative control: the checks above fail on upstream's file."""
    _, aux = make_states(case.num_tokens)

    _, aux_pruned_states, _, _ = prune_and_store(
        upstream, case, CaptureHiddenMode.NULL, aux
    )
    assert aux_pruned_states is None
    with pytest.raises(TypeError):  # torch.cat(None)
        prune_and_store(upstream, case, CaptureHiddenMode.LAST, aux)


@by_name(CASES)
@pytest.mark.parametrize(
    "capture_hidden_mode", [CaptureHiddenMode.FULL, CaptureHiddenMode.LAST], ids=mode_name
)
def test_upstream_fails_on_an_empty_aux_list(case, capture_hidden_mode, upstream):
    """The negative control of test_empty_aux_list_is_stored_like_no_aux (and, on 0.5.23,
    why its model returns aux None rather than an empty list)."""
    _, aux = make_states(case.num_tokens)

    # torch.cat([]) (ValueError in torch 2.9, RuntimeError before), or torch.cat(None)
    # where upstream also loses the aux rows
    with pytest.raises((ValueError, RuntimeError, TypeError), match="cat"):
        prune_and_store(upstream, case, capture_hidden_mode, [])
