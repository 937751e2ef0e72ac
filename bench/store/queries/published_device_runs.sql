-- Published runs (source = 'published') for scripts/allocator_vs_published.py: every column, so the columns the
-- published-tier ingest adds (metric, peak_reserved_bytes, nvml_used_bytes, mapping_status, published_id) come
-- through when they exist. The one parameter is the source.
SELECT *
FROM v_runs
WHERE source = ?
ORDER BY run_id;
