"""The scriptserve model archive: format, manifest, reading, writing and verification."""
