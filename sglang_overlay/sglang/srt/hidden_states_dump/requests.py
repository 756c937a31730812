"""Which requests of a batch are dumped: what the scheduler's hooks ask, on the hot path.

A client request is dumped when its custom_params ask for it (DUMP_PARAM true), never when
they decline (DUMP_PARAM false, or PRIVATE_PARAM true, whatever else is set), and otherwise
when the server's sample takes it (config.RequestSample: all requests by default). A dumped
request's answer is dumped with it when its custom_params ask (ANSWER_PARAM true) or the
server dumps every answer (SGLANG_HS_DUMP_ANSWERS): its decode steps then carry it too, until
it finishes. A dumped request's last output says where its sample is (finish_dumped_requests).
custom_params that are not what the dump documents (dump_params_error) refuse the request
before anything reads them. With dumping off every helper here returns after one cached bool
check, and decode steps pay one more while no answer is being dumped.
"""

import json
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


# The custom_params of the dump that are documented as booleans.
BOOLEAN_PARAMS = (DUMP_PARAM, ANSWER_PARAM)

# The requests whose answer is being dumped, on every rank alike: added with their prompt's
# prefill, gone when they finish (finish_dumped_requests) or with the request.
_answering: "weakref.WeakSet" = weakref.WeakSet()
# Where each submitted request's sample will be, until its last output reports it (on the
# rank that writes): its prompt's sample is submitted long before that output, an answer's
# just before it.
_locations: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# Whether the tokenizer manager gives each chunk of a streamed response the customized_info
# values of that chunk's tokens alone (--incremental-streaming-output, 0.5.14 on: it slices
# what it gathered at the tokens sent before). A dumped streamed request's outputs then carry
# one value per token they send, so that the location lands in the last chunk's.
_streams_sliced_by_token = False
# Where a finished request whose answer was dumped goes: the dumper of this process.
_on_answer_finished: Optional[Callable[[Any], None]] = None


def on_answer_finished(callback: Optional[Callable[[Any], None]]) -> None:
    global _on_answer_finished
    _on_answer_finished = callback


def set_streams_sliced_by_token(sliced: bool) -> None:
    global _streams_sliced_by_token
    _streams_sliced_by_token = sliced


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
    # Every output of a dumped request carries the key, and no location until its last: a
    # request without the key in a batch output that has it gets one None per token (0.5.23),
    # which the tokenizer manager would keep before the location.
    if req.customized_info is None:
        req.customized_info = {}
    if META_INFO_KEY not in req.customized_info:  # a prompt prefilled in chunks passes here again
        req.customized_info[META_INFO_KEY] = no_location(req)
    return DumpRequest(
        req.rid, len(req.origin_input_ids), loss_mask_runs(req), req, asks_for_dump(req), answer
    )


def answer_rows(req) -> Optional[DumpRequest]:
    """A decoded token's rows of a request whose answer is dumped; none once it was
    retracted (its prefill again would place prompt rows among the answer's)."""
    if req.retraction_count:
        return None
    return DumpRequest(req.rid, len(req.origin_input_ids), req=req, answer=True, decoding=True)


def finish_dumped_requests(reqs) -> None:
    """Before the scheduler sends a batch's outputs, on every rank: hand each finished
    request whose answer is being dumped to the dumper, which writes its sample (or says why
    not), then put where each finished request's sample is into its last output (a finished
    request's next output is its last). Two checks of empty collections while none is in
    flight; the few in flight, not the batch, are looked through for locations."""
    if _answering:
        for req in reqs:
            if req in _answering and req.finished():
                _answering.discard(req)
                if _on_answer_finished is not None:
                    _on_answer_finished(req)
    if _locations:
        for req in [req for req in _locations if req.finished()]:
            report_in_last_output(req, _locations.pop(req))


def loss_mask_runs(req) -> Optional[Tuple[int, ...]]:
    """The loss mask the client gave with the request (LOSS_MASK_PARAM), as it gave it; the
    writer checks it against the prompt, off the scheduler thread."""
    custom_params = getattr(req.sampling_params, "custom_params", None)
    if not isinstance(custom_params, dict):
        return None
    runs = custom_params.get(LOSS_MASK_PARAM)
    return tuple(runs) if isinstance(runs, (list, tuple)) else None


def report_location(req, location: dict) -> None:
    """Where a request's sample will be once the writer publishes it: its last output says
    (finish_dumped_requests)."""
    _locations[req] = location


def no_location(req) -> list:
    """A dumped request's customized_info values before its last output: none (each output
    sends an empty list), or, where its chunks are sliced by token, one None for each token
    it may generate."""
    if _streams_sliced_by_token and req.stream:
        return [None] * req.sampling_params.max_new_tokens
    return []


def report_in_last_output(req, location: dict) -> None:
    """Put `location` in the response of a finished request: meta_info[META_INFO_KEY], a list
    holding it, through the Req's customized_info. The scheduler sends each output the
    customized_info values of the tokens it sends (from send_token_offset on): the location
    is the value of the first token the last output sends, so that output alone carries it,
    streamed or not, however many outputs came before. Where the chunks are sliced by token,
    the last chunk's other tokens have None."""
    offset = req.send_token_offset
    values = [None] * offset + [location]
    if _streams_sliced_by_token and req.stream:
        values += [None] * (len(req.output_ids) - len(values))
    if req.customized_info is None:
        req.customized_info = {}
    req.customized_info[META_INFO_KEY] = values


def dump_params_error(req) -> Optional[str]:
    """Why the dump refuses a request's custom_params (None: it does not); the scheduler then
    aborts the request as it aborts a prompt that is too long, before anything of it is
    dumped: custom_params that are not a JSON object, a non-boolean where the dump documents
    a boolean, a loss mask that is not a list of non-negative integers. A field the client
    got wrong is never read as a choice (the string "false" is true). PRIVATE_PARAM is read
    loosely, toward privacy: any true value."""
    if not dump_enabled():
        return None
    custom_params = getattr(req.sampling_params, "custom_params", None)
    if custom_params is None:
        return None
    if not isinstance(custom_params, dict):
        return (
            f"sampling_params.custom_params must be a JSON object for the hidden states dump "
            f"(such as {{\"{DUMP_PARAM}\": true}}), not {json_of(custom_params)}"
        )
    for key in BOOLEAN_PARAMS:
        if key in custom_params and not isinstance(custom_params[key], bool):
            return (
                f"sampling_params.custom_params.{key} must be true or false (a JSON boolean), "
                f"not {json_of(custom_params[key])}"
            )
    if LOSS_MASK_PARAM in custom_params:
        runs = custom_params[LOSS_MASK_PARAM]
        if not (
            isinstance(runs, list)
            and all(isinstance(run, int) and not isinstance(run, bool) and run >= 0 for run in runs)
        ):
            return (
                f"sampling_params.custom_params.{LOSS_MASK_PARAM} must be a list of non-negative "
                f"integers (the loss mask's runs: zeros, ones, zeros, ...), not {json_of(runs)}"
            )
    return None


def json_of(value, limit: int = 80) -> str:
    """A client's value as JSON, as it sent it, cut to `limit` characters."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
