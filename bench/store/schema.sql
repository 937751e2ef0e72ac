-- The current full schema of data/benchmarks.duckdb, for reading and docs.
-- It is NOT what creates the database: bench/store/db.py applies bench/store/migrations/NNN_*.sql in order and
-- records each in schema_migrations. tests/test_db.py checks that this file, run on an empty
-- database, gives exactly the schema the migrations give; change both together (a new migration
-- for the change, and its final form here).

-- The migrations ledger (created by bench/store/db.py:migrate before any migration runs).
CREATE TABLE IF NOT EXISTS schema_migrations (
    version    INTEGER   PRIMARY KEY,  -- NNN of the migration file
    name       VARCHAR   NOT NULL,     -- the rest of its file name, e.g. 'init'
    applied_at TIMESTAMP NOT NULL      -- UTC
);

-- runs (from migration 001): one row per traced / measured / published run; columns mirror
-- bench.store.rows.COLUMNS (text -> VARCHAR, int/bytes -> BIGINT, float -> DOUBLE, bool -> BOOLEAN,
-- json -> JSON, timestamp -> TIMESTAMP in UTC). Workload enums are checked by bench/store/validate.py.
CREATE TABLE runs (
    run_id                        VARCHAR   NOT NULL PRIMARY KEY,
    source                        VARCHAR   NOT NULL CHECK (source IN ('measured', 'traced', 'published')),
    created_at                    TIMESTAMP NOT NULL,
    contributor                   VARCHAR,
    tool_version                  VARCHAR,
    gpu_name                      VARCHAR,
    gpu_total_bytes               BIGINT    CHECK (gpu_total_bytes >= 0),
    gpu_count                     BIGINT    NOT NULL CHECK (gpu_count >= 1),
    driver_version                VARCHAR,
    cuda_version                  VARCHAR,
    torch_version                 VARCHAR   NOT NULL,
    transformers_version          VARCHAR,
    python_version                VARCHAR,
    model_name                    VARCHAR   NOT NULL,
    model_type                    VARCHAR   NOT NULL,
    params                        BIGINT    NOT NULL CHECK (params >= 1),
    trainable_params              BIGINT    CHECK (trainable_params >= 0),
    config_hash                   VARCHAR   NOT NULL,
    config_json                   JSON,
    mode                          VARCHAR   NOT NULL,
    method                        VARCHAR   NOT NULL,
    lora_rank                     BIGINT,
    lora_targets                  VARCHAR,
    recipe                        VARCHAR   NOT NULL,
    precision                     VARCHAR   NOT NULL,
    weight_format                 VARCHAR,
    optimizer                     VARCHAR,
    optimizer_impl                VARCHAR,
    batch                         BIGINT    NOT NULL CHECK (batch >= 1),
    seq                           BIGINT    NOT NULL CHECK (seq >= 1),
    gen_tokens                    BIGINT,
    grad_accum                    BIGINT,
    checkpointing                 VARCHAR,
    attention                     VARCHAR,
    kv_dtype                      VARCHAR,
    strategy                      VARCHAR   NOT NULL,
    world_size                    BIGINT    NOT NULL CHECK (world_size >= 1),
    load_peak_alloc_bytes         BIGINT    CHECK (load_peak_alloc_bytes >= 0),
    load_peak_reserved_bytes      BIGINT    CHECK (load_peak_reserved_bytes >= 0),
    forward_peak_alloc_bytes      BIGINT    CHECK (forward_peak_alloc_bytes >= 0),
    forward_peak_reserved_bytes   BIGINT    CHECK (forward_peak_reserved_bytes >= 0),
    backward_peak_alloc_bytes     BIGINT    CHECK (backward_peak_alloc_bytes >= 0),
    backward_peak_reserved_bytes  BIGINT    CHECK (backward_peak_reserved_bytes >= 0),
    optimizer_peak_alloc_bytes    BIGINT    CHECK (optimizer_peak_alloc_bytes >= 0),
    optimizer_peak_reserved_bytes BIGINT    CHECK (optimizer_peak_reserved_bytes >= 0),
    prefill_peak_alloc_bytes      BIGINT    CHECK (prefill_peak_alloc_bytes >= 0),
    prefill_peak_reserved_bytes   BIGINT    CHECK (prefill_peak_reserved_bytes >= 0),
    decode_peak_alloc_bytes       BIGINT    CHECK (decode_peak_alloc_bytes >= 0),
    decode_peak_reserved_bytes    BIGINT    CHECK (decode_peak_reserved_bytes >= 0),
    peak_alloc_bytes              BIGINT    CHECK (peak_alloc_bytes >= 0),
    peak_reserved_bytes           BIGINT    CHECK (peak_reserved_bytes >= 0),
    nvml_used_bytes               BIGINT    CHECK (nvml_used_bytes >= 0),
    cuda_context_bytes            BIGINT    CHECK (cuda_context_bytes >= 0),
    oom                           BOOLEAN   NOT NULL,
    oom_stage                     VARCHAR,
    oom_message                   VARCHAR,
    step_time_s                   DOUBLE    CHECK (step_time_s >= 0),
    breakdown_json                JSON,
    per_rank_json                 JSON,
    notes                         VARCHAR,
    -- from migration 004: workload knobs, the tracer's kernels, a measured run's allocator settings
    loop                          VARCHAR,
    loss                          VARCHAR,
    loss_chunks                   BIGINT,   -- >= 1 (bench/store/validate.py; an added column takes no CHECK)
    optimizer_in_backward         BOOLEAN,
    activation_offload            BOOLEAN,
    quantize_scope                VARCHAR,
    double_quant                  BOOLEAN,
    float8                        BOOLEAN,
    compile                       BOOLEAN,
    kernels                       VARCHAR,
    alloc_conf                    VARCHAR,
    -- from migration 005: the published tier (bench/published/importer.py) and the workload's CPU offload
    offload                       VARCHAR,
    published_id                  VARCHAR,
    metric                        VARCHAR,
    measured_unit                 VARCHAR,
    per_gpu                       BOOLEAN,
    published_value_bytes         BIGINT,   -- >= 0 (bench/store/validate.py)
    reliability                   VARCHAR,
    source_repo                   VARCHAR,
    source_section                VARCHAR,
    source_version                VARCHAR,
    source_url                    VARCHAR,
    mapping_status                VARCHAR,
    mapping_reason                VARCHAR,
    field_origins                 JSON
);

