"""What every stage uses: cache folders, content hashing, provenance (versions, hardware), the time
and memory meter, model loading, and the results store."""
