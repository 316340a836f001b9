"""The marker file a GGUF conversion leaves in its output (loader/gguf_convert.py), which
`resolve_model` reads on every start to reuse it: apart from the converter, so reading
it imports no torch."""

CONVERTER_VERSION = 1
MARKER_FILE = "gyrfalcon_gguf.json"
