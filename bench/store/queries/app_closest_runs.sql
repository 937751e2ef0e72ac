-- Runs nearest one workload of one model, for "closest runs in the database" ($sources: measured and traced)
-- and "closest published run" ($sources: published; mapped or partial rows only).
-- Same model: the same config.json (config_hash), or the same preset name. Nearness: first the number of
-- differing workload settings, then the distance in doublings (log2) of batch, sequence length and GPU count.
-- Named parameters; every value is bound.
SELECT
    run_id, source, created_at, gpu_name, gpu_total_bytes, model_name, model_type,
    mode, method, lora_rank, lora_targets, recipe, precision, weight_format, optimizer, optimizer_impl,
    batch, seq, gen_tokens, grad_accum, checkpointing, attention, kv_dtype, strategy, world_size,
    peak_alloc_bytes, peak_reserved_bytes, nvml_used_bytes, oom, oom_stage,
    metric, published_value_bytes, published_id, source_repo, source_url, reliability, mapping_status, config_json,
    lora_targets, offload, loss, loss_chunks, optimizer_in_backward, activation_offload, quantize_scope,
    double_quant, compile,
    (method <> $method)::INTEGER + (recipe <> $recipe)::INTEGER + (precision <> $precision)::INTEGER
      + (coalesce(weight_format, 'auto') <> $weight_format)::INTEGER
      + (coalesce(optimizer, 'adamw') <> $optimizer)::INTEGER
      + (coalesce(checkpointing, 'none') <> $checkpointing)::INTEGER
      + (coalesce(attention, 'sdpa') <> $attention)::INTEGER
      + (strategy <> $strategy)::INTEGER                              AS n_differences,
    abs(log2(batch) - log2($batch)) + abs(log2(seq) - log2($seq))
      + abs(log2(world_size) - log2($gpus))                           AS doublings
FROM runs
WHERE list_contains($sources, source) AND coalesce(mapping_status, '') <> 'unmapped'
  AND (config_hash = $config_hash OR model_name = $model_name)
  AND mode = $mode
ORDER BY n_differences, doublings, source, created_at DESC, run_id
LIMIT $limit;
