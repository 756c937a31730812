"""Which requests of a batch are dumped: what the scheduler's hooks ask, on the hot path.

A client request is dumped when its custom_params ask for it (DUMP_PARAM true), never when
they decline (DUMP_PARAM false, or PRIVATE_PARAM true, whatever else is set), and otherwise
when the server's sample takes it (config.RequestSample: all requests by default). A dumped
request's answer is dumped with it when its custom_params ask (ANSWER_PARAM true) or the
server dumps every answer (SGLANG_HS_DUMP_ANSWERS): its decode steps then carry it too, until
it finishes. With dumping off every helper here returns after one cached bool check, and
decode steps pay one more while no answer is being dumped.
"""

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple

from sglang.srt.hidden_states_dump.config import (
    answer_graphs,
    dump_answers,
    dump_enabled,
    request_sample,
)
from sglang.srt.hidden_states_dump.format import (
    ANSWER_PARAM,
    DUMP_PARAM,
    LOSS_MASK_PARAM,
    META_INFO_KEY,
    PRIVATE_PARAM,
)

# Requests the server sends itself (startup warmup, /health_generate) are never dumped.
INTERNAL_RID_PREFIXES = ("WARMUP_", "HEALTH_CHECK")


@dataclass(frozen=True)
class DumpRequest:
    """What the dump needs to know about one request of an extend batch."""

    rid: str
    prompt_len: int
    loss_mask_runs: Optional[Tuple[int, ...]] = None  # None: every prompt token
    # The scheduler's Req, whose response reports where the sample is (None: nowhere)
    req: Any = field(default=None, compare=False, repr=False)
    asked: bool = False  # its custom_params asked for the dump (else the server's sample took it)
    answer: bool = False  # its answer is dumped with its prompt, in one sample at its finish
    decoding: bool = False  # the forward holds rows of its answer, not of its prompt
    # A whole sample's token ids, which its rows must hold (the writer checks them)
    token_ids: Optional[Tuple[int, ...]] = field(default=None, repr=False)
    answer_tokens: Optional[int] = None  # how many of a whole sample's rows are its answer's


# The requests whose answer is being dumped, on every rank alike: added with their prompt's
# prefill, gone when they finish (finish_answers) or with the request.
_answering: "weakref.WeakSet" = weakref.WeakSet()
# Where a finished request whose answer was dumped goes: the dumper of this process.
_on_answer_finished: Optional[Callable[[Any], None]] = None


def on_answer_finished(callback: Optional[Callable[[Any], None]]) -> None:
    global _on_answer_finished
    _on_answer_finished = callback


def wants_dump(req) -> bool:
    """Whether this request's next prefill is dumped: a client request whose prompt has
    not been prefilled whole yet (a retracted request prefills again with output ids),
    and that is not being aborted. An abort (client, timeout, or a request the scheduler
    rejects, whose prompt it replaces by one token) only takes effect once the prefill
    is done, so without this an aborted request would still be dumped."""
    return (
        not req.output_ids
        and req.to_finish is None
        and not req.finished()
        and isinstance(req.rid, str)
        and not req.rid.startswith(INTERNAL_RID_PREFIXES)
        and is_selected(req)
    )


def is_selected(req) -> bool:
    """Whether the dump takes this client request: never when custom_params PRIVATE_PARAM
    is set to anything true (a value read loosely errs toward privacy) or DUMP_PARAM is
    false; always when DUMP_PARAM is true; otherwise when the server's sample takes it."""
    custom_params = getattr(req.sampling_params, "custom_params", None)
    if isinstance(custom_params, dict) and (
        custom_params.get(PRIVATE_PARAM) or custom_params.get(DUMP_PARAM) is False
    ):
        return False
    return asks_for_dump(req) or request_sample().takes(req.rid)


def asks_for_dump(req) -> bool:
    custom_params = getattr(req.sampling_params, "custom_params", None)
    return isinstance(custom_params, dict) and custom_params.get(DUMP_PARAM) is True


