"""The frontend, in the caller's process: AsyncClient (client.py) over one engine's
connection (engine_client.py) or several (data_parallel.py), the offline LLM (llm.py), beam
search, request streams and the client calls of the features (lora.py, pooling.py)."""
