-- Every published run with what the published accuracy tier and the Benchmarks page read.
SELECT *
FROM runs
WHERE source = 'published'
ORDER BY published_id;
