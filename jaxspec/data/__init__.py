"""Package data, no code: default_pair/ (the embedded pair's weights, tokenizer, metrics and held-out
prompts: `jaxspec.default_pair` loads them) and drafters/<target name>/ (shipped drafters: `jaxspec.pairs`)."""
