"""The dump module's configuration: layer ids, which requests are dumped, the dump
directory, the server configurations it refuses, and the writer threads' default."""

import ctypes
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from sglang.srt.hidden_states_dump.config import check_dump_dir, default_layer_ids, parse_layer_ids
from sglang.srt.hidden_states_dump.requests import (
    DumpRequest,
    dump_params_error,
    holds_dumped_request,
    requests_to_dump,
    wants_dump,
)
from sglang.srt.hidden_states_dump.startup_checks import check_server_args
from sglang.srt.sampling.sampling_params import SamplingParams
from tests.unit.conftest import RELEASE
from tests.unit.dump_standins import start_dumper


# --- parse_layer_ids ---------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, num_layers, expected",
    [
        ("3,0,2", 4, [3, 0, 2]),
        ("0,4", 4, [0, 4]),
        ("60", 61, [60]),
        ("61,0", 61, [61, 0]),
        (" 1 , 2 ", 4, [1, 2]),
    ],
)
def test_parse_layer_ids_keeps_the_given_order(spec, num_layers, expected):
    assert parse_layer_ids(spec, num_layers) == expected


def test_parse_layer_ids_unset_gives_the_default():
    assert parse_layer_ids(None, 61) == [3, 31, 59]


@pytest.mark.parametrize(
    "spec",
    [
        "5",  # beyond L
        "0,62",
        "-1",
        "1,2,1",  # duplicate
        "3,3",
        "",  # empty
        "   ",
        "a",  # not integers
        "1.5",
        "1,,2",
        "1;2",
        "[1, 2]",
    ],
)
def test_parse_layer_ids_refuses_with_the_valid_range(spec):
    num_layers = 61 if "62" in spec else 4
    with pytest.raises(ValueError) as error:
        parse_layer_ids(spec, num_layers)
    message = str(error.value)
    assert f"L={num_layers}" in message
    assert f"0..{num_layers}" in message


# --- default_layer_ids -------------------------------------------------------------


def test_default_layer_ids_are_eagle3s():
    assert default_layer_ids(61) == [3, 31, 59]


@pytest.mark.parametrize("num_layers", range(1, 9))
def test_default_layer_ids_of_shallow_models_are_valid(num_layers):
    ids = default_layer_ids(num_layers)

    assert ids == sorted(set(ids))
    assert all(0 <= i <= num_layers for i in ids)
    assert parse_layer_ids(",".join(map(str, ids)), num_layers) == ids


# --- wants_dump / requests_to_dump -------------------------------------------------


def make_req(rid, prompt=(1, 2, 3), output_ids=()):
    # Imported here, not at the top: schedule_batch takes seconds to import, which the
    # child process of the full-disk test would pay for nothing.
    from sglang.srt.managers.schedule_batch import Req

    req = Req(rid, "", list(prompt), SamplingParams(max_new_tokens=4))
    req.output_ids.extend(output_ids)
    return req


@pytest.mark.parametrize(
    "rid, output_ids, dumped",
    [
        ("client-1", (), True),
        ("WARMUP_1700000000.0", (), False),
        ("HEALTH_CHECK_1700000000", (), False),
        ("HEALTH_CHECK", (), False),
        ("x-WARMUP_1", (), True),  # only a prefix marks the server's own requests
        ("warmup_1", (), True),
        # A retracted request prefills again, with the tokens it had generated.
        ("client-2", (7, 8), False),
    ],
)
def test_wants_dump(rid, output_ids, dumped):
    assert wants_dump(make_req(rid, output_ids=output_ids)) is dumped


