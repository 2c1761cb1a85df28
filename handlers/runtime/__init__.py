"""What every part of scriptserve needs to run a model, below all of them: a model's signature
and its datatypes (`signature.py`), JSON tensors read straight into numpy (`json_numbers.py`) and
the AOTInductor runtime's C ABI (`aoti.py`).

The request path uses these on every request (the codecs, the handlers, the `.pt2` backend) and
the archiver uses them to read samples and check the packages it builds, so they import nothing
of scriptserve outside this package: the import-linter contracts in `pyproject.toml` say so.
"""