def wants_answer(req) -> bool:
    """Whether a dumped request's answer is dumped with its prompt."""
    if dump_answers():
        return True
    custom_params = getattr(req.sampling_params, "custom_params", None)
    return isinstance(custom_params, dict) and custom_params.get(ANSWER_PARAM) is True


def may_match_cached_prefix(req) -> bool:
    """Whether the request may reuse a cached prefix: a dumped prompt may not, since a
    cached prefix has no hidden states (its whole prompt is prefilled, so files have no
    gaps; its KV cache is still inserted for later requests)."""
    return not (dump_enabled() and wants_dump(req))


def requests_to_dump(reqs, is_extend: bool = True) -> Optional[List[Optional[DumpRequest]]]:
    """Per request of a batch, what to dump (None: not dumped): the prompts of an extend
    batch, and the answers being dumped of any batch; an empty list for a decode step
    without one; None when dumping is off."""
    if not dump_enabled():
        return None
    # A plain set of the few requests answering: a WeakSet makes a weak reference per lookup.
    answering = set(_answering)
    if not is_extend:
        if not answering:
            return []
        return [answer_rows(req) if req in answering else None for req in reqs]
    return [prompt_rows(req) if wants_dump(req) else answer_rows(req) if req in answering else None for req in reqs]


def prompt_rows(req) -> DumpRequest:
    answer = wants_answer(req)
    if answer:
        _answering.add(req)
    return DumpRequest(
        req.rid, len(req.origin_input_ids), loss_mask_runs(req), req, asks_for_dump(req), answer
    )


def answer_rows(req) -> Optional[DumpRequest]:
    """A decoded token's rows of a request whose answer is dumped; none once it was
    retracted (its prefill again would place prompt rows among the answer's)."""
    if req.retraction_count:
        return None
    return DumpRequest(req.rid, len(req.origin_input_ids), req=req, answer=True, decoding=True)


def finish_answers(reqs) -> None:
    """Hand each finished request whose answer is being dumped to the dumper, which writes
    its sample (or says why not); the scheduler calls this before it sends their outputs,
    on every rank."""
    if not _answering:
        return
    for req in reqs:
        if req in _answering and req.finished():
            _answering.discard(req)
            if _on_answer_finished is not None:
                _on_answer_finished(req)


def loss_mask_runs(req) -> Optional[Tuple[int, ...]]:
    """The loss mask the client gave with the request (LOSS_MASK_PARAM), as it gave it; the
    writer checks it against the prompt, off the scheduler thread."""
    custom_params = getattr(req.sampling_params, "custom_params", None)
    if not isinstance(custom_params, dict):
        return None
    runs = custom_params.get(LOSS_MASK_PARAM)
    return tuple(runs) if isinstance(runs, (list, tuple)) else None


def report_location(req, location: dict) -> None:
    """Put where a request's sample will be (once the writer publishes it) in the request's
    response: meta_info[META_INFO_KEY], through the Req's customized_info, which the
    scheduler sends with the request's first output."""
    if req.customized_info is None:
        req.customized_info = {}
    req.customized_info[META_INFO_KEY] = [location]


def decode_graph_misses_dump(requests: Optional[List[Optional[DumpRequest]]]) -> bool:
    """Whether a replayed decode CUDA graph would miss rows a decode step with `requests`
    dumps: it carries a dumped answer, and graphs do not serve them (SGLANG_HS_DUMP_ANSWER_GRAPHS
    unset), so the step runs eagerly, on every DP rank alike."""
    return holds_dumped_request(requests) and not answer_graphs()


def decode_step_misses_dump(reqs) -> bool:
    """decode_graph_misses_dump for a decode step of the scheduler's requests `reqs` (the
    vote on the decode graph under DP attention)."""
    return decode_graph_misses_dump(requests_to_dump(reqs, is_extend=False))


def holds_dumped_request(requests: Optional[List[Optional[DumpRequest]]]) -> bool:
    """Whether a batch whose requests_to_dump are `requests` dumps any: such a prefill
    runs eagerly (a replayed CUDA graph runs no Python hook), on every DP rank alike."""
    return requests is not None and any(requests)