@pytest.mark.parametrize(
    "custom_params, dumped",
    [
        (None, True),
        ({}, True),
        ({"hidden_states_dump": True}, True),
        ({"hidden_states_dump": False}, False),
        ({"private": True}, False),
        ({"private": "yes"}, False),  # read loosely: toward privacy
        ({"private": True, "hidden_states_dump": True}, False),  # private wins
        ({"private": False}, True),
    ],
)
def test_a_request_that_declines_the_dump_is_not_dumped(custom_params, dumped):
    from sglang.srt.managers.schedule_batch import Req

    req = Req("client-1", "", [1, 2, 3], SamplingParams(max_new_tokens=4, custom_params=custom_params))
    assert wants_dump(req) is dumped


@pytest.mark.parametrize(
    "custom_params, refused_for",
    [
        (None, None),
        ({}, None),
        ({"hidden_states_dump": True, "hidden_states_dump_answer": False}, None),
        ({"private": "yes"}, None),  # read loosely, toward privacy: any true value
        ({"some_logit_processor_param": "x"}, None),  # not the dump's
        ({"hidden_states_dump_loss_mask": [0, 3, 2]}, None),
        ("hidden_states_dump", 'sampling_params.custom_params must be a JSON object for the hidden '
                               'states dump (such as {"hidden_states_dump": true}), not "hidden_states_dump"'),
        (["hidden_states_dump"], "sampling_params.custom_params must be a JSON object"),
        ({"hidden_states_dump": "false"},
         'sampling_params.custom_params.hidden_states_dump must be true or false (a JSON boolean), not "false"'),
        ({"hidden_states_dump": None}, "custom_params.hidden_states_dump must be true or false"),
        ({"hidden_states_dump": 0}, "custom_params.hidden_states_dump must be true or false"),
        ({"hidden_states_dump_answer": "true"}, 'custom_params.hidden_states_dump_answer must be true or false'),
        ({"hidden_states_dump_answer": 1}, "custom_params.hidden_states_dump_answer must be true or false"),
        ({"hidden_states_dump_loss_mask": "all"}, "custom_params.hidden_states_dump_loss_mask must be a list"),
        ({"hidden_states_dump_loss_mask": [2, -1]}, "custom_params.hidden_states_dump_loss_mask must be a list"),
        ({"hidden_states_dump_loss_mask": [2, True]}, "custom_params.hidden_states_dump_loss_mask must be a list"),
        ({"hidden_states_dump_loss_mask": [2.0]}, "custom_params.hidden_states_dump_loss_mask must be a list"),
    ],
)
def test_dump_params_that_are_not_what_the_dump_documents_refuse_the_request(dumping_on, custom_params, refused_for):
    """A malformed field is refused, naming it, never read as a choice (the string "false" is
    true): the scheduler aborts the request before anything is dumped."""
    from sglang.srt.managers.schedule_batch import Req

    req = Req("client-1", "", [1, 2, 3], SamplingParams(max_new_tokens=4, custom_params=custom_params))
    error = dump_params_error(req)
    if refused_for is None:
        assert error is None
    else:
        assert refused_for in (error or ""), error


def test_with_dumping_off_no_dump_params_are_refused():
    from sglang.srt.hidden_states_dump.config import dump_enabled
    from sglang.srt.managers.schedule_batch import Req

    dump_enabled.cache_clear()
    req = Req("client-1", "", [1, 2, 3], SamplingParams(max_new_tokens=4, custom_params="hidden_states_dump"))
    assert dump_params_error(req) is None


def test_an_aborted_request_is_not_dumped():
    # An abort takes effect only after the prefill it arrived during.
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    req = make_req("client-1")
    req.to_finish = FINISH_ABORT("client went away")

    assert not wants_dump(req)


def test_a_finished_request_is_not_dumped():
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH

    req = make_req("client-1")
    req.finished_reason = FINISH_LENGTH(length=0)

    assert not wants_dump(req)


def test_requests_to_dump_follows_the_batch_order(dumping_on):
    reqs = [
        make_req("a", prompt=(1, 2, 3, 4)),
        make_req("WARMUP_1"),
        make_req("b", prompt=(5,)),
        make_req("c", output_ids=(9,)),
        make_req("HEALTH_CHECK_2"),
    ]

    assert requests_to_dump(reqs) == [
        DumpRequest("a", 4),
        None,
        DumpRequest("b", 1),
        None,
        None,
    ]


