-- Which runs the pulled file carried (the registered Arrow table `incoming_runs`): dataset, file.
INSERT INTO pulled_runs (dataset, file, run_id)
SELECT DISTINCT ?, ?, i.run_id FROM incoming_runs AS i;
