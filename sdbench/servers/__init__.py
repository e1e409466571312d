"""The engines users deploy (llama.cpp's server, vLLM's), driven through their own HTTP APIs in their own processes:
installed engines (install.py), a server's life (process.py), its streamed replies (client.py), and one adapter per
engine (llamacpp.py, vllm.py) behind `engines.py`'s protocol."""