def test_with_dumping_off_no_batch_carries_requests_to_dump():
    from sglang.srt.hidden_states_dump.config import dump_enabled

    dump_enabled.cache_clear()
    assert requests_to_dump([make_req("a")]) is None
    assert requests_to_dump([make_req("a")], is_extend=False) is None
    assert not holds_dumped_request(requests_to_dump([make_req("a")]))


def test_a_decode_batch_carries_no_request_to_dump(dumping_on):
    assert requests_to_dump([make_req("a"), make_req("b")], is_extend=False) == []


def test_only_a_forward_that_dumps_a_request_captures_layers():
    from types import SimpleNamespace

    from sglang.srt.hidden_states_dump.capture import layers_captured_in

    layers = [3, 5, 6]

    def captured(requests):
        return layers_captured_in(SimpleNamespace(hidden_states_dump_requests=requests), layers)

    # Dumping off: whoever set the layers (EAGLE-3 serving) captures them in every forward.
    assert captured(None) == layers
    # Dumping on: a decode step, and a prefill of requests none of which is dumped, capture nothing.
    assert captured([]) == ()
    assert captured([None, None]) == ()
    assert captured([None, DumpRequest("a", 3)]) == layers


# --- check_dump_dir / check_server_args --------------------------------------------


def test_check_dump_dir_creates_a_missing_directory(tmp_path):
    dump_dir = tmp_path / "a" / "b"
    check_dump_dir(str(dump_dir))

    assert dump_dir.is_dir()
    assert list(dump_dir.iterdir()) == []


def test_check_dump_dir_refuses_a_path_below_a_file(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="not a writable directory"):
        check_dump_dir(str(tmp_path / "file" / "dump"))


def test_check_dump_dir_refuses_a_file(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="not a writable directory"):
        check_dump_dir(str(tmp_path / "file"))


def test_check_dump_dir_refuses_a_path_no_one_can_create():
    # procfs refuses new directories, also to root.
    with pytest.raises(ValueError, match="not a writable directory"):
        check_dump_dir("/proc/hidden-states-dump")


CAP_DAC_OVERRIDE = 1  # linux/capability.h
PR_CAPBSET_DROP = 24  # linux/prctl.h


def without_dac_override():
    """Run in the child between fork and exec: drop CAP_DAC_OVERRIDE from the bounding set,
    so the program it executes as root lacks it and obeys permission bits (what a non-root
    process does anyway). Needs CAP_SETPCAP, which root holds also in a container."""
    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_CAPBSET_DROP, CAP_DAC_OVERRIDE, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP, CAP_DAC_OVERRIDE)")


# In one child (importing SGLang takes seconds): the check on the directory as the parent left
# it, then, made writable by its owner, the same check again. Exit 3: the first check passed.
CHECK_TWICE = """
import os, sys
from sglang.srt.hidden_states_dump.config import check_dump_dir
try:
    check_dump_dir(sys.argv[1])
except ValueError as e:
    print("refused:", e, file=sys.stderr)
else:
    sys.exit(3)
os.chmod(sys.argv[1], 0o700)
check_dump_dir(sys.argv[1])
"""


def test_check_dump_dir_refuses_a_read_only_directory(tmp_path):
    """Root writes to a read-only directory by CAP_DAC_OVERRIDE: the check runs in a child
    that does not hold it, as root (CI) or not. The same child accepts the directory once it
    is writable, so the refusal is the directory's mode and nothing else."""
    tmp_path.chmod(0o500)
    try:
        child = subprocess.run(
            [sys.executable, "-c", CHECK_TWICE, str(tmp_path)],
            env=dict(os.environ, PYTHONPATH=os.environ["SGLANG_CHECKOUT"]),
            preexec_fn=without_dac_override, capture_output=True, text=True, timeout=120,
        )
    finally:
        tmp_path.chmod(0o700)
    assert child.returncode != 3, "the read-only directory was accepted"
    assert child.returncode == 0, child.stderr[-3000:]
    assert "refused:" in child.stderr and "is not a writable directory" in child.stderr \
        and "Permission denied" in child.stderr, child.stderr[-3000:]
    assert os.listdir(tmp_path) == []


