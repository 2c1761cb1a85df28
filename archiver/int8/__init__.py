"""Dynamic int8 conversion, one module per model format.

Each format module (`torchscript.py`, `onnx.py`) defines `CONVERTER`, an `Int8Converter`
(conversion.py): how that format's model file becomes int8 and how both versions run.
archiver/quantize.py picks the converter by model format, measures the result and reports it,
so a new format is one module here plus one entry in `scriptserve.archiver.quantize.CONVERTERS`.
"""
