"""`ts.handler_utils`."""
