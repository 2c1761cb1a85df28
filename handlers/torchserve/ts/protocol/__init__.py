"""`ts.protocol`."""
