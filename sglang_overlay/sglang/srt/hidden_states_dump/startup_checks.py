"""What is checked once, when a model with dumping on is built: the server options the
dump supports, and the series patches it relies on.

A patch leaves its marker where it hooks into upstream code: the upstream module calls a
helper of this package by name. A port that skipped a patch would otherwise lose dumps
without a word (prefill CUDA graphs replay without the dump's hook; a kill loses the
queue), so a missing marker stops the server, naming the patch.
"""

import importlib
import importlib.util
import inspect
import types
from dataclasses import dataclass
from typing import Iterator, Optional, Set, Tuple


@dataclass(frozen=True)
class PatchMarker:
    patch: str  # the patch's concern, as its name has it after the number
    modules: Tuple[str, ...]  # the upstream modules the patch hooks into (any one holds it)
    helper: str  # the name of this package's helper the hooked code calls
    # The upstream feature may be missing from a release (then so is the patch, and
    # check_server_args refuses the options that would need it).
    feature_module: Optional[str] = None
    # A release with this module does upstream what the patch does (then it has no patch).
    upstream_module: Optional[str] = None


PATCH_MARKERS = (
    PatchMarker(
        "carry-dump-requests-with-the-batch",
        ("sglang.srt.model_executor.forward_batch_info", "sglang.srt.managers.schedule_batch"),
        "requests_to_dump",
    ),
    PatchMarker(
        "dumped-prompts-never-match-a-cached-prefix",
        ("sglang.srt.managers.schedule_batch",),
        "may_match_cached_prefix",
    ),
    PatchMarker(
        "prefill-cuda-graph-runs-dumped-prefills-eagerly",
        ("sglang.srt.model_executor.runner.prefill_cuda_graph_runner",),
        "holds_dumped_request",
        feature_module="sglang.srt.model_executor.runner.prefill_cuda_graph_runner",
    ),
    PatchMarker(
        "finish-dumped-requests-before-their-last-output",
        (
            "sglang.srt.managers.scheduler_components.output_streamer",
            "sglang.srt.managers.scheduler_output_processor_mixin",
        ),
        "finish_dumped_requests",
    ),
    PatchMarker(
        "decode-cuda-graph-steps-with-dumped-answers",
        (
            "sglang.srt.model_executor.runner.decode_cuda_graph_runner",
            "sglang.srt.model_executor.cuda_graph_runner",
        ),
        "dump_replayed_decode",
    ),
    PatchMarker(
        "decode-cuda-graph-steps-with-dumped-answers",
        (
            "sglang.srt.model_executor.runner.decode_cuda_graph_runner",
            "sglang.srt.model_executor.cuda_graph_runner",
        ),
        "decode_graph_misses_dump",
    ),
    PatchMarker(
        "drain-the-dump-before-a-scheduler-process-goes",
        ("sglang.srt.utils.common",),
        "drain_before_kill",
    ),
    PatchMarker(
        "drain-the-dump-before-a-scheduler-process-goes",
        ("sglang.srt.managers.scheduler",),
        "drain_writers_at_exit",
    ),
    PatchMarker(
        "name-each-data-parallel-replicas-manifest",
        ("sglang.srt.managers.scheduler",),
        "set_data_parallel_rank",
        upstream_module="sglang.srt.runtime_context",  # its Parallel.dp_rank
    ),
    PatchMarker(
        "refuse-requests-with-malformed-dump-params",
        ("sglang.srt.managers.scheduler",),
        "dump_params_error",
    ),
)


def check_patches(markers=PATCH_MARKERS) -> None:
    """Refuse to dump from a tree that lacks a patch the dump relies on."""
    missing = [
        f"{marker.patch} (no call to {marker.helper} in {' or '.join(marker.modules)})"
        for marker in markers
        if release_needs_patch(marker) and not any(
            marker.helper in names_called_by(module) for module in marker.modules
        )
    ]
    if missing:
        raise ValueError(
            "SGLANG_HS_DUMP_DIR is set, but this SGLang tree lacks series patches the "
            "hidden states dump relies on: " + "; ".join(missing) + ". Apply the whole "
            "series (make apply)."
        )


def release_needs_patch(marker: PatchMarker) -> bool:
    """Whether this release needs the patch: it has the feature the patch hooks into, and
    does not do the patch's work upstream."""
    if marker.upstream_module is not None and module_exists(marker.upstream_module):
        return False
    return marker.feature_module is None or module_exists(marker.feature_module)


def module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def prefill_graphs_run_dumps_eagerly() -> bool:
    """Whether this release has prefill CUDA graphs that leave dumped prefills eager (the
    patch's marker is checked by check_patches); older releases replay a piecewise
    graph, which runs no hook."""
    marker = next(m for m in PATCH_MARKERS if m.helper == "holds_dumped_request")
    return release_needs_patch(marker)


def names_called_by(module_name: str) -> Set[str]:
    """Every global and attribute name the functions and methods of a module use."""
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError:
        return set()
    names = set()
    for code in _code_objects(module):
        names.update(code.co_names)
    return names


def _code_objects(module) -> Iterator[types.CodeType]:
    stack = []
    for value in vars(module).values():
        if inspect.isfunction(value) and value.__module__ == module.__name__:
            stack.append(value.__code__)
        elif inspect.isclass(value) and value.__module__ == module.__name__:
            for member in vars(value).values():
                function = getattr(member, "__func__", member)  # staticmethod, classmethod
                if inspect.isfunction(function):
                    stack.append(function.__code__)
    while stack:
        code = stack.pop()
        yield code
        stack.extend(const for const in code.co_consts if isinstance(const, types.CodeType))


def check_server_args(server_args) -> None:
    """Refuse the configurations in which a dump would be incomplete or wrong."""
    refusals = []
    if server_args.pp_size > 1:
        refusals.append(
            "pipeline parallelism (--pp-size > 1): each stage only runs its own layers "
            "and aux hidden states are not passed between stages"
        )
    if server_args.speculative_algorithm is not None:
        refusals.append(
            "speculative decoding: it sets its own layers to capture on the target model"
        )
    if getattr(server_args, "enable_return_aux_hidden_states", False):
        refusals.append(
            "--enable-return-aux-hidden-states: it sets its own layers to capture "
            "(--return-aux-hidden-state-layer-ids) on the model"
        )
    if server_args.enable_two_batch_overlap:
        refusals.append(
            "--enable-two-batch-overlap: its overlapped layers run without the capture"
        )
    if (
        getattr(server_args, "enable_piecewise_cuda_graph", False)
        and not prefill_graphs_run_dumps_eagerly()
    ):
        refusals.append(
            "--enable-piecewise-cuda-graph: a replayed prefill does not run the dump hook"
        )
    if refusals:
        raise ValueError(
            "SGLANG_HS_DUMP_DIR is set, but the hidden states dump does not support "
            + "; ".join(refusals)
            + "."
        )
