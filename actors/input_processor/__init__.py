"""The input processor role: InputProcessor (processor.py: chat template, tokenization,
validation) and its actor shell (actor.py)."""
