"""Dump the hidden states of every prefilled prompt to disk, for EAGLE-3 draft training.

Turned on by SGLANG_HS_DUMP_DIR. For each request, once its whole prompt has been
prefilled (chunks of a chunked prefill are stitched on the host), one safetensors file
holds its token ids, the residual stream entering each configured layer, and the final
normed state; one line per complete file goes to the writer's manifest. One source for
every release the series supports: what differs between releases is checked at startup
(startup_checks), never kept as copies.

The modules, each one concern:
    format          the files, the manifests and the log lines, and their reader
                    (imports nothing from sglang)
    config          the settings, read from the environment once
    startup_checks  the server options the dump supports, and the series patches it needs
    eagle3_layers   the ids an EAGLE-3 draft config of this release names to be fed them
    requests        which requests of a batch are dumped (the scheduler's hooks)
    capture         the model's hook on the scheduler thread: rows off the device
    host_buffers    host memory for the rows, reused across forwards
    writer          the writer: a queue of requests, files published in submission order
    files           the file protocol (standard library only), and the writer process
    process_writer  the writer's threads in a process of their own, fed from shared memory
    store_sink      the Mooncake sink (SGLANG_HS_DUMP_SINK=mooncake): the writer process
                    puts each sample in a store instead of writing a file
    store_process   that writer process: puts, hard-pinned, then manifest lines and refs
    store_layouts   what the trainers' layouts hold (SpecForge's, hs-connectors')
    store_settings  the MOONCAKE_* settings a store's clients read (standard library only)
    stats           counters and timings
    lifecycle       writing what is queued before a process goes

The hooks elsewhere stay thin: the scheduler asks `requests.requests_to_dump` which
requests of an extend batch are dumped, and the model hands its outputs to
`capture.HiddenStatesDumper.capture` after each forward.
"""
