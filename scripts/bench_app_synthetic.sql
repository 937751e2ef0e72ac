-- scripts/bench_app.py: grow a database of valid template runs (one per preset model, inserted through
-- bench.store.ingest) into $n synthetic runs, by varying each template along batch, seq, source, strategy and OOM.
-- Every value is derived from the row number i; run_id stays unique (sha256 of the template id and i).
-- Byte counts are made up (they scale with batch * seq), but every column keeps its type and bounds.
SET enable_progress_bar = false;  -- a script's output is a report, not a terminal animation

INSERT INTO runs
SELECT * EXCLUDE (i, n_templates, template_no) REPLACE (
    sha256(t.run_id || ':' || i::VARCHAR)                                       AS run_id,
    CASE WHEN i % 10 = 0 THEN 'measured' ELSE 'traced' END                     AS source,
    t.created_at + to_seconds(i)                                                AS created_at,
    CASE WHEN i % 10 = 0 THEN 'NVIDIA H100 80GB HBM3' ELSE 'fake-cpu' END      AS gpu_name,
    CASE WHEN i % 10 = 0 THEN 85520809984 END                                   AS gpu_total_bytes,
    CASE WHEN i % 13 = 0 THEN 2 ** (1 + i % 3) ELSE 1 END                       AS gpu_count,
    1 + (i // n_templates) % 64                                                 AS batch,
    128 * (1 + (i // (64 * n_templates)) % 64)                                  AS seq,
    CASE WHEN i % 13 = 0 THEN 'fsdp' ELSE 'single' END                          AS strategy,
    CASE WHEN i % 13 = 0 THEN 2 ** (1 + i % 3) ELSE 1 END                       AS world_size,
    NULL::BIGINT AS load_peak_alloc_bytes, NULL::BIGINT AS forward_peak_alloc_bytes,
    NULL::BIGINT AS backward_peak_alloc_bytes, NULL::BIGINT AS optimizer_peak_alloc_bytes,
    NULL::BIGINT AS load_peak_reserved_bytes, NULL::BIGINT AS forward_peak_reserved_bytes,
    NULL::BIGINT AS backward_peak_reserved_bytes, NULL::BIGINT AS optimizer_peak_reserved_bytes,
    CASE WHEN i % 97 = 0 THEN NULL
         ELSE t.peak_alloc_bytes + (1 + (i // n_templates) % 64) * 128 * (1 + (i // (64 * n_templates)) % 64) * 200000
    END                                                                         AS peak_alloc_bytes,
    CASE WHEN i % 97 = 0 THEN NULL
         ELSE t.peak_alloc_bytes + (1 + (i // n_templates) % 64) * 128 * (1 + (i // (64 * n_templates)) % 64) * 210000
    END                                                                         AS peak_reserved_bytes,
    i % 97 = 0                                                                  AS oom,
    CASE WHEN i % 97 = 0 THEN 'backward' END                                    AS oom_stage,
    NULL                                                                        AS breakdown_json
)
FROM (SELECT *, row_number() OVER (ORDER BY run_id) - 1 AS template_no, count(*) OVER () AS n_templates
      FROM runs) AS t
JOIN range($n) AS r(i) ON i % t.n_templates = t.template_no;
