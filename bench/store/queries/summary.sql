-- The overview table: run counts by source, GPU, model, mode, method and OOM, largest groups first.
SELECT *
FROM v_summary
ORDER BY n_runs DESC, source, gpu_name, model_name, mode, method, oom;
