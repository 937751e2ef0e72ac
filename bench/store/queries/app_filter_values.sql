-- The choices of the app's Benchmarks filters: every distinct value of each filter column, with its run count.
-- One scan of `runs` per column; fast enough at a million rows (bench_app.py times it).
SELECT 'source' AS col, source AS value, count(*) AS n_runs FROM runs GROUP BY source
UNION ALL SELECT 'gpu_name', gpu_name, count(*) FROM runs WHERE gpu_name IS NOT NULL GROUP BY gpu_name
UNION ALL SELECT 'model_name', model_name, count(*) FROM runs GROUP BY model_name
UNION ALL SELECT 'mode', mode, count(*) FROM runs GROUP BY mode
UNION ALL SELECT 'method', method, count(*) FROM runs GROUP BY method
UNION ALL SELECT 'precision', precision, count(*) FROM runs GROUP BY precision
UNION ALL SELECT 'metric', metric, count(*) FROM runs WHERE metric IS NOT NULL GROUP BY metric
ORDER BY col, value;
