"""The published tier: points.csv rows mapped to workloads with what was stated and what was inferred (`mapping`),
imported as run rows (`importer`)."""
