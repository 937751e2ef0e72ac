-- The Benchmarks table: the filtered runs, newest first, with the columns a reader scans (no JSON blobs).
-- Byte columns stay integer bytes; GiB = 2**30 = 1073741824 bytes is applied here only for display.
-- bench/app_data.py replaces /*filters*/ (bench.db.filter_clause); the last parameter is the row limit.
SELECT
    run_id, source, created_at, gpu_name, gpu_count, model_name, model_type, params,
    mode, method, lora_rank, recipe, precision, weight_format, optimizer, batch, seq, gen_tokens, grad_accum,
    checkpointing, attention, strategy, world_size,
    peak_alloc_bytes / 1073741824      AS peak_alloc_gib,
    peak_reserved_bytes / 1073741824   AS peak_reserved_gib,
    nvml_used_bytes / 1073741824       AS nvml_used_gib,
    gpu_total_bytes / 1073741824       AS gpu_total_gib,
    oom, oom_stage, contributor
FROM runs
WHERE TRUE /*filters*/
ORDER BY created_at DESC, run_id
LIMIT ?;