def server_args(**overrides):
    plain = dict(
        pp_size=1,
        speculative_algorithm=None,
        enable_two_batch_overlap=False,
        enable_piecewise_cuda_graph=False,
    )
    return SimpleNamespace(**{**plain, **overrides})


def test_check_server_args_accepts_a_plain_config():
    check_server_args(server_args())
    check_server_args(server_args(tp_size=8, dp_size=2, enable_dp_attention=True))


# 0.5.9's piecewise CUDA graph replays prefills without the dump hook, so it is refused;
# 0.5.14 has no such flag: its prefill graphs decline batches with dumped requests.
REFUSALS = [
    (dict(pp_size=2), "--pp-size"),
    (dict(speculative_algorithm="EAGLE3"), "speculative decoding"),
    (dict(enable_two_batch_overlap=True), "--enable-two-batch-overlap"),
] + ([(dict(enable_piecewise_cuda_graph=True), "--enable-piecewise-cuda-graph")] if RELEASE < (0, 5, 14) else [])


@pytest.mark.parametrize("overrides, named", REFUSALS)
def test_check_server_args_refuses(overrides, named):
    with pytest.raises(ValueError, match="SGLANG_HS_DUMP_DIR") as error:
        check_server_args(server_args(**overrides))
    assert named in str(error.value)


def test_check_server_args_names_every_refusal():
    with pytest.raises(ValueError) as error:
        check_server_args(server_args(**{k: v for overrides, _ in REFUSALS for k, v in overrides.items()}))
    for _, named in REFUSALS:
        assert named in str(error.value)


@pytest.mark.parametrize("writer_process, cores, threads", [
    (True, 2, 4), (True, 16, 8), (True, 32, 16), (True, 256, 16),
    (False, 2, 4), (False, 16, 4), (False, 32, 8), (False, 64, 16), (False, 256, 16)])
