-- The published tier: numbers framework authors measured on GPUs and published (bench/published/importer.py, data/published).
-- What was measured (metric, unit as published, per GPU), where it was published (repository, section, version,
-- link, reliability), how it was mapped into the workload (status, reason, each field's origin), and the published
-- value itself in bytes whatever its metric (allocated values also fill peak_alloc_bytes, reserved values
-- peak_reserved_bytes; the others only published_value_bytes, so nothing is mislabelled). Also the workload's
-- CPU offload (Parallel.offload), which published ZeRO-3/FSDP offload runs use. NULL for traced and measured rows.
ALTER TABLE runs ADD COLUMN offload VARCHAR;
ALTER TABLE runs ADD COLUMN published_id VARCHAR;
ALTER TABLE runs ADD COLUMN metric VARCHAR;
ALTER TABLE runs ADD COLUMN measured_unit VARCHAR;
ALTER TABLE runs ADD COLUMN per_gpu BOOLEAN;
ALTER TABLE runs ADD COLUMN published_value_bytes BIGINT;  -- >= 0, checked by bench/store/validate.py
ALTER TABLE runs ADD COLUMN reliability VARCHAR;
ALTER TABLE runs ADD COLUMN source_repo VARCHAR;
ALTER TABLE runs ADD COLUMN source_section VARCHAR;
ALTER TABLE runs ADD COLUMN source_version VARCHAR;
ALTER TABLE runs ADD COLUMN source_url VARCHAR;
ALTER TABLE runs ADD COLUMN mapping_status VARCHAR;
ALTER TABLE runs ADD COLUMN mapping_reason VARCHAR;
ALTER TABLE runs ADD COLUMN field_origins JSON;

-- v_runs expands r.* when it is created: create it again so that it carries the new columns.
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
