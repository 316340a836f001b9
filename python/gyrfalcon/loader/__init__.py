"""Model loading: resolve a ``--model`` argument (`resolve`), convert GGUF files
(`gguf_convert`), stream HF weights (`hf_weights`). Import the module you need: the
launcher's `resolve` must import no torch before it spawns the ranks."""
