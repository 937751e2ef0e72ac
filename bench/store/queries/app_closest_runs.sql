-- Runs nearest one workload of one model, for "closest runs in the database" ($sources: measured and traced)
-- and "closest published run" ($sources: published; mapped or partial rows only).
-- Same model: the same config.json (config_hash), or the same preset name. Nearness: first the number of
-- compared settings not known to match yours (those that differ, plus those that match only because willitfit
-- inferred them: a published row's field_origins says "inferred: why"), then, of two equally near, the one with
-- fewer inferred matches (stated matches first), then the distance in doublings (log2) of batch, sequence length
-- and GPU count. An inferred setting is never counted as "not differing": n_inferred_same counts them apart.
-- Named parameters; every value is bound.
WITH compared AS (
    SELECT *,
        [(method <> $method, 'method', json_extract_string(field_origins, '$.method')),
         (recipe <> $recipe, 'recipe', json_extract_string(field_origins, '$.recipe')),
         (precision <> $precision, 'precision', json_extract_string(field_origins, '$.precision')),
         (coalesce(weight_format, 'auto') <> $weight_format, 'weight_format',
            json_extract_string(field_origins, '$.weight_format')),
         (coalesce(optimizer, 'adamw') <> $optimizer, 'optimizer', json_extract_string(field_origins, '$.optimizer')),
         (coalesce(checkpointing, 'none') <> $checkpointing, 'checkpointing',
            json_extract_string(field_origins, '$.checkpointing')),
         (coalesce(attention, 'sdpa') <> $attention, 'attention', json_extract_string(field_origins, '$.attention')),
         (strategy <> $strategy, 'strategy', json_extract_string(field_origins, '$.strategy'))] AS settings
    FROM runs
    WHERE list_contains($sources, source) AND coalesce(mapping_status, '') <> 'unmapped'
      AND (config_hash = $config_hash OR model_name = $model_name)
      AND mode = $mode
), counted AS (
    SELECT *,
        len(list_filter(settings, lambda s: s[1])) AS n_differences,
        list_transform(list_filter(settings, lambda s: NOT s[1] AND starts_with(coalesce(s[3], ''), 'inferred')),
                       lambda s: s[2]) AS inferred_same
    FROM compared
)
SELECT
    run_id, source, created_at, gpu_name, gpu_total_bytes, model_name, model_type,
    mode, method, lora_rank, lora_targets, recipe, precision, weight_format, optimizer, optimizer_impl,
    batch, seq, gen_tokens, grad_accum, checkpointing, attention, kv_dtype, strategy, world_size,
    peak_alloc_bytes, peak_reserved_bytes, nvml_used_bytes, oom, oom_stage,
    metric, published_value_bytes, published_id, source_repo, source_url, reliability, mapping_status, config_json,
    lora_targets, offload, loss, loss_chunks, optimizer_in_backward, activation_offload, quantize_scope,
    double_quant, compile, field_origins,
    n_differences,
    len(inferred_same)                                                AS n_inferred_same,
    array_to_string(inferred_same, ', ')                              AS inferred_same,
    abs(log2(batch) - log2($batch)) + abs(log2(seq) - log2($seq))
      + abs(log2(world_size) - log2($gpus))                           AS doublings
FROM counted
ORDER BY n_differences + len(inferred_same), len(inferred_same), doublings, source, created_at DESC, run_id
LIMIT $limit;
