"""Hand-written FastAPI servers that scriptserve is measured against (run under uvicorn)."""
