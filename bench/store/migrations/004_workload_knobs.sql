-- The recipe knobs people turn (chunked loss, optimizer in backward, activation offload, QLoRA scope, float8,
-- compile), what the training loop keeps alive, the tracer's kernel choice and a measured run's allocator
-- settings. NULL in rows written before them: those ran with the defaults (loss-only loop, full loss, ...).
ALTER TABLE runs ADD COLUMN loop VARCHAR;
ALTER TABLE runs ADD COLUMN loss VARCHAR;
ALTER TABLE runs ADD COLUMN loss_chunks BIGINT;  -- >= 1, checked by bench/store/validate.py (DuckDB cannot add a CHECK)
ALTER TABLE runs ADD COLUMN optimizer_in_backward BOOLEAN;
ALTER TABLE runs ADD COLUMN activation_offload BOOLEAN;
ALTER TABLE runs ADD COLUMN quantize_scope VARCHAR;
ALTER TABLE runs ADD COLUMN double_quant BOOLEAN;
ALTER TABLE runs ADD COLUMN float8 BOOLEAN;
ALTER TABLE runs ADD COLUMN compile BOOLEAN;
ALTER TABLE runs ADD COLUMN kernels VARCHAR;
ALTER TABLE runs ADD COLUMN alloc_conf VARCHAR;

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
