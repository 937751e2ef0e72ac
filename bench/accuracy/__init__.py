"""How good the estimate is: the report against traced, measured and published rows (`report`, `published`) and
the activation-constant calibration (`calibrate`)."""
