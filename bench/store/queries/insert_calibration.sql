-- Store one calibration. The id hashes its content and created_at, so only an exact repeat is skipped.
INSERT INTO calibrations (
    calibration_id, architecture, attention, checkpointing, k, k_ci_low, k_ci_high, r2,
    residual_std_bytes, n_points, run_ids, method, params_json, created_at)
VALUES (
    $calibration_id, $architecture, $attention, $checkpointing, $k, $k_ci_low, $k_ci_high, $r2,
    $residual_std_bytes, $n_points, $run_ids, $method, $params_json, $created_at)
ON CONFLICT (calibration_id) DO NOTHING;
