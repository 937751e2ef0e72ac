-- Summary counts of the filtered runs, by source: how many, how many OOM, how many GPUs and models.
-- bench/store/app_data.py replaces /*filters*/ with whitelisted `AND <column> = ?` terms (bench.store.db.filter_clause);
-- every value is a bound parameter.
SELECT
    source,
    count(*)                                  AS n_runs,
    count(*) FILTER (WHERE oom)               AS n_oom,
    count(DISTINCT gpu_name)                  AS n_gpus,
    count(DISTINCT model_name)                AS n_models,
    max(created_at)                           AS last_created_at
FROM runs
WHERE TRUE /*filters*/
GROUP BY source
ORDER BY source;
