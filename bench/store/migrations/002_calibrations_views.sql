-- 002: fitted calibrations, and the views the app reads.

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

-- runs plus GiB columns (GiB = 2**30 bytes = 1073741824) and a model family for grouping:
-- family = lower(model_type) without a trailing _moe/_text/_vl and without its version digits
-- ('qwen2_moe' -> 'qwen', 'deepseek_v3' -> 'deepseek', 'llama' -> 'llama').
-- A plain projection of runs, no join: that keeps ORDER BY created_at ... LIMIT able to skip row
-- groups by their min/max created_at (a join against the distinct model types defeated it, 10x slower).
CREATE VIEW v_runs AS
SELECT
    r.*,
    r.peak_alloc_bytes / 1073741824      AS peak_alloc_gib,
    r.peak_reserved_bytes / 1073741824   AS peak_reserved_gib,
    r.nvml_used_bytes / 1073741824       AS nvml_used_gib,
    r.gpu_total_bytes / 1073741824       AS gpu_total_gib,
    coalesce(
        nullif(regexp_replace(regexp_replace(lower(r.model_type), '_(moe|text|vl)$', ''), '(_v)?[0-9._]+$', ''), ''),
        r.model_type)                    AS family
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
