-- The Benchmarks table: the filtered runs, newest first, with the columns a reader scans (no JSON blobs): what was
-- run and on which GPU first, the measured number and its metric, the source link; the run_id last.
-- Byte columns stay integer bytes; GiB = 2**30 = 1073741824 bytes is applied here only for display.
-- bench/store/app_data.py replaces /*filters*/ (bench.store.db.filter_clause); the last parameter is the row limit.
SELECT
    model_name, gpu_name, source,
    concat_ws(' ', mode, method, recipe, precision, 'b=' || batch, 's=' || seq,
              CASE WHEN gen_tokens > 0 THEN '+' || gen_tokens || ' gen' END,
              CASE WHEN checkpointing IS NOT NULL AND checkpointing <> 'none' THEN 'ckpt=' || checkpointing END,
              CASE WHEN strategy <> 'single' THEN strategy || ' x' || world_size END) AS workload,
    coalesce(published_value_bytes, peak_alloc_bytes) / 1073741824 AS measured_gib,
    coalesce(published_value_bytes, peak_alloc_bytes) / 1e9         AS measured_gb,
    coalesce(metric, CASE WHEN peak_alloc_bytes IS NOT NULL THEN 'allocated' END) AS metric,
    reliability, mapping_status, source_url,
    peak_alloc_bytes / 1073741824      AS peak_alloc_gib,
    peak_reserved_bytes / 1073741824   AS peak_reserved_gib,
    nvml_used_bytes / 1073741824       AS nvml_used_gib,
    gpu_total_bytes / 1073741824       AS gpu_total_gib,
    gpu_count, model_type, params, mode, method, lora_rank, recipe, precision, weight_format, optimizer, batch, seq,
    gen_tokens, grad_accum, checkpointing, attention, strategy, world_size,
    oom, oom_stage, contributor, published_id, created_at, run_id
FROM runs
WHERE TRUE /*filters*/
ORDER BY created_at DESC, run_id
LIMIT ?;