-- calibrations and the views (from migration 002).
-- One fitted calibration of the analytic activation model against stored runs, per architecture
-- (config.json model_type), attention implementation and checkpointing mode.
CREATE TABLE calibrations (
    calibration_id     VARCHAR   NOT NULL PRIMARY KEY,  -- sha256 of the canonical calibration content
    architecture       VARCHAR   NOT NULL,              -- config.json model_type, e.g. 'llama'
    attention          VARCHAR,                         -- sdpa | flash | eager; NULL = fitted over all
    checkpointing      VARCHAR,                         -- none | full | selective; NULL = fitted over all
    k                  DOUBLE    NOT NULL,              -- fitted coefficient
    k_ci_low           DOUBLE,                          -- lower bound of k's confidence interval
    k_ci_high          DOUBLE,                          -- upper bound of k's confidence interval
    r2                 DOUBLE,                          -- coefficient of determination of the fit
    residual_std_bytes DOUBLE    CHECK (residual_std_bytes >= 0),  -- std of (measured - fitted) in bytes
    n_points           BIGINT    NOT NULL CHECK (n_points >= 1),   -- runs the fit used
    run_ids            JSON      NOT NULL,              -- JSON array of the runs.run_id values used
    method             VARCHAR   NOT NULL,              -- how k was fitted, e.g. 'ols'
    params_json        JSON,                            -- other fitted parameters (context constant, allocator overhead)
    created_at         TIMESTAMP NOT NULL               -- UTC
);

-- v_runs.family now uses the estimator's families (estimator/families.py FAMILIES), the same grouping the
-- activation constant k is fitted and stored under, so a family filter in the app and a calibration agree.
-- Model types the estimator does not know keep 002's fallback (lower(model_type) without version digits).
-- tests/test_db.py checks this CASE against FAMILIES.
CREATE VIEW v_runs AS
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

-- How many runs of each kind the database holds (the app's overview table).
CREATE VIEW v_summary AS
SELECT
    source, gpu_name, model_name, mode, method, oom,
    count(*)        AS n_runs,
    max(created_at) AS last_created_at
FROM runs
GROUP BY source, gpu_name, model_name, mode, method, oom;

-- The newest calibration for each (architecture, attention, checkpointing); ties broken by id so
-- the answer is deterministic.
CREATE VIEW v_latest_calibration AS
SELECT *
FROM calibrations
QUALIFY row_number() OVER (
    PARTITION BY architecture, attention, checkpointing
    ORDER BY created_at DESC, calibration_id DESC) = 1;

-- The shared dataset (from migration 006, bench/share/): which remote contribution files `python -m bench pull`
-- brought in, and which runs each file carried. A file is recorded in the same transaction as its rows.
CREATE TABLE pulls (
    dataset   VARCHAR   NOT NULL,  -- the dataset URL pulled from (WILLITFIT_DATASET or --dataset)
    file      VARCHAR   NOT NULL,  -- contributions/<utc-timestamp>-<sha256 prefix>.parquet
    sha256    VARCHAR   NOT NULL,  -- of the file's bytes, checked against its manifest
    pulled_at TIMESTAMP NOT NULL,  -- UTC
    rows      BIGINT    NOT NULL CHECK (rows >= 0),      -- rows in the file
    inserted  BIGINT    NOT NULL CHECK (inserted >= 0),  -- of those, new to this database
    PRIMARY KEY (dataset, file)
);
CREATE TABLE pulled_runs (
    dataset VARCHAR NOT NULL,
    file    VARCHAR NOT NULL,
    run_id  VARCHAR NOT NULL,      -- runs.run_id (stored once, whichever file brought it first)
    PRIMARY KEY (dataset, file, run_id)
);
