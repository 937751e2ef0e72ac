"""The database: DuckDB connections and numbered migrations (`db`), the run row's columns (`rows`, the workload's from
estimator.spec's declaration), validation of untrusted rows (`validate`), ingest and export (`ingest`), the app's
read queries (`app_data`). SQL lives in `queries/*.sql`, values always bound."""
