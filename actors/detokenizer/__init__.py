"""The detokenizer role: OutputProcessor (output_processor.py: incremental decoding, stop
strings, RequestOutput deltas) and its actor shell (actor.py)."""