def test_writer_threads_unset_come_from_the_hosts_cores(dump_dir, monkeypatch, caplog, writer_process, cores,
                                                        threads):
    # Every release declares the variable with 0 (from the host's cores) as its default.
    monkeypatch.delenv("SGLANG_HS_DUMP_WRITER_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    with caplog.at_level("INFO", logger="sglang.srt.hidden_states_dump"):
        start_dumper(dump_dir, [1], writer_process=writer_process)
    assert f"writer_threads={threads} writer_process={'on' if writer_process else 'off'}" in caplog.text


# --- the patch markers ----------------------------------------------------------


def test_the_whole_series_leaves_every_marker_the_dump_checks():
    from sglang.srt.hidden_states_dump.startup_checks import check_patches

    check_patches()


def test_a_marker_no_module_calls_names_its_patch():
    from sglang.srt.hidden_states_dump.startup_checks import PATCH_MARKERS, PatchMarker, check_patches

    absent = PatchMarker("some-patch", PATCH_MARKERS[0].modules, "a_helper_nobody_calls")
    with pytest.raises(ValueError, match=r"lacks series patches the hidden states dump relies on: some-patch \(no call to a_helper_nobody_calls"):
        check_patches((*PATCH_MARKERS, absent))


@pytest.mark.parametrize("value", ["0", "64"])
def test_host_memory_is_read_once_from_the_environment(dump_dir, monkeypatch, value):
    from sglang.srt.hidden_states_dump.config import DumpConfig

    monkeypatch.setenv("SGLANG_HS_DUMP_DIR", str(dump_dir))
    monkeypatch.setenv("SGLANG_HS_DUMP_HOST_MEMORY_MB", value)
    assert DumpConfig.from_env().host_memory_mb == int(value)  # 0: sized from the server


def test_negative_host_memory_is_refused(dump_dir, monkeypatch):
    from sglang.srt.hidden_states_dump.config import DumpConfig

    monkeypatch.setenv("SGLANG_HS_DUMP_DIR", str(dump_dir))
    monkeypatch.setenv("SGLANG_HS_DUMP_HOST_MEMORY_MB", "-1")
    with pytest.raises(ValueError, match="SGLANG_HS_DUMP_HOST_MEMORY_MB must not be negative"):
        DumpConfig.from_env()


def test_a_sampled_fraction_lies_within_its_binomial_bounds():
    from sglang.srt.hidden_states_dump.config import RequestSample

    rids = [f"chatcmpl-{i:06d}" for i in range(20000)]
    for fraction in (0.01, 0.25):
        taken = {rid for rid in rids if RequestSample(fraction, seed=3).takes(rid)}
        mean, spread = len(rids) * fraction, 5 * (len(rids) * fraction * (1 - fraction)) ** 0.5
        assert mean - spread <= len(taken) <= mean + spread
        # The same seed takes the same requests, in any order, anywhere; another takes others.
        assert {rid for rid in reversed(rids) if RequestSample(fraction, seed=3).takes(rid)} == taken
        other = {rid for rid in rids if RequestSample(fraction, seed=4).takes(rid)}
        assert len(taken & other) <= mean * fraction + spread
    assert all(RequestSample(1.0, seed=3).takes(rid) for rid in rids[:100])
    assert not any(RequestSample(0.0, seed=3).takes(rid) for rid in rids[:100])


@pytest.mark.parametrize(
    "fraction, custom_params, dumped",
    [
        (0.0, None, False),  # only those that ask
        (0.0, {"hidden_states_dump": True}, True),
        (0.0, {"hidden_states_dump": True, "private": True}, False),
        (1.0, {"private": True}, False),
        (1.0, None, True),
    ],
)
def test_requests_that_ask_are_dumped_whatever_the_sample_and_private_ones_never(
    dumping_on, monkeypatch, fraction, custom_params, dumped
):
    from sglang.srt.hidden_states_dump import config
    from sglang.srt.managers.schedule_batch import Req

    config.request_sample.cache_clear()
    monkeypatch.setenv("SGLANG_HS_DUMP_SAMPLE", str(fraction))
    try:
        req = Req("client-1", "", [1, 2, 3], SamplingParams(max_new_tokens=4, custom_params=custom_params))
        assert wants_dump(req) is dumped
        (request,) = requests_to_dump([req])
        assert (request is not None) is dumped
        assert request is None or request.asked is (custom_params is not None)
    finally:
        config.request_sample.cache_clear()


@pytest.mark.parametrize(
    "variable, value, message",
    [
        ("SGLANG_HS_DUMP_SAMPLE", "-0.1", "SGLANG_HS_DUMP_SAMPLE=-0.1: give the fraction"),
        ("SGLANG_HS_DUMP_SAMPLE", "nan", "SGLANG_HS_DUMP_SAMPLE=nan: give the fraction"),
        ("SGLANG_HS_DUMP_SAMPLE_SEED", "-1", r"SGLANG_HS_DUMP_SAMPLE_SEED=-1: give an integer from 0 to 2\*\*64 - 1"),
    ],
)
def test_a_bad_sample_setting_is_refused_by_name(monkeypatch, variable, value, message):
    from sglang.srt.hidden_states_dump import config

    config.request_sample.cache_clear()
    monkeypatch.setenv(variable, value)
    try:
        with pytest.raises(ValueError, match=message):
            config.request_sample()
    finally:
        config.request_sample.cache_clear()
