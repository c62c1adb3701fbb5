"""Names the default model answers to (no torch here: adapters compare names cheaply)."""

# Its own name, and the name an engine reports for it (the GGUF it is converted from).
DEFAULT_MODEL_NAMES = ("smollm2-135m-instruct", "smollm2-135m-instruct.q4_1")
