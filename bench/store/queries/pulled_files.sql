-- The contribution files already pulled from one dataset, with the sha256 each was pulled at.
SELECT file, sha256 FROM pulls WHERE dataset = ?;
