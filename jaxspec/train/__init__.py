"""Training the drafters: shared (pieces every recipe uses), assistant (`python -m
jaxspec.train.assistant`: an MTP assistant for any supported target), default_pair (`python -m
jaxspec.train.default_pair`: the embedded toy pair's recipe), corpus (its Python-source corpus),
quality (its plausibility score). Imported only when run: nothing at inference time needs it."""
