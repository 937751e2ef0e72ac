-- Record one pulled contribution file (same transaction as its rows): dataset, file, sha256, pulled_at, rows, inserted.
INSERT INTO pulls (dataset, file, sha256, pulled_at, rows, inserted) VALUES (?, ?, ?, ?, ?, ?);
