-- v_runs.family now uses the estimator's families (estimator/model.py FAMILIES), the same grouping the
-- activation constant k is fitted and stored under, so a family filter in the app and a calibration agree.
-- Model types the estimator does not know keep 002's fallback (lower(model_type) without version digits).
-- tests/test_db.py checks this CASE against FAMILIES.
CREATE OR REPLACE VIEW v_runs AS
SELECT
    r.*,
    r.peak_alloc_bytes / 1073741824      AS peak_alloc_gib,
    r.peak_reserved_bytes / 1073741824   AS peak_reserved_gib,
    r.nvml_used_bytes / 1073741824       AS nvml_used_gib,
    r.gpu_total_bytes / 1073741824       AS gpu_total_gib,
    CASE r.model_type
        WHEN 'bert' THEN 'bert'
        WHEN 'deepseek_v2' THEN 'deepseek'
        WHEN 'deepseek_v3' THEN 'deepseek'
        WHEN 'falcon' THEN 'falcon'
        WHEN 'gemma' THEN 'gemma'
        WHEN 'gemma2' THEN 'gemma'
        WHEN 'gpt2' THEN 'gpt2'
        WHEN 'gpt_neox' THEN 'gpt_neox'
        WHEN 'llama' THEN 'llama'
        WHEN 'mistral' THEN 'llama'
        WHEN 'mixtral' THEN 'moe'
        WHEN 'opt' THEN 'opt'
        WHEN 'phi3' THEN 'llama'
        WHEN 'qwen2' THEN 'llama'
        WHEN 'qwen2_moe' THEN 'moe'
        WHEN 'qwen3' THEN 'llama'
        WHEN 'qwen3_moe' THEN 'moe'
        ELSE coalesce(
            nullif(regexp_replace(regexp_replace(lower(r.model_type), '_(moe|text|vl)$', ''), '(_v)?[0-9._]+$', ''), ''),
            r.model_type)
    END                                  AS family
FROM runs AS r;
