"""The request path: the data plane and what it decides (admission, deadlines, in-flight
counts), dynamic batching, and answers in parts."""
