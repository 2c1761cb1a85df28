"""`ts.utils`."""
