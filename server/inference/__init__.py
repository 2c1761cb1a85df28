"""The request path: the data plane and what it decides (admission, deadlines, in-flight
counts); the batcher and the part streams it hands requests to are in `server/workers/`."""
