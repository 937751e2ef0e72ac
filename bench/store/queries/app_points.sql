-- Measured, traced and (mapped) published runs of one model on the two curves through one workload, for the Curves and Multi-GPU
-- charts: parameters 1-2 name the model (its config.json hash, or its preset name), 3-4 the workload's batch
-- and seq (a run is on the batch curve if its seq matches, on the seq curve if its batch does).
-- bench/store/app_data.py replaces /*filters*/ (bench.store.db.filter_clause); the last parameter is the row limit.
SELECT
    run_id, source, created_at, gpu_name, gpu_total_bytes, model_name, model_type,
    mode, method, lora_rank, lora_targets, recipe, precision, weight_format, optimizer, optimizer_impl,
    batch, seq, gen_tokens, grad_accum, checkpointing, attention, kv_dtype, strategy, world_size,
    peak_alloc_bytes, peak_reserved_bytes, nvml_used_bytes, oom, oom_stage,
    coalesce(metric, 'allocated') AS metric, coalesce(published_value_bytes, peak_alloc_bytes) AS value_bytes,
    coalesce(source_repo, '') AS source_repo, published_id
FROM runs
WHERE (source IN ('measured', 'traced') OR (source = 'published' AND mapping_status <> 'unmapped'))
  AND (config_hash = ? OR model_name = ?)
  AND (batch = ? OR seq = ?) /*filters*/
ORDER BY batch, seq, world_size, source, created_at DESC, run_id
LIMIT ?;
